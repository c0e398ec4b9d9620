"""Distillation's teacher: a frozen image-text-to-text model, kept as the engine keeps the student
(`reference.frozen_reference`), whose last hidden states the student's divergence reads through the
teacher's own output layer, slice by slice (`outputs.GeneralizedJSD`), so neither model's logits of
a whole batch exist.

Logit distillation compares the two next-token distributions entry by entry: the teacher must share
the student's vocabulary (the same tokens at the same ids, the same output size) and its chat
template must write a conversation as the same text tokens (`mismatch`, before the first step).
Where its processor is configured otherwise (another image token count, other pixels:
`reads_own_rows`), the teacher reads rows of its own, its prompt as its processor writes it followed
by the student row's text after the prompt, and its states are aligned with the student's on that
text (every target is in it).
"""

import os

import torch
from PIL import Image

from ...images import to_device
from ...template_kwargs import check_template_kwargs
from ..model.evaluation import evaluate_generation
from ..model.families import audio_inputs, dummy_image_inputs, placeholder_token_ids
from ..model.loading import load_pretrained, set_attention, stop_token_ids
from ..model.outputs import Hidden, OutputLayer
from ..model.step import VLMForTraining
from ..rows.chat_data import prompt_row
from ..rows.collate import ChatCollator
from ..rows.held_out import generation_prompts
from ..rows.labels import IGNORE_INDEX
from .reference import frozen_reference, parameter_values_held

PROBE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
HELLO = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]


def _probe(processor, template_kwargs=None) -> dict:
    """The probe conversation with a red square through `processor`'s own chat template."""
    text = processor.apply_chat_template(PROBE, tokenize=False, **(template_kwargs or {}))
    return processor(text=text, images=[Image.new("RGB", (32, 32), (200, 30, 30))], return_tensors="pt")


def mismatch(student, student_processor, teacher, teacher_processor, template_kwargs=None) -> str | None:
    """Why the teacher cannot give the student its next-token distributions entry by entry, or None:
    another output size or vocabulary, a chat template writing a conversation as other text tokens
    (image tokens left out: those may differ, `reads_own_rows`), or ending a prompt otherwise (a
    thinking teacher of a non-thinking student), both rendered with `template_kwargs`
    (--chat_template_kwargs)."""
    sizes = [model.get_output_embeddings().weight.shape[0] for model in (student, teacher)]
    if sizes[0] != sizes[1]:
        return f"the student's output layer has {sizes[0]} entries, the teacher's {sizes[1]}"
    vocabularies = [processor.tokenizer.get_vocab() for processor in (student_processor, teacher_processor)]
    if vocabularies[0] != vocabularies[1]:
        differing = sorted(token for token in vocabularies[0].keys() ^ vocabularies[1].keys())[:3] or sorted(
            token for token in vocabularies[0] if vocabularies[0][token] != vocabularies[1][token])[:3]
        return f"their tokenizers differ ({len(vocabularies[0])} and {len(vocabularies[1])} tokens; e.g. {differing})"
    try:
        ids = [_probe(processor, template_kwargs)["input_ids"][0].tolist()
               for processor in (student_processor, teacher_processor)]
    except (ValueError, KeyError, TypeError) as error:
        return f"the teacher's processor cannot read a conversation with an image ({error})"
    placeholders = [set(placeholder_token_ids(model, processor)) for model, processor in ((student, student_processor),
                                                                                          (teacher, teacher_processor))]
    texts = [[token for token in tokens if token not in images] for tokens, images in zip(ids, placeholders)]
    if texts[0] != texts[1]:
        return (f"their chat templates write the same conversation as other text tokens ({len(texts[0])} and "
                f"{len(texts[1])} besides the image tokens), so the targets cannot be aligned")
    # What each is given to continue: a thinking template opens its block where a non-thinking one closes it empty
    # (a template that writes no generation prompt is refused by the recipe's own check, which says so)
    prompts, bare = ([processor.apply_chat_template(HELLO, add_generation_prompt=asked, tokenize=False,
                                                    **(template_kwargs or {}))
                      for processor in (student_processor, teacher_processor)] for asked in (True, False))
    if prompts[0] != prompts[1] and all(prompt != plain for prompt, plain in zip(prompts, bare)):
        common = len(os.path.commonprefix(prompts))
        return (f"their chat templates end a prompt otherwise (the student's with {prompts[0][common:]!r}, the "
                f"teacher's with {prompts[1][common:]!r}: a thinking and a non-thinking template?), so the teacher "
                "would be asked in another mode than the student answers in; give both one mode, e.g. "
                "--chat_template_kwargs '{\"enable_thinking\": false}' where both templates read it")
    return None


def reads_own_rows(student_processor, teacher_processor) -> bool:
    """Whether the teacher reads rows of its own (`Teacher.hidden`): its processor is configured
    otherwise than the student's (its image or video processor, or how it writes image tokens), so
    an image could reach it as other pixels or other image tokens than its own processor makes.
    Decided from the configurations, never from a probe image: two processors that agree at one size
    may differ at the data's (a student with a lower max_pixels)."""
    return _configuration(student_processor) != _configuration(teacher_processor)


def _configuration(processor) -> dict:
    """What a processor does to a conversation's images, as saved (its chat template is `mismatch`'s
    to compare)."""
    return {key: value for key, value in processor.to_dict().items() if key != "chat_template"}


class Teacher:
    """The frozen teacher (`load` before `Accelerator()`, `prepare` after the student's `prepare`):
    its hidden states at the student's positions (`hidden`, no graph), its output layer
    (`head_logits`, the divergence's second head), its held-out accuracy (`generated_accuracy`).
    `own_processor`: what renders its own prompts, None where it reads the student's rows."""

    def __init__(self, model: VLMForTraining, processor, own_rows: bool, stops, placeholders, dummy_inputs,
                 template_kwargs=None):
        self.model, self.processor, self.stops, self.placeholders = model, processor, stops, placeholders
        self.template_kwargs = template_kwargs
        self.own_processor = processor if own_rows else None
        self.collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_inputs)
        # it takes audio rows (`families.audio_inputs`): the student reads clips only where its teacher hears them
        self.hears = bool(audio_inputs(model.model, processor))

    @classmethod
    def load(cls, path: str, student, student_processor, attn_implementation: str = "sdpa",
             seq_kd: bool = False, template_kwargs=None) -> "Teacher":
        """`path`'s model and processor, checked against the student's (`mismatch`), its template
        rendered with `template_kwargs` as the student's (--chat_template_kwargs: refused where it
        never reads one); build it before `Accelerator()` (under ZeRO-3 a model built afterwards is
        partitioned and re-initialised)."""
        model, processor = load_pretrained(path, "--teacher_model_name_or_path")
        set_attention(model, attn_implementation, "--attn_implementation (the teacher's)")
        check_template_kwargs(template_kwargs, processor.chat_template, processor.tokenizer.special_tokens_map,
                              flag="--chat_template_kwargs (the teacher's chat template)")
        if why := mismatch(student, student_processor, model, processor, template_kwargs):
            raise ValueError(f"--teacher_model_name_or_path {path}: {why}. Logit distillation needs a teacher of the "
                             "student's vocabulary and chat template (its family, another size)")
        own_rows = reads_own_rows(student_processor, processor)
        if own_rows and seq_kd:
            raise ValueError(f"--seq_kd with --teacher_model_name_or_path {path}: its processor writes images "
                             "otherwise than the student's, so its samples would follow other prompts; use --seq_kd "
                             "false (the dataset's answers off-policy)")
        # a student that hears batches its dummy sound, which a teacher that does not hear cannot take: it reads rows
        # of its own (its prompts as the student's, written by the same processor settings)
        deaf = bool(audio_inputs(student, student_processor)) and not audio_inputs(model, processor)
        return cls(VLMForTraining(model).requires_grad_(False).eval(), processor, own_rows or deaf,
                   stop_token_ids(model, processor), placeholder_token_ids(model, processor),
                   dummy_image_inputs(model, processor), template_kwargs)

    def prepare(self, accelerator):
        """Kept as the engine keeps the student: sharded by FSDP2, partitioned by ZeRO-3, whole
        under DDP."""
        self.model = frozen_reference(accelerator, self.model)

    @torch.no_grad()
    def hidden(self, inputs: dict, prompts=None) -> torch.Tensor:
        """Its last hidden states at the positions of the student's batch `inputs`: of the same
        rows, or (reading its own) of each of `prompts`' own prompt (`DistillCollator`: the batch's,
        in row order) followed by the student row's text after its prompt, shifted to the student's
        positions (the prompts' positions hold no target)."""
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
        """A slice of the teacher's hidden states through its output layer: one call of its prepared
        module, so the engine gathers the layer as in any forward."""
        return self.model({}, OutputLayer(hidden))

    def generated_accuracy(self, data_args, rows: int, ranks) -> dict:
        """Its held-out generated accuracy (`evaluation.evaluate_generation`) on this rank's share
        of `rows` held-out questions (`ranks`: `distributed.Ranks`), as its own processor writes
        them; teacher_* names; it stays in eval mode."""
        prompts = generation_prompts(data_args, self.processor, rows=rows, ranks=ranks)
        filler = self.collator([prompt_row(self.processor, HELLO, [], template_kwargs=self.template_kwargs)])
        scores = evaluate_generation(self.model, prompts, filler, self.collator, self.processor.tokenizer,
                                     self.stops, ranks.device, self.placeholders)
        self.model.eval()
        return {f"teacher_{name}": value for name, value in scores.items()}

    def describe(self) -> str:
        held, total = parameter_values_held(self.model)
        # inside ZeRO-3's engine, FSDP2's
        family = type(getattr(self.model, "module", self.model).model).__name__
        rows = (", reading rows of its own (its processor writes images otherwise, or it does not hear), aligned on "
                "the text after each prompt") if self.own_processor else ""
        return f"teacher: {family} holding {held:,} of its {total:,} parameter values on this rank, frozen{rows}"
