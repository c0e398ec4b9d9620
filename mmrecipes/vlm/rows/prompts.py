"""The prompts GRPO and distillation sample: TRL's prompt rows (`prompt`, a string or a
conversation, with `images` and any other columns) or chat rows in any layout `chat_data` reads, up
to their last answer; rendered with the checkpoint's generation prompt, carrying what reward
functions get (the prompt as TRL passes it, the row's other columns; `PromptPreprocessor`); for
distillation with the dataset's answer after them (`DistillPreprocessor`); bad rows skipped and
counted as in SFT."""

import io
import json

import torch

from ...skips import Skip, data_counts
from ...sources import OTHER_COLUMNS
from .chat_data import (
    CHAT_COLUMNS,
    CHAT_COUNTED,
    BadRow,
    ChatPreprocessor,
    encode_row,
    prompt_row,
    row_media,
    string_prompt,
    to_chat,
    to_message,
)
from .collate import chat_rows
from .labels import IGNORE_INDEX, UnalignedAnswer
from .media import AUDIO_COLUMNS, media_folder, media_not_taken, row_images

PROMPT_COLUMNS = [*CHAT_COLUMNS, "prompt", "solution", OTHER_COLUMNS]


def prompt_chat(row) -> tuple[list, list, str | list, dict]:
    """(prompt messages, raw images, the prompt as reward functions get it, the columns they get as
    keywords) of a TRL prompt row or of a chat row. As TRL passes them: a string prompt as it is, a
    conversation as messages; every column but the prompt and the media (`OTHER_COLUMNS`), `id` and
    `solution` (a chat row's: its last answer, unless it has a `solution` column)."""
    columns = json.loads(row.get(OTHER_COLUMNS) or "{}")
    columns |= {name: row[name] for name in ("id", "solution") if row.get(name) is not None}
    if row.get("prompt") is not None:
        images, prompt = row_media(row, "images", "image"), row["prompt"]
        if isinstance(prompt, str):
            return [string_prompt(prompt, images)], images, prompt, columns
        if not isinstance(prompt, list) or not prompt:
            raise BadRow("prompt is neither a string nor a conversation")
        messages = [to_message(turn) for turn in prompt]
        return messages, images, messages, columns
    messages, images, _ = to_chat(row)
    answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not answers:
        raise BadRow("no prompt column and no assistant turn to take the solution from")
    solution = " ".join(part["text"] for part in messages[answers[-1]]["content"] if part["type"] == "text")
    return messages[:answers[-1]], images, messages[:answers[-1]], {"solution": solution.strip()} | columns


class PromptPreprocessor(ChatPreprocessor):
    """Batched `datasets.map` function: prompt rows in; {input_ids, media_inputs, reward_prompt,
    reward_columns (both JSON: `prompt_chat`)} out, each rendered with the generation prompt; bad
    rows dropped and counted (`ChatPreprocessor`'s counts). Its `max_length` is the prompt's: the
    recipe gives --max_length less --max_completion_length."""

    COLUMNS = PROMPT_COLUMNS
    OUTPUTS = ("input_ids", "media_inputs", "reward_prompt", "reward_columns", "images")

    def __init__(self, args, labeller, max_length: int, tools=None, keep_images: bool = False):
        super().__init__(args, labeller, max_length)
        # the JSON schemas of the tools the model may call, rendered in every prompt ({environment: schemas}: by the
        # row's `environment` column, TRL's multi-environment rows)
        self.tools = tools
        # (as PNG) where an environment's observation re-renders the prompt
        self.keep_images = keep_images

    def row_tools(self, columns: dict) -> list | None:
        """The schemas a row's prompt renders (`columns`: its other columns, `prompt_chat`'s)."""
        if not isinstance(self.tools, dict):
            return self.tools
        if columns.get("environment") not in self.tools:
            raise Skip("bad_row", f"environment {columns.get('environment')!r}: not one of --environment_factory's "
                                  f"({', '.join(map(str, self.tools))})")
        return self.tools[columns["environment"]]

    def example(self, row):
        try:
            messages, raw_images, reward_prompt, columns = prompt_chat(row)
            self.check_taken(row, messages)
            images, note = row_images(self.args, media_folder(row, self.args.image_folder), messages, raw_images)
            prompt = prompt_row(self.labeller.processor, messages, images, self.row_tools(columns),
                                self.labeller.template_kwargs, self.row_clips(row, messages))
        except Skip:
            raise
        # a template that refuses the prompt, say: counted, never a crash
        except Exception as error:
            raise Skip("bad_row", f"{type(error).__name__}: {error}") from error
        if len(prompt["input_ids"]) > self.max_length:
            raise Skip("too_long", f"{len(prompt['input_ids'])} prompt tokens, over {self.max_length}")
        kept = [png_bytes(image) for image in images] if self.keep_images else []
        return (prompt["input_ids"], prompt["media_inputs"], json.dumps(reward_prompt), json.dumps(columns),
                kept), note

    def check_taken(self, row, messages):
        """Skip a row holding what prompts are not sampled with: video, and audio where the labeller does not
        hear."""
        hears = self.labeller.audio_token_id is not None
        sees = self.labeller.image_token_id is not None
        if kind := media_not_taken(row, messages, takes_video=False, takes_audio=hears, takes_images=sees):
            raise Skip(kind, "prompts are sampled with text, images (a model that sees) and audio (one that hears)")

    def row_clips(self, row, messages) -> list:
        """The row's clips, decoded (`clips`; paths resolved as images'), where the labeller hears."""
        raw_audios = row_media(row, *AUDIO_COLUMNS) if self.labeller.audio_token_id is not None else []
        return self.clips(media_folder(row, self.args.image_folder), messages, raw_audios)

    @staticmethod
    def check_columns(name, available):
        if available is not None and not {"prompt", "messages", "conversations"} & set(available):
            raise ValueError(f"{name} has none of the columns prompt, messages or conversations (it has "
                             f"{', '.join(sorted(available))})")


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class PromptCollator:
    """A batch of prompts as they are (each is sampled on its own): {prompts, num_samples,
    data_counts, chat: the prompts through `chat_collator` (no target), what a rank with no held-out
    prompt left decodes}. `counted` False: a team member other than the first, which reads the same
    prompts, counts none of them."""

    def __init__(self, chat_collator, counted: bool = True):
        self.chat_collator, self.counted = chat_collator, counted

    def __call__(self, rows):
        prompts = [{"input_ids": torch.as_tensor(row["input_ids"]), "media_inputs": row["media_inputs"],
                    "prompt": json.loads(row["reward_prompt"]), "columns": json.loads(row["reward_columns"]),
                    "images": row.get("images") or []} for row in rows]
        return {"prompts": prompts, "num_samples": len(rows) * self.counted,
                "data_counts": data_counts(rows, CHAT_COUNTED) * self.counted,
                "chat": self.chat_collator([row for prompt in prompts for row in chat_rows(prompt, [[]], [False])])}


class DistillPreprocessor(PromptPreprocessor):
    """Batched `datasets.map` function: rows GRPO reads in (TRL prompt rows with a `solution`, chat
    rows); out, the prompt with the dataset's answer after it, the answer's tokens the only targets
    (the off-policy sample), and the prompt's length (what the student's and the teacher's samples
    continue). Bad rows dropped and counted; a row whose template writes the prompt otherwise before
    an answer than with its generation prompt counts as unaligned (its samples and its answer would
    follow different prompts)."""

    OUTPUTS = ("input_ids", "labels", "media_inputs", "prompt_length", "teacher_prompt")

    def __init__(self, args, labeller, max_length: int, teacher_processor=None):
        super().__init__(args, labeller, max_length)
        # `Teacher.own_processor`: its prompt as it writes it
        self.teacher_processor = teacher_processor

    def example(self, row):
        try:
            messages, raw_images, _, columns = prompt_chat(row)
            self.check_taken(row, messages)
            if columns.get("solution") is None:
                raise Skip("no_target", "a prompt row without a solution: no answer for the off-policy steps")
            self.check_text_length(messages)
            images, note = row_images(self.args, media_folder(row, self.args.image_folder), messages, raw_images)
            audios = self.row_clips(row, messages)
            prompt = prompt_row(self.labeller.processor, messages, images,
                                template_kwargs=self.labeller.template_kwargs, audios=audios)["input_ids"]
            answer = {"role": "assistant", "content": [{"type": "text", "text": str(columns["solution"])}]}
            input_ids, labels, media_inputs = encode_row(self.labeller, [*messages, answer], images, audios=audios)
            teacher = self.teacher_processor and prompt_row(self.teacher_processor, messages, images,
                                                            template_kwargs=self.labeller.template_kwargs,
                                                            audios=audios)
        except Skip:
            raise
        except UnalignedAnswer as error:
            raise Skip("unaligned", str(error)) from error
        except Exception as error:  # a template that refuses the row, say: counted, never a crash
            raise Skip("bad_row", f"{type(error).__name__}: {error}") from error
        if len(input_ids) > self.max_length:
            raise Skip("too_long", f"{len(input_ids)} tokens, over {self.max_length}")
        if not torch.equal(input_ids[:len(prompt)], prompt):
            raise Skip("unaligned", "the template writes the prompt otherwise before its answer")
        labels[:len(prompt)] = IGNORE_INDEX  # earlier answers are context, as in the samples
        if not (labels[1:] != IGNORE_INDEX).any():
            raise Skip("no_target", "no answer to learn")
        teacher = teacher and {"input_ids": teacher["input_ids"], "media_inputs": teacher["media_inputs"]}
        return (input_ids, labels, media_inputs, len(prompt), teacher), note


class DistillCollator:
    """A micro-batch of `DistillPreprocessor` rows: {answers: the rows through `chat_collator` (an
    off-policy micro-batch, and what evaluation and a rank with nothing left forward), prompts: each
    row's prompt (what a sample continues, `sampling.Sampler`), num_samples, data_counts}."""

    def __init__(self, chat_collator):
        self.chat_collator = chat_collator

    def __call__(self, rows):
        answers = self.chat_collator(rows)
        prompts = [{"input_ids": torch.as_tensor(row["input_ids"])[:row["prompt_length"]],
                    "media_inputs": row["media_inputs"], "teacher": row["teacher_prompt"]} for row in rows]
        return {"answers": answers, "prompts": prompts, "num_samples": answers["num_samples"],
                "data_counts": answers["data_counts"]}
