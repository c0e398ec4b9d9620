"""The checks a recipe runs on its chat template before the first step, and the lines they log:
`check_template` (a 2-turn probe labelled by `labels.AnswerLabeller`: its targets must be exactly the
answers, each with its end-of-turn token; the log line says how they were found, what the template
writes before an answer, and shows a row labelled with and without reasoning) and
`check_generation_prompt` (samples start after the template's generation prompt).
"""

import copy

import torch
from PIL import Image

from .chat_data import labelling_skip
from .labels import QUESTION, REFUSED, AnswerLabeller, EarlierReasoningDropped, TemplateError


def check_template(labeller: AnswerLabeller, source: str, max_length: int | None = None) -> str:
    """Label a 2-turn probe conversation with an image (a real one, through the processor; its first
    turn alone where the template refuses two, as LLaVA's plain does) before the first step: raise
    unless the targets are exactly its answers, each from the end of the generation prompt to its
    end-of-turn token (markers that start inside the generation prompt, not after its header, are
    refused; a turn the template rewrites later is context, and the log line says so), unless a
    template that trains every turn keeps each turn's reasoning, and (given
    `max_length`, --max_length) unless a one-line question and a one-word answer without an image
    fit in it. A text the template writes after the generation prompt before every answer (Qwen3's
    empty think block) is a target, as the model must write it; the log line names it and the rule
    found."""
    found, answers, context = _probe_targets(labeller, source)
    texts = [_without_stop(text, labeller.stop_strings) for text in found]
    # What the template writes after its generation prompt and before every answer (Qwen3's empty think block)
    leads = {text.removesuffix(answer) for text, answer in zip(texts, answers) if text.endswith(answer)}
    if len(texts) != len(answers) or len(leads) != 1 or not all(map(str.endswith, texts, answers)):
        raise _unusable(source, f"the targets found by {labeller.rule} are {found!r}, not the answers {answers!r}")
    _check_reasoning_turns(labeller, source)
    if max_length is not None:
        _check_room(labeller, max_length)
    return (f"{_template_of(labeller, source)}: assistant turns found by {labeller.rule}; it "
            f"{_ends(labeller, found)}{_writes(leads.pop(), context)}{_think_policy(labeller)}"
            + "".join(f"\n  {line}" for line in labelled_examples(labeller)))


def labelled_examples(labeller: AnswerLabeller) -> list[str]:
    """A one-line question and its answer labelled as a training row is, its targets between [[ and ]]
    (newlines as \\n), without reasoning and with it: what the model learns from each kind of row, or
    why such a row is skipped (a template that renders no `reasoning_content`, a no-think mode)."""
    rows = {"without reasoning": SHORTEST, "with reasoning": REASONED}
    lines = []
    for kind, messages in rows.items():
        try:
            encoded, target = labeller(messages, [])
        except TemplateError as error:  # as a training row of this kind is
            lines.append(f"example {kind}: skipped, counted as {labelling_skip(error).reason} ({error})")
            continue
        ids = torch.as_tensor(encoded["input_ids"][0])
        cuts = sorted({0, len(ids), *(edge for run in _runs(target) for edge in (run.start, run.stop))})
        parts = [labeller.tokenizer.decode(ids[start:stop]) for start, stop in zip(cuts, cuts[1:])]
        marked = "".join(f"[[{part}]]" if target[start] else part for start, part in zip(cuts, parts))
        lines.append(f"example {kind}: " + marked.replace("\n", "\\n"))
    return lines


def _template_of(labeller: AnswerLabeller, source: str) -> str:
    """How a template line names the template: its source, and what its renderings get."""
    return f"chat template of {source}" + (f", {labeller.kwargs_line}" if labeller.kwargs_line else "")


# a one-line question and a one-word answer: what must fit in --max_length, and the log's examples
SHORTEST = [QUESTION, {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
REASONED = [QUESTION, SHORTEST[1] | {"reasoning_content": "The shape is red."}]
PROBE_ANSWERS = ["red", "two"]
PROBE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": PROBE_ANSWERS[0]}]},
         {"role": "user", "content": [{"type": "text", "text": "How many are there?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": PROBE_ANSWERS[1]}]}]


def _probe_targets(labeller: AnswerLabeller, source: str) -> tuple[list[str], list[str], list[str]]:
    """(the target texts the labeller finds in the probe, the answers that should be targets, those
    the template makes context): the 2-turn probe, or its first turn where the template refuses two."""
    probe, answers = copy.deepcopy(PROBE), PROBE_ANSWERS
    images = [Image.new("RGB", (64, 64), (220, 40, 40))]
    if labeller.image_token_id is None:  # a model that only hears: its template may refuse images
        probe[0]["content"], images = probe[0]["content"][1:], []
    try:
        try:
            encoded, target = labeller(probe, images)
        except TemplateError as error:
            if not str(error).startswith(REFUSED):
                raise
            # a one-turn template (LLaVA's plain): its one answer
            probe, answers = probe[:2], answers[:1]
            encoded, target = labeller(probe, images)
    except TemplateError as error:
        raise _unusable(source, str(error)) from None
    spans = labeller.answer_spans(probe)[1]
    context = [answer for answer, span in zip(answers, spans) if span is None]
    answers = [answer for answer, span in zip(answers, spans) if span is not None]
    ids = torch.as_tensor(encoded["input_ids"][0])
    return [labeller.tokenizer.decode(ids[run]).strip() for run in _runs(target)], answers, context


def _check_reasoning_turns(labeller: AnswerLabeller, source: str):
    """Raise where the template trains every turn but drops an earlier turn's reasoning: a row with
    reasoning on two turns would teach the first answer without its reasoning (other problems of
    such a row are the rows' to count)."""
    try:
        labeller([*REASONED, PROBE[2], {**PROBE[3], "reasoning_content": "There are two."}], [])
    except EarlierReasoningDropped as error:
        raise TemplateError(f"The chat template of {source} cannot train multi-turn reasoning: {error}") from None
    except TemplateError:
        pass


def _unusable(source: str, problem: str) -> TemplateError:
    return TemplateError(
        f"The chat template of {source} cannot be used for training: {problem}. Give a chat template whose "
        "assistant turns are wrapped in {% generation %} ... {% endgeneration %}, or whose generation prompt "
        "is its assistant header, with --chat_template_path (TRL ships such patches of common templates: "
        "trl/chat_templates/*_training.jinja).")


def _check_room(labeller: AnswerLabeller, max_length: int):
    """Raise unless a one-line question and a one-word answer fit in `max_length` tokens."""
    overhead = len(labeller(SHORTEST, [])[0]["input_ids"][0])
    if overhead > max_length:
        raise ValueError(f"--max_length {max_length} is below what the chat template needs for a one-line "
                         f"question and a one-word answer ({overhead} tokens): every row would be skipped as "
                         "too_long. Raise it.")


def _ends(labeller: AnswerLabeller, found: list[str]) -> str:
    """How the template ends an answer, for the log line."""
    stops = sorted({stop for text in found for stop in labeller.stop_strings if text.endswith(stop)})
    if len(stops) == 1 and all(text.endswith(stops[0]) for text in found):
        return f"ends each answer with {stops[0]}, a target"
    return "ends answers with no end-of-turn token: a fine-tuned model will not learn to stop"


def _writes(lead: str, context: list[str]) -> str:
    """What the template writes before each answer, and which answers it makes context, for the log line."""
    writes = f"; it writes {lead!r} before each answer, a target (the model learns to write it)" if lead else ""
    if context:
        writes += ("; it rewrites an answer once later turns follow (Qwen3 drops its think block), so only the "
                   "last answer of a conversation is a target, as the model sees it at inference, the earlier ones "
                   "context (to train every turn, give a template with {% generation %} markers, such as TRL's "
                   "*_training.jinja, with --chat_template_path)")
    return writes


def _think_policy(labeller: AnswerLabeller) -> str:
    """What becomes of the empty think block before an answer without reasoning, for the log line."""
    if not labeller.empty_think_block:
        return ""
    if labeller.empty_think == "target":
        return "; its empty think block before an answer without reasoning is a target (--empty_think_block target)"
    return (f"; before an answer without reasoning it writes {labeller.empty_think_block!r}, an empty think block: "
            "context, not a target (--empty_think_block context keeps a thinking model thinking; target trains "
            "it to close the block at once)")


def check_generation_prompt(labeller: AnswerLabeller, source: str) -> str:
    """Raise unless the chat template writes a generation prompt (its `add_generation_prompt`
    branch: the assistant header a sample starts after); the log line that names it. Without one,
    GRPO's and distillation's samples would follow the user's turn directly, a place the model never
    answers from."""
    header = labeller.generation_prompt()
    if not header.strip():
        raise TemplateError(
            f"The chat template of {source} writes no generation prompt (add_generation_prompt adds "
            f"{header!r} after the user's turn), so samples would start with no assistant header. Give a template "
            "with an add_generation_prompt branch (the model's own has one) with --chat_template_path")
    return f"{_template_of(labeller, source)}: samples start after its generation prompt {header!r}"


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
