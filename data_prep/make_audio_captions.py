"""Make the embedded audio-caption pairs and their zero-shot set: synthesised sounds, each with a caption.

    python data_prep/make_audio_captions.py   # writes data/audio_captions/{train,test}-*.parquet and
                                              # data/audio_zeroshot/test-*.parquet

Deterministic (fixed seeds). Each clip is 8 kHz mono at 8-bit resolution, FLAC-encoded by PyAV's bundled FFmpeg
without header padding (the recipe resamples it to the feature extractor's 48 kHz). Six kinds of sound, the
zero-shot classes ("This is a sound of {label}."):
- beeps: one to four 80 ms beeps at a low or high pitch in a second ("three high beeps");
- a rising tone / a falling tone: a one-second sweep between a low and a high pitch ("a rising tone from low to
  high");
- noise: white noise, loud or soft ("a burst of loud noise");
- a steady hum: a low or high tone held ("a steady low hum");
- clicking: 5 ms clicks, slow or fast ("fast clicking").
Noise, hums and clicks last 1 to 3 s, so some clips are longer than the tiny CLAP's 2 s window and are cropped at
random (what is heard stays the same); beeps and sweeps last one second. Captions, phrased in four ways ("the sound
of three high beeps"), are the pairs' `text`, the clips' bytes the `audio` column; the zero-shot set has an `audio`
column and a `label` (ClassLabel of the six kinds).
"""

import argparse
import random
from pathlib import Path

import datasets
import numpy

from make_audio import RATE, encode_flac, tone

ROOT = Path(__file__).resolve().parents[1]
LABELS = ("beeps", "a rising tone", "a falling tone", "noise", "a steady hum", "clicking")
COUNTS = ("one", "two", "three", "four")
PITCHES = {"low": (220.0, 330.0), "high": (880.0, 1320.0)}  # Hz: a low and a high band
PHRASINGS = ("{}", "the sound of {}", "a recording of {}", "you can hear {}")  # as captions vary


def sweep(start: float, end: float, seconds: float = 1.0, amplitude: float = 0.4) -> numpy.ndarray:
    """A sine whose pitch moves geometrically from `start` to `end` Hz, with 5 ms fades."""
    t = numpy.arange(int(seconds * RATE)) / RATE
    frequency = start * (end / start) ** (t / seconds)
    phase = 2 * numpy.pi * numpy.cumsum(frequency) / RATE
    fade = numpy.minimum(1.0, numpy.minimum(t, t[::-1]) / 0.005)
    return (amplitude * fade * numpy.sin(phase)).astype(numpy.float32)


def sound(label: str, rng: random.Random) -> tuple[numpy.ndarray, str]:
    """(samples, caption) of one clip of kind `label`."""
    pitch = rng.choice(sorted(PITCHES))
    frequency = rng.uniform(*PITCHES[pitch])
    seconds = rng.choice((1.0, 1.5, 2.5, 3.0))  # the stationary kinds only
    if label == "beeps":
        count = rng.randrange(1, 5)
        clip, slot = numpy.zeros(RATE, numpy.float32), RATE // count
        for index in range(count):
            start = index * slot + rng.randrange(0, slot - int(0.08 * RATE))
            clip[start:start + int(0.08 * RATE)] += tone(frequency, 0.08)
        return clip, f"{COUNTS[count - 1]} {pitch} beep{'s' * (count > 1)}"
    if label in ("a rising tone", "a falling tone"):
        low, high = rng.uniform(*PITCHES["low"]), rng.uniform(*PITCHES["high"])
        rising = label == "a rising tone"
        clip = sweep(low, high) if rising else sweep(high, low)
        return clip, rng.choice(("a rising tone", "a rising tone from low to high", "a tone rising")
                                if rising else ("a falling tone", "a falling tone from high to low", "a tone falling"))
    if label == "noise":
        loudness = rng.choice(("loud", "soft"))
        amplitude = 0.3 if loudness == "loud" else 0.05
        clip = numpy.random.default_rng(rng.randrange(2 ** 32)).normal(0, amplitude, int(seconds * RATE))
        return clip.astype(numpy.float32), rng.choice((f"{loudness} noise", f"a burst of {loudness} noise"))
    if label == "a steady hum":
        return tone(frequency, seconds), f"a steady {pitch} hum"
    speed = rng.choice(("slow", "fast"))
    clip = numpy.zeros(int(seconds * RATE), numpy.float32)
    for start in range(0, len(clip) - 40, int(RATE / (4 if speed == "slow" else 20))):
        clip[start:start + 40] = 0.5 * numpy.hanning(40)
    return clip, f"{speed} clicking"


def make_pairs(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        samples, caption = sound(LABELS[index % len(LABELS)], rng)
        caption = rng.choice(PHRASINGS).format(caption)
        rows.append({"audio": encode_flac(samples, padding=0, bits=8), "text": caption})
    return rows


def make_zeroshot(count: int, seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    rows = [{"audio": encode_flac(sound(LABELS[index % len(LABELS)], rng)[0], padding=0, bits=8),
             "label": index % len(LABELS)} for index in range(count)]
    features = datasets.Features({"audio": datasets.Value("binary"), "label": datasets.ClassLabel(names=LABELS)})
    return datasets.Dataset.from_list(rows, features=features)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(ROOT / "data"))
    parser.add_argument("--train_rows", type=int, default=384)
    parser.add_argument("--test_rows", type=int, default=96)
    parser.add_argument("--zeroshot_rows", type=int, default=96)
    args = parser.parse_args()
    pairs, zeroshot = Path(args.output) / "audio_captions", Path(args.output) / "audio_zeroshot"
    pairs.mkdir(parents=True, exist_ok=True)
    zeroshot.mkdir(parents=True, exist_ok=True)
    for split, count, seed in (("train", args.train_rows, 0), ("test", args.test_rows, 1)):
        datasets.Dataset.from_list(make_pairs(count, seed)).to_parquet(pairs / f"{split}-00000-of-00001.parquet")
        print(f"{split}: {count} pairs -> {pairs}")
    make_zeroshot(args.zeroshot_rows, 2).to_parquet(zeroshot / "test-00000-of-00001.parquet")
    print(f"zero-shot: {args.zeroshot_rows} clips of {len(LABELS)} classes -> {zeroshot}")


if __name__ == "__main__":
    main()
