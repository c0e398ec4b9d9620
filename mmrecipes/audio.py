"""Audio clips from whatever a row or a benchmark document holds, decoded with PyAV (its wheels
bundle FFmpeg; in the DataLoader workers for training rows): one channel of float32 samples at the
rate the model's feature extractor reads, given to its processor whole (`audio_kwargs`), where the
model hears (`hears`).

`decode_audio` never raises: it gives the samples, or why there are none, for the caller to count:
"audio_undecodable" (no such file, no audio stream, a broken header or stream), "audio_empty" (a
stream with no samples) and "audio_too_long" (over --audio_max_seconds: from the header before
anything is decoded, else as soon as the decoded samples pass it, so a 2-hour file without a length
in its header is never held whole). A video file's audio track is a clip like any other. Channels
are averaged into one here (what librosa's and torchaudio's mono do), then FFmpeg's resampler
converts the rate of that one channel. Given the channels of a WAV file of 8 (no named positions),
FFmpeg's own down-mix sums them past full scale (a tone whose channels peak at 0.06-0.5 came out at
1.13), and PyAV 18's resampler asked to keep them while it converts the sample type ends the process
(a segmentation fault).
"""

import logging
import math

import av
import numpy
import torch

from .images import readable_source

logger = logging.getLogger(__name__)

AUDIO_COUNTED = ("audio_undecodable", "audio_empty", "audio_too_long")  # decode_audio's problems
# a sample type's full scale (u8 centred on 128)
FULL_SCALE = {"u8": 128.0, "s16": 2.0 ** 15, "s32": 2.0 ** 31, "s64": 2.0 ** 63, "flt": 1.0, "dbl": 1.0}


def decode_audio(raw_audio, sampling_rate: int, max_seconds: float):
    """(samples: float32 of shape (n,) at `sampling_rate`, None), or (None, problem)."""
    limit = math.ceil(max_seconds * sampling_rate)
    try:
        raw_audio = readable_source(raw_audio)
        if raw_audio is None:
            return None, "audio_undecodable"
        with av.open(raw_audio, mode="r") as container:
            if not container.streams.audio:
                return None, "audio_undecodable"
            stream = container.streams.audio[0]
            seconds = stream_seconds(container, stream)
            if seconds is not None and seconds > max_seconds:
                return None, "audio_too_long"
            to_rate = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
            pieces, held = [], 0
            for frame in container.decode(stream):
                mono = av.AudioFrame.from_ndarray(averaged(frame)[None], format="flt", layout="mono")
                mono.sample_rate = frame.sample_rate
                for piece in to_rate.resample(mono):
                    pieces.append(piece.to_ndarray().reshape(-1))
                    held += len(pieces[-1])
                if held > limit:
                    return None, "audio_too_long"
            pieces += [piece.to_ndarray().reshape(-1) for piece in to_rate.resample(None)]
    # missing files; PyAV raises many types for corrupt or truncated input
    except Exception as error:
        logger.debug("undecodable audio: %s", error)
        return None, "audio_undecodable"
    samples = numpy.concatenate(pieces) if pieces else numpy.zeros(0, numpy.float32)
    if not len(samples):
        return None, "audio_empty"
    if len(samples) > limit:
        return None, "audio_too_long"
    return samples, None


def resampled(samples, rate: int, to_rate: int) -> numpy.ndarray:
    """One channel of samples at `rate` as float32 at `to_rate`, by FFmpeg's resampler as
    `decode_audio` converts (a clip a harness decoded itself: lmms-eval's {"array",
    "sampling_rate"})."""
    mono = numpy.asarray(samples, numpy.float32).reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(mono, format="flt", layout="mono")
    frame.sample_rate = rate
    converter = av.AudioResampler(format="flt", layout="mono", rate=to_rate)
    converted = [*converter.resample(frame), *converter.resample(None)]
    pieces = [piece.to_ndarray().reshape(-1) for piece in converted]
    return numpy.concatenate(pieces) if pieces else numpy.zeros(0, numpy.float32)


def averaged(frame) -> numpy.ndarray:
    """A decoded frame's channels averaged into one, float32 at full scale 1."""
    values = frame.to_ndarray()  # planar: (channels, samples); packed: (1, samples x channels)
    channels = len(frame.layout.channels)
    if not frame.format.is_planar:
        values = values.reshape(-1, channels).T
    kind = frame.format.name.removesuffix("p")
    values = values.astype(numpy.float64) - (128 if kind == "u8" else 0)
    return (values.mean(axis=0) / FULL_SCALE[kind]).astype(numpy.float32)


def stream_seconds(container, stream) -> float | None:
    """A stream's length from the header: its own duration, else the container's; None if neither
    says."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def audio_kwargs(processor, clips=()) -> dict:
    """The feature extractor's settings for a row's `clips`: their own rate, and never cut
    (Whisper-style extractors cut at 30 s unless told; Gemma 4's at 30 s too). A Whisper-style
    extractor pads every clip to its window (the Qwen2.5-Omni processor forces it): to the longest
    clip where that is longer, so clips of different lengths over the window stack."""
    extractor = processor.feature_extractor
    kwargs = {"sampling_rate": extractor.sampling_rate, "truncation": False}
    window = getattr(extractor, "n_samples", None)
    if window is not None:
        kwargs["max_length"] = max([window, *map(len, clips)])
    return kwargs


def hears(model, processor=None) -> bool:
    """Whether a model hears: its config holds an audio tower, its base model a `get_audio_features` (or encodes its
    clips inline: `encodes_audio_inline`) and (given) its processor a feature extractor and an audio token."""
    base_model = model.base_model
    if getattr(model.config, "audio_config", None) is None or (
            getattr(base_model, "get_audio_features", None) is None and not encodes_audio_inline(base_model)):
        return False
    return processor is None or (getattr(processor, "feature_extractor", None) is not None
                                 and getattr(processor, "audio_token", None) is not None)


def encodes_audio_inline(base_model) -> bool:
    """A base model with no `get_audio_features` whose forward runs its `audio_tower` and `multi_modal_projector`
    inline (Qwen2-Audio)."""
    parts = (getattr(base_model, name, None) for name in ("audio_tower", "multi_modal_projector"))
    return getattr(base_model, "get_audio_features", None) is None and all(
        isinstance(part, torch.nn.Module) for part in parts)


@torch.no_grad()
def window_seconds(encode, processor) -> float | None:
    """The longest clip, in seconds, that `encode` (a callable of the processor's outputs: a model's audio step, or
    its forward) reads: the feature extractor's window (Whisper's 30 s) where a clip a second longer is refused
    (Qwen2-Audio's encoder takes exactly the window's 3000 frames); None where it reads that clip, or the extractor
    has no window."""
    extractor = processor.feature_extractor
    window = getattr(extractor, "n_samples", None)
    if window is None:
        return None
    clip = numpy.random.default_rng(0).uniform(-0.5, 0.5, window + extractor.sampling_rate).astype(numpy.float32)
    made = processor(text=processor.audio_token, audio=[clip], audio_kwargs=audio_kwargs(processor, [clip]),
                     return_tensors="pt")
    try:
        encode(made)
    except (ValueError, RuntimeError):
        return window / extractor.sampling_rate
    return None


def heard_rate(model, processor) -> int | None:
    """The rate a model that hears (`hears`) reads its clips at; None where it does not hear."""
    return processor.feature_extractor.sampling_rate if hears(model, processor) else None
