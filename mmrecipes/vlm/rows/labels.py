"""Answer-token labels from a checkpoint's own chat template, whatever the template contains
(docs/vlm.md, "Answer tokens from the checkpoint's own template").

The targets are the assistant turns, each from the end of its generation prompt (a space the model
must write is a target) to its end-of-turn token, found by the template's `{% generation %}` markers
or, without them, by rendering prefixes. Markers that also take in the tail of the generation prompt
(an empty think block) are read from the prompt's end. Without markers, a turn the template rewrites
once later turns follow (Qwen3 and Qwen3.5 drop its think block) is context, not a target: the last
turn is the one trained, as the model sees it at inference; a conversation whose last turn is
rewritten is refused, never labelled wrong. An unprompted rendering that ends in the end-of-text
token (Phi-3.5's) is compared without it. The character spans become token positions by aligning the
text tokenised alone with the ids the processor returns with its images (expansion only inserts
tokens), without trusting the processor's offsets; a turn that does not align raises
`UnalignedAnswer`.
"""

import difflib
import re

import jinja2
import numpy
import torch
from transformers.utils.chat_template_utils import render_jinja_template

from ...audio import audio_kwargs
from ...audio_windows import WINDOWS
from ...images import NORMALIZED_BY, UINT8_PIXELS, fused_normalization, uint8_normalization
from ...template_kwargs import check_template_kwargs

IGNORE_INDEX = -100  # label of positions that are not trained on (prompt, image tokens, padding)
REFUSED = "the template refuses the conversation"
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
MAX_DIFF_CELLS = 4_000_000  # a diff of 2,000 x 2,000 tokens of repetitive text took 0.5 s


class TemplateError(ValueError):
    """No rule finds the assistant turns of a conversation in this chat template."""


class UnalignedAnswer(TemplateError):
    """The answer tokens of a conversation cannot be found exactly in the ids the processor
    returns."""


# the one-line text question the template checks render (the probe's, without its image)
QUESTION = {"role": "user", "content": [{"type": "text", "text": "What colour is it?"}]}


class ReasoningDropped(TemplateError):
    """A row's reasoning (`reasoning_content`) that the chat template leaves out of its rendering."""


class EarlierReasoningDropped(ReasoningDropped):
    """A template that trains an earlier assistant turn but drops its reasoning once later turns
    follow."""


# longer than a Whisper-style extractor's 30 s window: the probe clip a truncating feature extractor is caught on
PROBE_AUDIO_SECONDS = 45
# the processors' names for which feature frames are a clip's: Gemma 4's; the Qwen Omni thinkers' and Qwen2-Audio's
FEATURE_MASKS = ("input_features_mask", "feature_attention_mask")


class AnswerLabeller:
    """`labeller(messages, images, videos, tools, audios)` -> (processor outputs of the conversation, target mask).

    `stop_token_ids`: the tokens that end a turn (the generation config's eos ids and the
    tokenizer's eos). `videos`: how the model trains on clips (`families.video_path`; None: it does
    not); they go to the processor as decoded frames (`mmrecipes.vlm.rows.videos.DecodedVideo`) with
    their metadata, already sampled. `audio`: the model hears (`families.audio_inputs`); its clips (mono float32 at
    the feature extractor's rate) go to the processor whole, never truncated (`check_audio_features`), and their
    placeholders are never targets. Images (where the image processor gives its own floats that
    way: `images.uint8_normalization`) and clips that reach the model as `pixel_values_videos` come
    back uint8, with the constants that finish them on the device (`images.NORMALIZED_BY`,
    `images.to_device`). A conversation whose turns no rule finds raises `TemplateError`.
    """

    def __init__(self, processor, stop_token_ids, videos: str | None = None, template: str | None = None,
                 empty_think: str = "context", template_kwargs: dict | None = None, audio: bool = False):
        self.processor, self.tokenizer = processor, processor.tokenizer
        # `template`: a training format the model is not saved with
        self.template = template or processor.chat_template
        if not isinstance(self.template, str):
            raise TemplateError("the processor has no chat template (or several): give one with --chat_template_path")
        # --chat_template_kwargs, in every rendering; a key the template never reads is refused now
        self.template_kwargs = template_kwargs or {}
        self.kwargs_line = check_template_kwargs(template_kwargs, self.template, self.tokenizer.special_tokens_map)
        self.has_markers = bool(GENERATION_MARKER.search(self.template))
        self.stop_strings = sorted({self.tokenizer.convert_ids_to_tokens(int(i)) for i in stop_token_ids}, key=len,
                                   reverse=True)
        # None: a model that only hears (its processor has no image token)
        sees = getattr(processor, "image_token", None) is not None
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(processor.image_token) if sees else None
        self.video_token_id = self.tokenizer.convert_tokens_to_ids(processor.video_token) if videos else None
        self.audio_token_id = self.tokenizer.convert_tokens_to_ids(processor.audio_token) if audio else None
        if audio:
            check_audio_features(processor)
        as_clips = videos is not None and videos != "as images"  # not frames among the image tiles
        # {pixel key: the constants that finish its uint8 values on the device, or None: floats from the processor}
        self.normalization = {"pixel_values": uint8_normalization(processor.image_processor) if sees else None,
                              "pixel_values_videos": fused_normalization(processor.video_processor) if as_clips
                              else None}
        self.rule = "generation markers" if self.has_markers else "prefix renderings"
        # `context`: the empty think block the template writes before an answer without reasoning is no target
        # (trained, it teaches a thinking model to close its block at once: to stop thinking); `target`: trained
        self.empty_think, self.empty_think_block = empty_think, self._empty_think_block()

    def render(self, messages, add_generation_prompt=False, marked=False, tools=None):
        """(text, the character spans of its `{% generation %}` blocks if `marked`), with the
        `tools`' JSON schemas where a row gives them (TRL's `tools` column)."""
        try:
            texts, indices = render_jinja_template(
                conversations=[messages], chat_template=self.template, add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=marked, tools=tools, **self.tokenizer.special_tokens_map,
                **self.template_kwargs)
        # raise_exception(...) in the template: roles out of order, say
        except jinja2.TemplateError as error:
            raise TemplateError(f"{REFUSED}: {error}") from error
        return texts[0], indices[0] if indices else []

    def _empty_think_block(self) -> str:
        """What the template writes between its generation prompt and an answer without reasoning, where
        that is the slot its reasoning fills (Qwen3's empty think block), found by rendering; else ""."""
        answer = {"role": "assistant", "content": [{"type": "text", "text": "ANSWER"}]}
        try:
            prompt = self.render([QUESTION], add_generation_prompt=True)[0]
            plain = self.render([QUESTION, answer])[0]
            reasoned = self.render([QUESTION, answer | {"reasoning_content": "REASONING"}])[0]
        except TemplateError:  # a template that refuses the probe has its check_template say why
            return ""
        if not (plain.startswith(prompt) and reasoned.startswith(prompt) and "ANSWER" in plain):
            return ""
        block = plain[len(prompt):plain.index("ANSWER")]
        filled = reasoned[len(prompt):reasoned.find("ANSWER")]
        return block if block.strip() and "REASONING" in filled else ""

    def generation_prompt(self) -> str:
        """What `add_generation_prompt` adds after a user's turn: the assistant header a sample
        starts after, and what the template writes there before the model does (Qwen3.5's think
        templates: `<think>\n`)."""
        without, prompted = (self.render([QUESTION], add_generation_prompt=asked)[0] for asked in (False, True))
        return prompted.removeprefix(without)

    def answer_spans(self, messages, tools=None) -> tuple[str, list[tuple[int, int] | None]]:
        """(the rendered conversation, the character span of each assistant turn: from the end of
        its generation prompt to its end-of-turn token; None for a turn the template rewrites once
        later turns follow, which is context, not a target)."""
        text, marked = self.render(messages, marked=self.has_markers, tools=tools)
        turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        if self.has_markers and len(marked) != len(turns):
            raise TemplateError("the generation markers do not mark one span per assistant turn")
        spans = []
        for number, index in enumerate(turns):
            start = self.render(messages[:index], add_generation_prompt=True, tools=tools)[0]
            if self.has_markers:
                begin = self._marked_begin(text, messages[:index], start, *marked[number], tools)
                end = marked[number][1]
            else:
                end = self._unprompted(messages[:index + 1], text, tools)
                if end is None or not end.startswith(start):
                    # rewritten once later turns follow (Qwen3's think blocks are dropped)
                    spans.append(None)
                    continue
                begin, end = len(start), len(end)
            spans.append((begin, self._turn_end(text, begin, end)))
        if spans and spans[-1] is None:  # the last turn too: nothing rendered as at inference
            raise TemplateError(f"rendering the conversation up to assistant turn {turns[spans.index(None)]} is not "
                                "a prefix of the whole rendering")
        return text, spans

    def _marked_begin(self, text, history, start, begin, end, tools=None):
        """Where a marked answer begins: the end of its generation prompt `start` where only
        whitespace lies between them, or where the marked text begins with the prompt's tail (an
        empty think block the generation prompt writes, and the markers too: TRL's Qwen3.5 training
        template), after the prompt's first characters (its assistant header, which the model is
        given, not asked to write)."""
        if not text.startswith(start):
            return begin
        if begin >= len(start):
            return len(start) if not text[len(start):begin].strip() else begin
        before = self._unprompted(history, text, tools)
        if before is None or begin <= len(before) or not text[len(before):begin].strip() or end <= len(start):
            raise TemplateError(f"the generation markers of assistant turn {len(history)} start inside its "
                                "generation prompt")
        return len(start)

    def _unprompted(self, messages, text, tools=None) -> str | None:
        """The rendering of `messages` without a generation prompt, without the end-of-text token it
        may end in, if it begins `text`, else None. Phi-3.5's template closes every unprompted
        rendering with that token, where a longer conversation goes on; where it ends a turn
        (LLaVA-NeXT's `</s>`), `_turn_end` takes it back in."""
        rendering = self.render(messages, tools=tools)[0]
        eos = self.tokenizer.eos_token
        if eos:
            rendering = rendering.removesuffix(eos)
        return rendering if text.startswith(rendering) else None

    def _turn_end(self, text, start, end):
        """The span's end without trailing whitespace, extended over an end-of-turn token right
        after it."""
        while end > start and text[end - 1].isspace():
            end -= 1
        after = end
        while after < len(text) and text[after].isspace():
            after += 1
        stop = next((s for s in self.stop_strings if text.startswith(s, after)), None)
        if stop and not any(text[start:end].endswith(s) for s in self.stop_strings):
            end = after + len(stop)
        return end

    def __call__(self, messages, images, videos=(), tools=None, audios=()):
        text, spans = self.answer_spans(messages, tools)
        _check_reasoning_kept(messages, text, spans)
        kwargs = {}
        bos = self.tokenizer.bos_token
        # as apply_chat_template does: the template wrote it
        if bos is not None and text.startswith(bos):
            kwargs["add_special_tokens"] = False
        plain = self.tokenizer(text, return_offsets_mapping=True, **kwargs)
        if images and self.normalization["pixel_values"] is not None:
            kwargs["images_kwargs"] = dict(UINT8_PIXELS)
        if videos:  # the frames we sampled, with what the processor reads the sampling rate from
            uint8 = UINT8_PIXELS if self.normalization["pixel_values_videos"] is not None else {}
            kwargs |= dict(videos=[video.frames for video in videos], videos_kwargs=dict(
                do_sample_frames=False, video_metadata=[video.metadata for video in videos], **uint8))
        if audios:
            kwargs |= dict(audio=list(audios), audio_kwargs=audio_kwargs(self.processor, audios))
        encoded = self.processor(text=text, images=[images] if images else None, **kwargs)
        for pixels, normalization in self.normalization.items():
            if normalization is not None and pixels in encoded:
                encoded[NORMALIZED_BY[pixels]] = normalization
        input_ids = torch.as_tensor(encoded["input_ids"][0])
        aligned = _aligned_positions(plain["input_ids"], input_ids.tolist())
        target = torch.zeros(len(input_ids), dtype=torch.bool)
        for start, end in filter(None, self._without_empty_think(messages, text, spans)):
            inside = [i for i, (a, b) in enumerate(plain["offset_mapping"]) if a < end and b > start and b > a]
            if not inside or plain["offset_mapping"][inside[0]][0] < start:
                raise UnalignedAnswer("the generation prompt does not end on a token boundary")
            positions = [aligned.get(i) for i in inside]
            if None in positions or positions[-1] - positions[0] != len(positions) - 1:
                raise UnalignedAnswer("the answer tokens are not in the processor's ids as the text tokenised alone")
            target[positions] = True
        media_ids = torch.tensor([i for i in (self.image_token_id, self.video_token_id, self.audio_token_id)
                                  if i is not None])
        return encoded, target & ~torch.isin(input_ids, media_ids)


    def _without_empty_think(self, messages, text: str, spans: list) -> list:
        """The answer spans, each of a turn without reasoning starting after the empty think block the
        template wrote there (`empty_think` context)."""
        if self.empty_think != "context" or not self.empty_think_block:
            return spans
        turns = [message for message in messages if message["role"] == "assistant"]
        kept = []
        for message, span in zip(turns, spans):
            if span and not (message.get("reasoning_content") or "").strip() and text.startswith(
                    self.empty_think_block, span[0]):
                span = (span[0] + len(self.empty_think_block), span[1])
            kept.append(span)
        return kept


def feature_mask(inputs: dict):
    """Which feature frames are each clip's (`FEATURE_MASKS`: the processor's name for it), or None."""
    return next((inputs[name] for name in FEATURE_MASKS if name in inputs), None)


def check_audio_features(processor):
    """Refuse a processor whose features do not hold a clip whole: a `PROBE_AUDIO_SECONDS` clip must give a feature
    mask that covers its every hop (else the extractor truncates: the end of every long clip would be lost without a
    word), and a 1 s clip beside it one that starts with the clip (else the features are padded on the left, where
    the model reads its sound)."""
    extractor = processor.feature_extractor
    samples = PROBE_AUDIO_SECONDS * extractor.sampling_rate
    noise = numpy.random.default_rng(0).uniform(-0.5, 0.5, samples).astype(numpy.float32)
    clips = [noise, noise[:extractor.sampling_rate]]
    made = processor(text=processor.audio_token * 2, audio=clips, audio_kwargs=audio_kwargs(processor, clips),
                     return_tensors="pt")
    if WINDOWS in made:  # whole windows (`WindowedAudio`): it pads clips and refuses a truncation
        return
    mask = feature_mask(made)
    if mask is None:
        raise ValueError(f"{type(processor).__name__} gives none of {FEATURE_MASKS}: which feature frames are a "
                         "clip's cannot be checked, so its audio is not trained here")
    frames = mask.sum(-1).tolist()
    if frames[0] < samples / extractor.hop_length - 2:
        kept = frames[0] * extractor.hop_length / extractor.sampling_rate
        raise ValueError(f"{type(extractor).__name__} keeps {kept:.1f} s of a {PROBE_AUDIO_SECONDS} s clip: it "
                         "truncates (its settings force truncation or a max_length), and every longer clip would "
                         "train without its end. Give the processor a feature extractor that takes truncation=False")
    if not all(mask[clip, :count].all() for clip, count in enumerate(frames)):
        raise ValueError(f"{type(extractor).__name__} pads its features on the left (padding_side='left', perhaps the "
                         "tokenizer's): the model reads a clip from the first frame; set "
                         "processor.feature_extractor.padding_side = 'right'")


def _check_reasoning_kept(messages, text: str, spans: list):
    """Raise `ReasoningDropped` where a target turn's `reasoning_content` is not in its target: a
    template that renders none, or one that drops an earlier turn's reasoning while training that
    turn (a context turn may lose it: the model sees it so at inference)."""
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    reasonings = [(messages[index].get("reasoning_content") or "").strip() for index in turns]
    for index, span, reasoning in zip(turns, spans, reasonings):
        if not reasoning or span is None or reasoning in text[span[0]:span[1]]:
            continue
        if not any(reasoning and reasoning in text for reasoning in reasonings):
            raise ReasoningDropped("the chat template does not render reasoning_content (the row's reasoning would "
                                   "be lost): give a template that writes it, or drop the field to train the answers")
        raise EarlierReasoningDropped(
            f"the chat template drops the reasoning of assistant turn {index} once later turns follow, where that "
            "turn is a target: trained, the model would learn to answer it without thinking. Give "
            '{"preserve_thinking": true} in --chat_template_kwargs where the template reads it, or a template that '
            "keeps every turn's reasoning (TRL's *_training.jinja) with --chat_template_path")


def _aligned_positions(plain: list[int], processed: list[int]) -> dict[int, int]:
    """Position in `processed` of each token of `plain` that an equal stretch of both aligns (the
    processor's image expansion only adds tokens around and in place of the placeholders).

    The common head and tail are aligned as they are (linear: a text-only row is all head); what
    lies between, where the images were expanded, by a sequence diff, whose cost grows with the
    square of its length on repetitive text. A middle over `MAX_DIFF_CELLS` (long text between two
    images) is aligned by a walk instead: each token of `plain` to the next equal token of
    `processed`, the tokens skipped being the expansion's."""
    head, tail, shorter = 0, 0, min(len(plain), len(processed))
    while head < shorter and plain[head] == processed[head]:
        head += 1
    while tail < shorter - head and plain[-1 - tail] == processed[-1 - tail]:
        tail += 1
    positions = {i: i for i in range(head)} | {len(plain) - 1 - i: len(processed) - 1 - i for i in range(tail)}
    middle = plain[head:len(plain) - tail], processed[head:len(processed) - tail]
    if len(middle[0]) * len(middle[1]) <= MAX_DIFF_CELLS:
        matcher = difflib.SequenceMatcher(None, *middle, autojunk=False)
        return positions | {head + a + k: head + b + k for a, b, size in matcher.get_matching_blocks()
                            for k in range(size)}
    at = 0
    for index, token in enumerate(middle[0]):
        try:
            at = middle[1].index(token, at)
        except ValueError:  # not in what is left: this token stays unaligned
            continue
        positions[head + index] = head + at
        at += 1
    return positions


def count_target_tokens(labels: torch.Tensor) -> int:
    """Target tokens of a batch after the shift (what the token losses sum over)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
