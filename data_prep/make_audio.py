"""Make the embedded audio conversations: short synthesised sounds, as chat rows.

    python data_prep/make_audio.py   # writes data/vlm_shapes/audio_chat/{train,test}-*.parquet and data/tiny_audio_vlm

Deterministic (fixed seed). Each clip is one second of 8 kHz mono, FLAC-encoded by PyAV's bundled FFmpeg (a few
KB; the recipes resample it to the feature extractor's 16 kHz); its question needs the sound, never the text alone:
- "How many beeps?": one to four 80 ms beeps at one pitch, spread over the second ("one" ... "four");
- "Which tone is higher?": two 300 ms tones of different pitches, one after the other ("first" or "second").
Rows are in chat format: `messages` with a `{"type": "audio"}` part and an `audios` column holding each clip's bytes
(LLaMA-Factory's and ms-swift's column). data/tiny_audio_vlm is the tiny Qwen2.5-Omni thinker of
`data_prep/tiny_vlm_2026.py --family qwen2_5_omni`, untrained: recipes/configs/vlm_audio.yaml trains it on these.
"""

import argparse
import io
import random
from pathlib import Path

import av
import numpy

from make_videos import clip_row, write_splits
from tiny_vlm import save_family
from tiny_vlm_2026 import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
RATE, SECONDS = 8000, 1.0
COUNTS = ("one", "two", "three", "four")
PITCHES = (330.0, 440.0, 587.0, 784.0, 988.0)  # Hz: any two a fourth or more apart


def tone(frequency: float, seconds: float, amplitude: float = 0.4) -> numpy.ndarray:
    """A sine tone with 5 ms fades (no clicks at its edges)."""
    t = numpy.arange(int(seconds * RATE)) / RATE
    fade = numpy.minimum(1.0, numpy.minimum(t, t[::-1]) / 0.005)
    return (amplitude * fade * numpy.sin(2 * numpy.pi * frequency * t)).astype(numpy.float32)


def beeps(count: int, frequency: float, rng: random.Random) -> numpy.ndarray:
    """`count` beeps of 80 ms in a second, one in each of `count` equal slots at a random place in it."""
    clip = numpy.zeros(int(SECONDS * RATE), numpy.float32)
    slot = int(SECONDS * RATE) // count
    for index in range(count):
        start = index * slot + rng.randrange(0, slot - int(0.08 * RATE))
        clip[start:start + int(0.08 * RATE)] += tone(frequency, 0.08)
    return clip


def two_tones(first: float, second: float) -> numpy.ndarray:
    """Two 300 ms tones with 100 ms of silence around and between them."""
    gap = numpy.zeros(int(0.1 * RATE), numpy.float32)
    clip = numpy.concatenate([gap, tone(first, 0.3), gap, tone(second, 0.3), gap])
    return numpy.pad(clip, (0, int(SECONDS * RATE) - len(clip)))


def encode_flac(samples: numpy.ndarray, padding: int = 8192, bits: int = 16) -> bytes:
    """Mono float samples -> FLAC bytes (16-bit), with FFmpeg's `padding` bytes of room for tags; with
    fewer `bits` of resolution the low ones are zero, which FLAC stores for nothing (half the bytes
    at 8)."""
    samples = numpy.clip(samples, -1, 1)
    values = (samples * 32767 if bits == 16 else numpy.rint(samples * (2 ** (bits - 1) - 1)) * 2 ** (16 - bits))
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="flac", options={"metadata_header_padding": str(padding)}) as container:
        stream = container.add_stream("flac", rate=RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(values.astype(numpy.int16)[None], format="s16", layout="mono")
        frame.sample_rate = RATE
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buffer.getvalue()


def make_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        if index % 2 == 0:
            number = rng.randrange(len(COUNTS))
            clip = beeps(number + 1, rng.choice(PITCHES), rng)
            rows.append(clip_row("audio", "How many beeps?", COUNTS[number], encode_flac(clip)))
        else:
            first, second = rng.sample(PITCHES, 2)
            rows.append(clip_row("audio", "Which tone is higher?", "first" if first > second else "second",
                                  encode_flac(two_tones(first, second))))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(ROOT / "data" / "vlm_shapes" / "audio_chat"))
    parser.add_argument("--model_dir", default=str(ROOT / "data" / "tiny_audio_vlm"))
    parser.add_argument("--train_rows", type=int, default=256)
    parser.add_argument("--test_rows", type=int, default=64)
    args = parser.parse_args()
    write_splits(Path(args.output), make_rows, args.train_rows, args.test_rows)
    save_family(FAMILIES, "qwen2_5_omni", Path(args.model_dir))
    print(f"wrote {args.model_dir}")


if __name__ == "__main__":
    main()
