"""Held-out questions answered by generation: each held-out conversation up to its last answer, rendered with the
generation prompt as a user's `generate` call gets it, beside the answer and its reasoning (independent of the
training labels, which `evaluation.evaluate_generation` checks by them)."""

from collections import Counter
from typing import NamedTuple

from ...benchmarks.scoring import reasoning_of, without_reasoning
from ...distributed import all_ranks_true
from ...skips import Skip
from ...sources import PROBLEM, load_stream
from ..arguments import ChatDataArgs
from .chat_data import CHAT_COLUMNS, prompt_row, row_media, to_chat
from .media import AUDIO_COLUMNS, media_folder, media_not_taken, row_audios, row_images


class HeldOut(NamedTuple):
    """A held-out question: its prompt row, the answer, and the reasoning the row gives before it ("": none)."""

    prompt: dict
    answer: str
    reasoning: str


def generation_prompts(args: ChatDataArgs, processor, *, rows: int, ranks, hears: bool = False) -> list[HeldOut]:
    """This rank's share of `rows` held-out conversations (`ranks`: `distributed.Ranks`, their
    evaluation reads), as `HeldOut`: the conversation up to its last assistant turn
    through the processor's own chat template with its generation prompt and images, and its clips where the
    model `hears` (what a user's `generate` call gets), that turn's answer and its reasoning. Independent of
    the labels, so that `evaluation.evaluate_generation` checks them. Rows that cannot be read are left out; where no
    rank has a prompt, every rank raises together, with what its share left out by reason (the
    evaluation would never run)."""
    if not rows:
        return []
    rows = ranks.share(rows)
    stream, _ = load_stream(args.eval_dataset_name, args.dataset_config_name, args.eval_split, args.eval_data_files,
                            CHAT_COLUMNS, **ranks.reads(evaluation=True))
    prompts, skipped = [], Counter()
    for row in stream:
        if len(prompts) == rows:
            break
        try:
            prompts.append(_held_out_prompt(args, processor, row, hears))
        except Skip as skip:
            skipped[skip.reason] += 1
        except Exception as error:  # a row the training data would count as bad
            skipped[f"bad_row ({type(error).__name__})"] += 1
    if all_ranks_true(not prompts, ranks.device):
        counts = ", ".join(f"{reason} {count}" for reason, count in skipped.most_common()) or "none read"
        raise RuntimeError(f"No data rank has a held-out question of {args.eval_dataset_name} to answer by "
                           f"generation, so that evaluation would never run; this rank left out: {counts}")
    return prompts


def _held_out_prompt(args: ChatDataArgs, processor, row, hears: bool):
    """(prompt row, answer) of a held-out row, or `Skip` with why it gives none."""
    if row.get(PROBLEM):
        raise Skip(row[PROBLEM])
    messages, raw_images, _ = to_chat(row)
    sees = getattr(processor, "image_token", None) is not None
    if kind := media_not_taken(row, messages, takes_video=False, takes_audio=hears, takes_images=sees):
        raise Skip(kind)  # image (and audio) questions only, for now
    answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not answers:
        raise Skip("no answer")
    last = answers[-1]
    if sum(part["type"] == "image" for message in messages[:last] for part in message["content"]) != len(raw_images):
        raise Skip("an image after the question")
    folder = media_folder(row, args.image_folder)
    images, _ = row_images(args, folder, messages, raw_images)
    audios = row_audios(args, folder, messages[:last], row_media(row, *AUDIO_COLUMNS),
                        processor.feature_extractor.sampling_rate) if hears else []
    text = " ".join(part["text"] for part in messages[last]["content"] if part["type"] == "text")
    prompt = prompt_row(processor, messages[:last], images, template_kwargs=args.chat_template_kwargs, audios=audios)
    # the answer a reasoning model gives after its reasoning (in reasoning_content, or inlined as <think>...</think>)
    return HeldOut(prompt, without_reasoning(text), messages[last].get("reasoning_content") or reasoning_of(text))
