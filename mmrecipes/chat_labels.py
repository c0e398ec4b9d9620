"""Answer-token labels from a checkpoint's own chat template, whatever the template contains.

The targets of a conversation are its assistant turns, each up to and including the token that
ends the turn (the model must learn to stop), and nothing else: no prompt, no role header, never
an image token. The turns are found in the rendered text in one of two ways:

1. `{% generation %}` markers, where the template has them (what transformers'
   `return_assistant_tokens_mask=True` relies on). Most official templates have none (Qwen's,
   Gemma's, SmolVLM's): transformers then warns and returns an all-zero mask, and every row would
   be dropped as having nothing to learn.
2. Otherwise, prefixes: the conversation rendered up to assistant turn i with
   `add_generation_prompt=True` ends where the turn starts, and rendered up to and including turn
   i ends where it ends. Both must be prefixes of the whole rendering; a template that rewrites
   earlier turns or whose generation prompt is not its assistant header fails that check and is
   rejected, never labelled wrong.

Each turn's character span is trimmed of surrounding whitespace and extended over an end-of-turn
token that directly follows it (LLaVA-OneVision's markers stop just before `<|im_end|>`; without
it the model never learns to stop). The spans then map to tokens through the processor's offset
mapping, shifted past the image placeholders it expanded.
"""

import bisect
import re

import jinja2
import torch
from transformers.utils.chat_template_utils import render_jinja_template

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateError(ValueError):
    """No rule finds the assistant turns of a conversation in this chat template."""


class AnswerLabeller:
    """`labeller(messages, images)` -> (processor outputs of the conversation, target mask).

    `stop_token_ids`: the tokens that end a turn (the generation config's eos ids and the
    tokenizer's eos). A conversation whose turns no rule finds raises `TemplateError`.
    """

    def __init__(self, processor, stop_token_ids):
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.template = processor.chat_template
        if not isinstance(self.template, str):
            raise TemplateError("the processor has no chat template (or several): give one with --chat_template_path")
        self.has_markers = bool(GENERATION_MARKER.search(self.template))
        self.stop_strings = sorted({self.tokenizer.convert_ids_to_tokens(int(i)) for i in stop_token_ids}, key=len,
                                   reverse=True)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(processor.image_token)
        self.rule = "generation markers" if self.has_markers else "prefix renderings"

    def render(self, messages, add_generation_prompt=False):
        try:
            texts, indices = render_jinja_template(
                conversations=[messages], chat_template=self.template, add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=self.has_markers, **self.tokenizer.special_tokens_map)
        except jinja2.TemplateError as error:  # raise_exception(...) in the template: roles out of order, say
            raise TemplateError(f"the template refuses the conversation: {error}") from error
        return texts[0], indices[0] if indices else []

    def answer_spans(self, messages) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the character span of each assistant turn)."""
        text, spans = self.render(messages)
        if not self.has_markers:
            spans = []
            for index, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                start = self.render(messages[:index], add_generation_prompt=True)[0]
                end = self.render(messages[:index + 1])[0]
                if not (text.startswith(end) and end.startswith(start)):
                    raise TemplateError(f"rendering the conversation up to assistant turn {index} is not a prefix of "
                                        "the whole rendering")
                spans.append((len(start), len(end)))
        return text, [self._turn_span(text, start, end) for start, end in spans]

    def _turn_span(self, text, start, end):
        """The span without surrounding whitespace, plus an end-of-turn token right after it."""
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        after = end
        while after < len(text) and text[after].isspace():
            after += 1
        stop = next((s for s in self.stop_strings if text.startswith(s, after)), None)
        if stop and not any(text[start:end].endswith(s) for s in self.stop_strings):
            end = after + len(stop)
        return start, end

    def __call__(self, messages, images):
        text, spans = self.answer_spans(messages)
        kwargs = dict(return_offsets_mapping=True, return_text_replacement_offsets=True)
        bos = self.tokenizer.bos_token
        if bos is not None and text.startswith(bos):  # as apply_chat_template does: the template wrote it
            kwargs["add_special_tokens"] = False
        encoded = self.processor(text=text, images=[images] if images else None, **kwargs)
        offsets = encoded.pop("offset_mapping")[0]
        replacements = (encoded.pop("text_replacement_offsets", None) or [[]])[0]
        input_ids = torch.tensor(encoded["input_ids"][0])
        target = torch.zeros(len(input_ids), dtype=torch.bool)
        # The processor expanded each image placeholder: shift the spans by the characters gained before them.
        placeholder_ends = [r["span"][1] for r in replacements]
        gained = [0]
        for r in replacements:
            gained.append(gained[-1] + (r["new_span"][1] - r["new_span"][0]) - (r["span"][1] - r["span"][0]))
        for start, end in spans:
            start, end = (char + gained[bisect.bisect_right(placeholder_ends, char)] for char in (start, end))
            for position, (token_start, token_end) in enumerate(offsets):
                if token_start < end and token_end > start:
                    target[position] = True
        return encoded, target & (input_ids != self.image_token_id)


def check_template(labeller: AnswerLabeller, source: str) -> str:
    """Label a 2-turn probe conversation before the first step: raise unless the targets are exactly
    its two answers (with their end-of-turn tokens). Returns a log line naming the rule found."""
    answers = ["red", "two"]
    probe = [{"role": "user", "content": [{"type": "text", "text": "What colour is it?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": answers[0]}]},
             {"role": "user", "content": [{"type": "text", "text": "How many are there?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": answers[1]}]}]
    try:
        encoded, target = labeller(probe, [])
    except TemplateError as error:
        found, problem = [], str(error)
    else:
        ids = torch.tensor(encoded["input_ids"][0])
        found = [labeller.tokenizer.decode(ids[run]).strip() for run in _runs(target)]
        problem = None
        if [_without_stop(text, labeller.stop_strings) for text in found] != answers:
            problem = f"the targets found by {labeller.rule} are {found!r}, not the two answers {answers!r}"
    if problem:
        raise TemplateError(
            f"The chat template of {source} cannot be used for training: {problem}. Give a chat template whose "
            "assistant turns are wrapped in {% generation %} ... {% endgeneration %}, or whose generation prompt "
            "is its assistant header, with --chat_template_path.")
    stops = sorted({stop for text in found for stop in labeller.stop_strings if text.endswith(stop)})
    if len(stops) == 1 and all(text.endswith(stops[0]) for text in found):
        ends = f"ends each answer with {stops[0]}, a target"
    else:
        ends = "ends answers with no end-of-turn token: a fine-tuned model will not learn to stop"
    return f"chat template of {source}: assistant turns found by {labeller.rule}; it {ends}"


def _runs(mask):
    """Index ranges of the consecutive True stretches of a 1-D bool mask."""
    positions = mask.nonzero().flatten().tolist()
    runs, start = [], None
    for i, position in enumerate(positions):
        if start is None:
            start = position
        if i + 1 == len(positions) or positions[i + 1] != position + 1:
            runs.append(slice(start, position + 1))
            start = None
    return runs


def _without_stop(text, stop_strings):
    for stop in stop_strings:
        if text.endswith(stop):
            return text[:-len(stop)].strip()
    return text
