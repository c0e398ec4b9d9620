"""Distillation's teacher: a frozen image-text-to-text model, sharded like the student (`reference.frozen_reference`),
whose last hidden states the student's divergence reads through the teacher's own output layer, slice by slice
(`models.generalized_jsd_sum`), so neither model's logits of a whole batch exist.

Logit distillation compares the two next-token distributions entry by entry: the teacher must share the student's
vocabulary (the same tokens at the same ids, the same output size) and read the student's rows as the same tokens
(its processor writing the same image tokens). Both are checked before the first step (`mismatch`).

The rows (`DistillPreprocessor`, `DistillCollator`): a prompt in any layout GRPO reads, with the dataset's answer (a
chat row's last answer, a prompt row's `solution`) as the off-policy target; a step trains on the student's own
samples of the prompts instead with probability --lmbda (`on_policy`, the same draw on every rank).
"""

import random
from dataclasses import dataclass

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from ..distributed import batches_in_step, sum_over_ranks
from ..images import to_device
from ..skips import Skip
from .chat_data import encode_row, has_video, media_folder, prompt_row, row_images
from .labels import UnalignedAnswer
from .losses import IGNORE_INDEX
from .models import VLMForTraining, generalized_jsd_sum, hidden_states
from .prompts import PromptPreprocessor, prompt_chat
from .reference import frozen_reference, parameter_values_held

PROBE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]


def mismatch(student, student_processor, teacher, teacher_processor) -> str | None:
    """Why the teacher cannot give the student its next-token distributions entry by entry, or None."""
    sizes = [model.get_output_embeddings().weight.shape[0] for model in (student, teacher)]
    if sizes[0] != sizes[1]:
        return f"the student's output layer has {sizes[0]} entries, the teacher's {sizes[1]}"
    vocabularies = [processor.tokenizer.get_vocab() for processor in (student_processor, teacher_processor)]
    if vocabularies[0] != vocabularies[1]:
        differing = sorted(token for token in vocabularies[0].keys() ^ vocabularies[1].keys())[:3] or sorted(
            token for token in vocabularies[0] if vocabularies[0][token] != vocabularies[1][token])[:3]
        return f"their tokenizers differ ({len(vocabularies[0])} and {len(vocabularies[1])} tokens; e.g. {differing})"
    text = student_processor.apply_chat_template(PROBE, tokenize=False)
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    try:
        outputs = [processor(text=text, images=[image], return_tensors="pt") for processor in (student_processor,
                                                                                              teacher_processor)]
    except (ValueError, KeyError, TypeError) as error:
        return f"the teacher's processor cannot read the student's conversation with an image ({error})"
    ids = [output["input_ids"][0] for output in outputs]
    if list(ids[0]) != list(ids[1]):
        return (f"their processors write the same conversation with an image as other tokens ({len(ids[0])} and "
                f"{len(ids[1])}: another image token count); aligning the two on the text tokens is not supported")
    # the teacher reads the student's rows: its image processor must give the same pixels
    differing = sorted(name for name in outputs[0].keys() | outputs[1].keys() if name not in outputs[0]
                       or name not in outputs[1] or not torch.equal(outputs[0][name], outputs[1][name]))
    if differing:
        return f"their processors give the same image other inputs ({', '.join(differing)})"
    return None


class Teacher:
    """The frozen teacher (`load` before `Accelerator()`, `prepare` after the student's `prepare`): its hidden states
    of a batch (`hidden`, no graph) and its output layer (`head_logits`, the divergence's second head)."""

    def __init__(self, model: VLMForTraining, processor):
        self.model, self.processor = model, processor

    @classmethod
    def load(cls, path: str, student, student_processor, attn_implementation: str = "sdpa") -> "Teacher":
        """`path`'s model and processor, checked against the student's (`mismatch`); build it before `Accelerator()`
        (under ZeRO-3 a model built afterwards is partitioned and re-initialised)."""
        model = AutoModelForImageTextToText.from_pretrained(path)
        processor = AutoProcessor.from_pretrained(path)
        model.set_attn_implementation(attn_implementation)
        if why := mismatch(student, student_processor, model, processor):
            raise ValueError(f"--teacher_model_name_or_path {path}: {why}. Logit distillation needs a teacher of the "
                             "student's vocabulary and processor (its family, another size)")
        return cls(VLMForTraining(model).requires_grad_(False).eval(), processor)

    def prepare(self, accelerator):
        """Kept as the engine keeps the student: sharded by FSDP2, partitioned by ZeRO-3, whole under DDP."""
        self.model = frozen_reference(accelerator, self.model)

    @torch.no_grad()
    def hidden(self, inputs: dict) -> torch.Tensor:
        return hidden_states(self.model, inputs)

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A slice of the teacher's hidden states through its output layer: one call of its prepared module, so the
        engine gathers the layer as in any forward."""
        return self.model({"hidden": hidden}, "head_logits")

    def scores(self, evaluation, *args) -> dict:
        """The student's `evaluation` (`evaluation.evaluate_generation`, say) of the teacher, its metrics named
        teacher_*; the teacher is left in eval mode."""
        scores = evaluation(self.model, *args)
        self.model.eval()
        return {f"teacher_{name}": value for name, value in scores.items()}

    def describe(self) -> str:
        held, total = parameter_values_held(self.model)
        family = type(getattr(self.model, "module", self.model).model).__name__  # inside ZeRO-3's engine, FSDP2's
        return f"teacher: {family} holding {held:,} of its {total:,} parameter values on this rank, frozen"


def on_policy(seed: int, step: int, lmbda: float) -> bool:
    """Whether `step` trains on the student's own samples: a draw of probability `lmbda` from the run's seed and the
    step, the same on every rank (their sampling loops stay in step) and on a resume."""
    return random.Random(seed * 1_000_003 + step).random() < lmbda


@dataclass(frozen=True)
class OnePerPrompt:
    """The samplers' layout (`sampling.Sampler`, as GRPO's `GroupLayout`) for distillation: one sample of each of a
    micro-batch's `prompts`, all in one micro-batch."""

    prompts: int

    @property
    def micro_batch(self) -> int:
        return self.prompts

    def pieces(self) -> list[tuple[int, list[int]]]:
        return [(index, [0]) for index in range(self.prompts)]


class DistillPreprocessor(PromptPreprocessor):
    """Batched `datasets.map` function: rows GRPO reads in (TRL prompt rows with a `solution`, chat rows); out, the
    prompt with the dataset's answer after it, the answer's tokens the only targets (the off-policy sample), and the
    prompt's length (what the student's and the teacher's samples continue). Bad rows dropped and counted; a row whose
    template writes the prompt otherwise before an answer than with its generation prompt counts as unaligned (its
    samples and its answer would follow different prompts)."""

    OUTPUTS = ("input_ids", "labels", "media_inputs", "prompt_length")

    def example(self, row):
        try:
            messages, raw_images, _, columns = prompt_chat(row)
            if has_video(row, messages):
                raise Skip("video", "distillation samples image and text prompts")
            if columns.get("solution") is None:
                raise Skip("no_target", "a prompt row without a solution: no answer for the off-policy steps")
            self.check_text_length(messages)
            images, note = row_images(self.args, media_folder(row, self.args.image_folder), messages, raw_images)
            prompt = prompt_row(self.labeller.processor, messages, images)["input_ids"]
            answer = {"role": "assistant", "content": [{"type": "text", "text": str(columns["solution"])}]}
            input_ids, labels, media_inputs = encode_row(self.labeller, [*messages, answer], images)
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
        return (input_ids, labels, media_inputs, len(prompt)), note


class DistillCollator:
    """A micro-batch of `DistillPreprocessor` rows: {answers: the rows through `chat_collator` (an off-policy
    micro-batch, and what evaluation and a rank with nothing left forward), prompts: each row's prompt (what a sample
    continues, `sampling.Sampler`), num_samples, data_counts}."""

    def __init__(self, chat_collator):
        self.chat_collator = chat_collator

    def __call__(self, rows):
        answers = self.chat_collator(rows)
        prompts = [{"input_ids": torch.as_tensor(row["input_ids"])[:row["prompt_length"]],
                    "media_inputs": row["media_inputs"]} for row in rows]
        return {"answers": answers, "prompts": prompts, "num_samples": answers["num_samples"],
                "data_counts": answers["data_counts"]}


@torch.no_grad()
def evaluate_divergence(model, teacher: Teacher, eval_loader, filler_batch, device, *, beta: float,
                        temperature: float) -> dict:
    """The held-out divergence: the token mean of the generalised JSD to the teacher on the held-out answers, over
    every rank's share, each rank forwarding as often as every other (`batches_in_step`; `filler_batch`: a chat batch
    a rank with nothing left forwards and discards)."""
    model.eval()
    totals = torch.zeros(2, device=device)  # the divergence summed over target tokens, the tokens
    for batch, real in batches_in_step(eval_loader, filler_batch, device):
        inputs = to_device(batch, device)
        inputs["teacher_hidden"] = teacher.hidden(inputs)
        value = generalized_jsd_sum(model, inputs, teacher.head_logits, beta=beta, temperature=temperature)
        if real:
            totals += torch.stack([value.float(), torch.tensor(float(batch["target_tokens"]), device=device)])
    model.train()
    divergence, tokens = sum_over_ranks(totals).tolist()
    return {"divergence": divergence / tokens, "eval_tokens": int(tokens)} if tokens else {}
