"""Audio-caption pairs for CLAP: each clip decoded with PyAV (`audio.decode_audio`, in the DataLoader
workers) at the feature extractor's rate and turned into CLAP's features one row at a time.

A clip longer than the extractor's window follows the rule its checkpoint ships
(`truncation`): `rand_trunc` crops it at a random offset; `fusion` stacks three random crops with
the whole clip shrunk to the window, and flags it `is_longer`. The draws come from the row's own
seed (`ROW_SEED` in training, its place in the stream in evaluation), so every engine, any number
of ranks and a resumed run draw the same crop for a row. A shorter clip is filled to the window as
the extractor's `padding` says (`repeatpad`: repeated). The fusion rule's batch step, flagging one
random row when none is longer (LAION-CLAP trains its fusion layers so), is the collator's.

Rows that cannot be used are counted (`arguments.AUDIO_PAIR_COUNTED`): no clip in the row, a clip PyAV
cannot decode, one without samples, over --audio_max_seconds (a 10-hour file is refused from its
header, or as soon as the decoded samples pass the limit), or digital silence.
"""

import numpy
import torch
from transformers import SequenceFeatureExtractor

from ..audio import decode_audio

SILENCE = 2.0 ** -15  # below one step of 16-bit audio: every sample of a silent clip


def is_audio_extractor(processor) -> bool:
    """Whether the model's media processor is an audio feature extractor (CLAP's; not
    `audio_windows.takes_audio`, which asks whether a VLM processor's call takes clips)."""
    return isinstance(processor, SequenceFeatureExtractor)


def decoded_clip(raw, extractor, max_seconds: float):
    """(samples at the extractor's rate, None) or (None, why it is skipped)."""
    if raw is None or (isinstance(raw, dict) and not (raw.get("bytes") or raw.get("path"))):
        return None, "no_audio"
    samples, problem = decode_audio(raw, extractor.sampling_rate, max_seconds)
    if problem is None and numpy.abs(samples).max() < SILENCE:
        return None, "audio_silent"
    return samples, problem


def clip_features(extractor, samples: numpy.ndarray, seed: int) -> dict:
    """One clip's `input_features` and `is_longer` as the extractor makes them, its random crops
    drawn from `seed` (the extractor draws from numpy's global generator: restored afterwards), and
    the seed (`clip_seed`: `stacked_clips` draws the batch's fusion flag from it)."""
    state = numpy.random.get_state()
    numpy.random.seed(seed % 2 ** 32)
    try:
        made = extractor(samples, sampling_rate=extractor.sampling_rate, return_tensors="pt")
    finally:
        numpy.random.set_state(state)
    # a batch of one that is not longer gets the fusion rule's flag; the collator applies that rule to its batch
    return {"input_features": made["input_features"][0], "is_longer": torch.tensor([is_longer(extractor, samples)]),
            "clip_seed": seed}


def is_longer(extractor, samples) -> bool:
    """The extractor's own flag for one clip: longer than its window, and (fusion) by more than one
    hop, where it uses the whole clip."""
    window = extractor.nb_max_samples
    if extractor.truncation == "fusion":
        return len(samples) > window and len(samples) // extractor.hop_length != window // extractor.hop_length
    return len(samples) > window


def stacked_clips(rows: list[dict], extractor) -> dict:
    """The rows' features (`clip_features`) as one batch; under the extractor's `fusion` rule, a
    batch with no longer clip gets one row flagged (the extractor's batch step), drawn from the
    first row's seed."""
    flags = torch.stack([row["is_longer"] for row in rows])
    if extractor.truncation == "fusion" and not flags.any():
        flags[numpy.random.default_rng(rows[0]["clip_seed"] % 2 ** 32).integers(len(rows))] = True
    return {"input_features": torch.stack([row["input_features"] for row in rows]), "is_longer": flags}


def window_rule(extractor) -> str:
    """The log's line on what happens to a clip of another length than the extractor's window."""
    seconds = extractor.nb_max_samples / extractor.sampling_rate
    longer = {"rand_trunc": f"a random {seconds:g} s crop",
              "fusion": "three random crops and the whole clip shrunk to the window (fusion)"}
    return (f"audio: clips at {extractor.sampling_rate} Hz; longer than the feature extractor's {seconds:g} s window: "
            f"{longer.get(extractor.truncation, extractor.truncation)} ({extractor.truncation}, as the checkpoint's "
            f"extractor says; counted as audio_cropped); shorter: filled by {extractor.padding}")
