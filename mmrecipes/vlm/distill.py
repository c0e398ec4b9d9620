"""Distillation's teacher: a frozen image-text-to-text model, sharded like the student (`reference.frozen_reference`),
whose last hidden states the student's divergence reads through the teacher's own output layer, slice by slice
(`models.generalized_jsd_sum`), so neither model's logits of a whole batch exist.

Logit distillation compares the two next-token distributions entry by entry: the teacher must share the student's
vocabulary (the same tokens at the same ids, the same output size) and its chat template must write a conversation
as the same text tokens (`mismatch`, before the first step). Where its processor writes images otherwise (another
image token count, other pixels: `reads_own_rows`), the teacher reads rows of its own, its prompt as its processor
writes it followed by the student row's text after the prompt, and its states are aligned with the student's on
that text (every target is in it).

The rows (`DistillPreprocessor`, `DistillCollator`): a prompt in any layout GRPO reads, with the dataset's answer (a
chat row's last answer, a prompt row's `solution`) as the off-policy target; a step trains on the student's own
samples of the prompts instead with probability --lmbda (`on_policy`, the same draw on every rank).
"""

import random
from dataclasses import dataclass

import torch
from PIL import Image

from ..distributed import batches_in_step, sum_over_ranks
from ..images import to_device
from ..skips import Skip
from .chat_data import encode_row, generation_prompts, has_video, media_folder, prompt_row, row_images
from .collate import ChatCollator
from .evaluation import evaluate_generation
from .families import dummy_image_inputs, placeholder_token_ids
from .labels import UnalignedAnswer
from .loading import load_pretrained, stop_token_ids
from .losses import IGNORE_INDEX
from .models import VLMForTraining
from .outputs import GeneralizedJSD, Hidden, OutputLayer
from .prompts import PromptPreprocessor, prompt_chat
from .reference import frozen_reference, parameter_values_held

PROBE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
HELLO = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]


def _probe(processor) -> dict:
    """The probe conversation with a red square through `processor`'s own chat template."""
    text = processor.apply_chat_template(PROBE, tokenize=False)
    return processor(text=text, images=[Image.new("RGB", (32, 32), (200, 30, 30))], return_tensors="pt")


def mismatch(student, student_processor, teacher, teacher_processor) -> str | None:
    """Why the teacher cannot give the student its next-token distributions entry by entry, or None: another output
    size or vocabulary, or a chat template writing a conversation as other text tokens (image tokens left out: those
    may differ, `reads_own_rows`)."""
    sizes = [model.get_output_embeddings().weight.shape[0] for model in (student, teacher)]
    if sizes[0] != sizes[1]:
        return f"the student's output layer has {sizes[0]} entries, the teacher's {sizes[1]}"
    vocabularies = [processor.tokenizer.get_vocab() for processor in (student_processor, teacher_processor)]
    if vocabularies[0] != vocabularies[1]:
        differing = sorted(token for token in vocabularies[0].keys() ^ vocabularies[1].keys())[:3] or sorted(
            token for token in vocabularies[0] if vocabularies[0][token] != vocabularies[1][token])[:3]
        return f"their tokenizers differ ({len(vocabularies[0])} and {len(vocabularies[1])} tokens; e.g. {differing})"
    try:
        ids = [_probe(processor)["input_ids"][0].tolist() for processor in (student_processor, teacher_processor)]
    except (ValueError, KeyError, TypeError) as error:
        return f"the teacher's processor cannot read a conversation with an image ({error})"
    placeholders = [set(placeholder_token_ids(model, processor)) for model, processor in ((student, student_processor),
                                                                                          (teacher, teacher_processor))]
    texts = [[token for token in tokens if token not in images] for tokens, images in zip(ids, placeholders)]
    if texts[0] != texts[1]:
        return (f"their chat templates write the same conversation as other text tokens ({len(texts[0])} and "
                f"{len(texts[1])} besides the image tokens), so the targets cannot be aligned")
    return None


def reads_own_rows(student_processor, teacher_processor) -> bool:
    """Whether the teacher reads rows of its own (`Teacher.hidden`): its processor is configured otherwise than the
    student's (its image or video processor, or how it writes image tokens), so an image could reach it as other
    pixels or other image tokens than its own processor makes. Decided from the configurations, never from a probe
    image: two processors that agree at one size may differ at the data's (a student with a lower max_pixels)."""
    return _configuration(student_processor) != _configuration(teacher_processor)


def _configuration(processor) -> dict:
    """What a processor does to a conversation's images, as saved (its chat template is `mismatch`'s to compare)."""
    return {key: value for key, value in processor.to_dict().items() if key != "chat_template"}


class Teacher:
    """The frozen teacher (`load` before `Accelerator()`, `prepare` after the student's `prepare`): its hidden states
    at the student's positions (`hidden`, no graph), its output layer (`head_logits`, the divergence's second head),
    its held-out accuracy (`generated_accuracy`). `own_processor`: what renders its own prompts, None where it reads
    the student's rows."""

    def __init__(self, model: VLMForTraining, processor, own_rows: bool, stops, placeholders, dummy_inputs):
        self.model, self.processor, self.stops, self.placeholders = model, processor, stops, placeholders
        self.own_processor = processor if own_rows else None
        self.collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_inputs)

    @classmethod
    def load(cls, path: str, student, student_processor, attn_implementation: str = "sdpa",
             seq_kd: bool = False) -> "Teacher":
        """`path`'s model and processor, checked against the student's (`mismatch`); build it before `Accelerator()`
        (under ZeRO-3 a model built afterwards is partitioned and re-initialised)."""
        model, processor = load_pretrained(path, "--teacher_model_name_or_path")
        model.set_attn_implementation(attn_implementation)
        if why := mismatch(student, student_processor, model, processor):
            raise ValueError(f"--teacher_model_name_or_path {path}: {why}. Logit distillation needs a teacher of the "
                             "student's vocabulary and chat template (its family, another size)")
        own_rows = reads_own_rows(student_processor, processor)
        if own_rows and seq_kd:
            raise ValueError(f"--seq_kd with --teacher_model_name_or_path {path}: its processor writes images "
                             "otherwise than the student's, so its samples would follow other prompts; use --seq_kd "
                             "false (the dataset's answers off-policy)")
        return cls(VLMForTraining(model).requires_grad_(False).eval(), processor, own_rows,
                   stop_token_ids(model, processor), placeholder_token_ids(model, processor),
                   dummy_image_inputs(model, processor))

    def prepare(self, accelerator):
        """Kept as the engine keeps the student: sharded by FSDP2, partitioned by ZeRO-3, whole under DDP."""
        self.model = frozen_reference(accelerator, self.model)

    @torch.no_grad()
    def hidden(self, inputs: dict, prompts=None) -> torch.Tensor:
        """Its last hidden states at the positions of the student's batch `inputs`: of the same rows, or (reading its
        own) of each of `prompts`' own prompt (`DistillCollator`: the batch's, in row order) followed by the student
        row's text after its prompt, shifted to the student's positions (the prompts' positions hold no target)."""
        if self.own_processor is None:
            return self.model(inputs, Hidden())
        rows, shifts, device = [], [], inputs["input_ids"].device
        for ids, mask, labels, prompt in zip(inputs["input_ids"], inputs["attention_mask"], inputs["labels"], prompts):
            own, start, kept = prompt["teacher"], len(prompt["input_ids"]), mask.bool()
            rows.append({"input_ids": torch.cat([own["input_ids"], ids[kept][start:].cpu()]),
                         "labels": torch.cat([torch.full_like(own["input_ids"], IGNORE_INDEX),
                                              labels[kept][start:].cpu()]),
                         "media_inputs": own["media_inputs"]})
            shifts.append(len(own["input_ids"]) - start)
        hidden = self.model(to_device(self.collator(rows), device), Hidden())
        shift = torch.tensor(shifts, device=device)[:, None]
        positions = (torch.arange(inputs["input_ids"].shape[1], device=device) + shift).clamp(0, hidden.shape[1] - 1)
        return hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A slice of the teacher's hidden states through its output layer: one call of its prepared module, so the
        engine gathers the layer as in any forward."""
        return self.model({}, OutputLayer(hidden))

    def generated_accuracy(self, data_args, rows: int, ranks) -> dict:
        """Its held-out generated accuracy (`evaluation.evaluate_generation`) on this rank's share of `rows` held-out
        questions (`ranks`: `distributed.Ranks`), as its own processor writes them; teacher_* names; it stays in eval
        mode."""
        prompts = generation_prompts(data_args, self.processor, rows=rows, ranks=ranks)
        filler = self.collator([prompt_row(self.processor, HELLO, [])])
        scores = evaluate_generation(self.model, prompts, filler, self.collator, self.processor.tokenizer,
                                     self.stops, ranks.device, self.placeholders)
        self.model.eval()
        return {f"teacher_{name}": value for name, value in scores.items()}

    def describe(self) -> str:
        held, total = parameter_values_held(self.model)
        family = type(getattr(self.model, "module", self.model).model).__name__  # inside ZeRO-3's engine, FSDP2's
        rows = (", reading rows of its own (its processor writes images otherwise), aligned on the text after each "
                "prompt") if self.own_processor else ""
        return f"teacher: {family} holding {held:,} of its {total:,} parameter values on this rank, frozen{rows}"


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

    OUTPUTS = ("input_ids", "labels", "media_inputs", "prompt_length", "teacher_prompt")

    def __init__(self, args, labeller, max_length: int, teacher_processor=None):
        super().__init__(args, labeller, max_length)
        self.teacher_processor = teacher_processor  # `Teacher.own_processor`: its prompt as it writes it

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
            teacher = self.teacher_processor and prompt_row(self.teacher_processor, messages, images)
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
    """A micro-batch of `DistillPreprocessor` rows: {answers: the rows through `chat_collator` (an off-policy
    micro-batch, and what evaluation and a rank with nothing left forward), prompts: each row's prompt (what a sample
    continues, `sampling.Sampler`), num_samples, data_counts}."""

    def __init__(self, chat_collator):
        self.chat_collator = chat_collator

    def __call__(self, rows):
        answers = self.chat_collator(rows)
        prompts = [{"input_ids": torch.as_tensor(row["input_ids"])[:row["prompt_length"]],
                    "media_inputs": row["media_inputs"], "teacher": row["teacher_prompt"]} for row in rows]
        return {"answers": answers, "prompts": prompts, "num_samples": answers["num_samples"],
                "data_counts": answers["data_counts"]}


@torch.no_grad()
def evaluate_divergence(model, teacher: Teacher, eval_loader, filler_batch, device, *, beta: float,
                        temperature: float) -> dict:
    """The held-out divergence: the token mean of the generalised JSD to the teacher on the held-out answers, over
    every rank's share (`DistillCollator` batches), each rank forwarding as often as every other (`batches_in_step`;
    `filler_batch`: one a rank with nothing left forwards and discards)."""
    model.eval()
    totals = torch.zeros(2, device=device)  # the divergence summed over target tokens, the tokens
    for batch, real in batches_in_step(eval_loader, filler_batch, device):
        inputs = to_device(batch["answers"], device)
        inputs["teacher_hidden"] = teacher.hidden(inputs, batch["prompts"])
        value = model(inputs, GeneralizedJSD(teacher.head_logits, beta=beta, temperature=temperature))
        if real:
            tokens = float(batch["answers"]["target_tokens"])
            totals += torch.stack([value.float(), torch.tensor(tokens, device=device)])
    model.train()
    divergence, tokens = sum_over_ranks(totals).tolist()
    return {"divergence": divergence / tokens, "eval_tokens": int(tokens)} if tokens else {}
