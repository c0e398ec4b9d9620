"""Clips in whole windows, for a processor whose own call takes no audio (Voxtral's).

`VoxtralProcessor` leaves a conversation's audio to mistral_common: its `apply_chat_template` hands
the messages to mistral_common's tokenizer, which pads each clip with silence to whole 30 s windows
and writes it as `[BEGIN_AUDIO]` and one `[AUDIO]` a 1280 samples; its `__call__` refuses text
with an audio token in it. The recipes render a checkpoint's chat template and give the processor
the text with one placeholder a clip, as for every other family. `WindowedAudio` is that call for
such a processor: each placeholder becomes the opening token and the rows its encoder gives the
clip's windows (375 a 30 s window for Voxtral: 1500 positions after its convolutions, 4 to a row),
and the clip's features are the extractor's over the clip padded to whole windows, a window a row
of `input_features`, as mistral_common and the processor's own feature path cut them. Nothing is
truncated: a 45 s clip is two windows. `audio_windows` (WINDOWS) says how many windows each clip
has, for each clip's placeholders to be checked against its encoder rows
(`mmrecipes.vlm.model.audio_rows`); it is no model input.

The template mistral_common writes for such a tokenizer names an audio part as OpenAI does
(`input_audio`); the rows name it as transformers does (`{"type": "audio"}`): the processor's chat
template here renders the one as the other (`AUDIO_PARTS`); the checkpoint is saved with its own.
"""

import inspect
import math
import re

import numpy
import torch
from transformers import ProcessorMixin

from .audio import hears

# how many windows each clip has, beside its features
WINDOWS = "audio_windows"
# mistral_common's token that opens each clip's run of placeholders
BEGIN_AUDIO = "[BEGIN_AUDIO]"
# a prelude to the template: each {"type": "audio"} part handed on as {"type": "input_audio"}
AUDIO_PARTS = (
    "{%- set renamed = namespace(messages=[]) -%}"
    "{%- for message in messages -%}"
    "{%- if message.content is string or message.content is none -%}"
    "{%- set renamed.messages = renamed.messages + [message] -%}"
    "{%- else -%}{%- set parts = namespace(items=[]) -%}"
    "{%- for part in message.content -%}"
    "{%- set parts.items = parts.items + [dict(part, type='input_audio') if part.type == 'audio'"
    " else part] -%}"
    "{%- endfor -%}"
    "{%- set renamed.messages = renamed.messages + [dict(message, content=parts.items)] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set messages = renamed.messages -%}\n"
)


def windowed_audio(model, processor):
    """`processor` as `WindowedAudio` where the model hears (`audio.hears`) and the processor's call
    takes no audio (Voxtral's); else `processor` as it is."""
    if not hears(model, processor) or takes_audio(processor):
        return processor
    return WindowedAudio(processor, window_rows(model.config.audio_config))


def takes_audio(processor) -> bool:
    return "audio" in inspect.signature(processor.__call__).parameters


def window_rows(audio_config) -> int:
    """The rows a window gives: the encoder's positions after its convolutions, their values joined
    a projector input at a time (Voxtral's `get_audio_features`)."""
    positions, width = audio_config.max_source_positions, audio_config.hidden_size
    return positions * width // audio_config.intermediate_size


class WindowedAudio:
    """`processor(text=..., audio=clips, audio_kwargs=...)` for a processor that takes no audio (the
    module docstring); everything else is the processor's own (saving too: the checkpoint keeps its
    template)."""

    def __init__(self, processor, rows_per_window: int):
        self.processor, self.rows_per_window = processor, rows_per_window
        tokenizer = processor.tokenizer
        opening = tokenizer.convert_tokens_to_ids(BEGIN_AUDIO)
        if opening in (None, tokenizer.unk_token_id):
            raise ValueError(f"{type(processor).__name__} takes no audio and its tokenizer has no "
                             f"{BEGIN_AUDIO}: how its clips are written in the text is not known "
                             "here, so its audio is not trained")
        # mistral_common's own backend reads "[BEGIN_AUDIO]" in text as letters, not the token
        if tokenizer(BEGIN_AUDIO, add_special_tokens=False)["input_ids"] != [opening]:
            raise ValueError(f"{type(tokenizer).__name__} reads the special tokens a chat template "
                             "writes as plain text: load transformers' tokenizer converted from "
                             "tekken.json instead (mistral_format=False, or without mistral_common)")
        # a window: the extractor's 30 s, its frames the encoder's input
        extractor = processor.feature_extractor
        self.window, self.window_frames = extractor.n_samples, extractor.nb_max_frames

    def __getattr__(self, name):
        if name == "processor":  # unpickling: not set yet
            raise AttributeError(name)
        return getattr(self.processor, name)

    @property
    def chat_template(self):
        template = self.processor.chat_template or self.processor.tokenizer.chat_template
        return AUDIO_PARTS + template if isinstance(template, str) else template

    @chat_template.setter
    def chat_template(self, template):
        self.processor.chat_template = template.removeprefix(AUDIO_PARTS)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        template = self.chat_template if chat_template is None else AUDIO_PARTS + chat_template
        return ProcessorMixin.apply_chat_template(self.processor, conversation,
                                                  chat_template=template, **kwargs)

    def __call__(self, text=None, images=None, audio=None, audio_kwargs=None, **kwargs):
        if images:
            raise ValueError(f"{type(self.processor).__name__} takes no images")
        texts, clips = [text] if isinstance(text, str) else list(text), list(audio or ())
        token = self.processor.audio_token
        placeholders = sum(piece.count(token) for piece in texts)
        if placeholders != len(clips):
            raise ValueError(f"{placeholders} audio placeholders, {len(clips)} clips")
        windows = [max(1, math.ceil(len(clip) / self.window)) for clip in clips]
        runs = iter(windows)

        def written(_):  # a clip's placeholder: its opening token and its windows' rows
            return BEGIN_AUDIO + token * self.rows_per_window * next(runs)

        texts = [re.sub(re.escape(token), written, piece) for piece in texts]
        kwargs = {name: value for name, value in kwargs.items() if not name.endswith("_kwargs")}
        encoded = self.processor.tokenizer(texts, **kwargs)
        if clips:
            rate = (audio_kwargs or {}).get("sampling_rate", self.feature_extractor.sampling_rate)
            encoded["input_features"] = torch.cat([self.features(clip, count, rate)
                                                   for clip, count in zip(clips, windows)])
            encoded[WINDOWS] = torch.tensor(windows)
        return encoded

    def features(self, clip, windows: int, rate: int) -> torch.Tensor:
        """The extractor's features of `clip` padded with silence to `windows` windows: (windows,
        mel bins, frames a window)."""
        extractor = self.feature_extractor
        clip = numpy.asarray(clip, numpy.float32)
        padded = numpy.pad(clip, (0, windows * self.window - len(clip)))
        frames = extractor(padded, sampling_rate=rate, padding="longest", truncation=False,
                           return_tensors="pt")["input_features"][0]
        if frames.shape[-1] != windows * self.window_frames:
            kept = frames.shape[-1] * extractor.hop_length / extractor.sampling_rate
            raise ValueError(f"{type(extractor).__name__} keeps {kept:.1f} s of a "
                             f"{len(padded) / rate:.0f} s clip ({windows} windows): it truncates "
                             "(its settings force truncation or a max_length)")
        return frames.reshape(len(frames), windows, self.window_frames).transpose(0, 1)
