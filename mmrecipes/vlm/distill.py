"""Distillation's teacher: a frozen image-text-to-text model, sharded like the student (`reference.frozen_reference`),
whose last hidden states the student's divergence reads through the teacher's own output layer, slice by slice
(`models.generalized_jsd_sum`), so neither model's logits of a whole batch exist.

Logit distillation compares the two next-token distributions entry by entry: the teacher must share the student's
vocabulary (the same tokens at the same ids, the same output size) and read the student's rows as the same tokens
(its processor writing the same image tokens). Both are checked before the first step (`mismatch`).
"""

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from .models import VLMForTraining, hidden_states
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
        ids = [processor(text=text, images=[image])["input_ids"][0] for processor in (student_processor,
                                                                                     teacher_processor)]
    except (ValueError, KeyError, TypeError) as error:
        return f"the teacher's processor cannot read the student's conversation with an image ({error})"
    if list(ids[0]) != list(ids[1]):
        return (f"their processors write the same conversation with an image as other tokens ({len(ids[0])} and "
                f"{len(ids[1])}: another image token count); aligning the two on the text tokens is not supported")
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

    def describe(self) -> str:
        held, total = parameter_values_held(self.model)
        return (f"teacher: {type(self.model).__name__} holding {held:,} of its {total:,} parameter values on this "
                "rank, frozen")
