"""One optimizer step of distillation's divergence over a window, as the distillation recipe will take it
(tests/test_distill.py): the tiny Llava student, a wider tiny Llava teacher (frozen, prepared as the engine keeps
the student), GA micro-batches of this data rank's rows, the exact token mean over the window on every rank.

    accelerate launch --config_file ... tests/distill_window.py TEACHER_DIR GA ROWS_PER_MICRO_BATCH

Prints `window loss L | grad_norm G | teacher: ...` on rank 0. Data rank r of W holds rows r*GA*B ... (r+1)*GA*B - 1 of
`ROWS`, so one process at GA*W micro-batches holds every rank's window in order.
"""

import sys

import torch
from accelerate.utils import set_seed

from mmrecipes.distributed import (
    data_parallel_rank_and_world,
    make_accelerator,
    reconcile_deepspeed_config,
    sum_over_ranks,
    token_loss_scale,
)
from mmrecipes.images import to_device
from mmrecipes.vlm.algorithms.teacher import Teacher
from mmrecipes.vlm.arguments import VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.module_groups import apply_train_modules, module_groups
from mmrecipes.vlm.model.outputs import GeneralizedJSD
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import encode_row
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller, count_target_tokens

COLOURS = {"red": (200, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 200), "yellow": (220, 200, 40)}
# (question, answer, image colour or None): text-only rows among image rows, answers of different lengths
ROWS = [("What colour is the shape?", colour, colour) for colour in COLOURS] + [
    ("Name a colour.", "blue", None), ("Which colour is grass?", "green, as a rule", None),
    ("Say hello.", "hello there", None), ("What is two and two?", "four", None)]


def conversation(question, answer, colour=None):
    from PIL import Image

    content = ([{"type": "image"}] if colour else []) + [{"type": "text", "text": question}]
    images = [Image.new("RGB", (32, 32), COLOURS[colour])] if colour else []
    return [{"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}], images


def main(argv=None):
    teacher_dir, accumulation, rows_per_batch = (argv or sys.argv[1:])[-3:]  # after the test launchers' flags
    accumulation, rows_per_batch = int(accumulation), int(rows_per_batch)
    set_seed(0)
    student, processor = load_vlm(VLMModelArgs())
    # the recipes' default preset, every parameter no path reaches frozen (DDP waits for no gradient)
    apply_train_modules(module_groups(student, dummy_image_inputs(student, processor)), "projector,language_model")
    teacher = Teacher.load(teacher_dir, student, processor)
    labeller = AnswerLabeller(processor, stop_token_ids(student, processor))
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(student, processor))
    accelerator = make_accelerator(gradient_accumulation_steps=accumulation)
    data_rank, data_world = data_parallel_rank_and_world(accelerator)
    optimizer = torch.optim.AdamW([param for param in student.parameters() if param.requires_grad], lr=1e-3)
    reconcile_deepspeed_config(accelerator, train_micro_batch_size_per_gpu=rows_per_batch,
                               gradient_accumulation_steps=accumulation, gradient_clipping=1e9)
    model, optimizer = accelerator.prepare(VLMForTraining(student), optimizer)
    teacher.prepare(accelerator)
    mine = ROWS[data_rank * accumulation * rows_per_batch:][:accumulation * rows_per_batch]
    encoded = [dict(zip(("input_ids", "labels", "media_inputs"), encode_row(labeller, *conversation(*row))))
               for row in mine]
    window = [collator(encoded[start:start + rows_per_batch]) for start in range(0, len(encoded), rows_per_batch)]
    tokens = sum_over_ranks(torch.tensor(float(sum(count_target_tokens(batch["labels"]) for batch in window)),
                                         device=accelerator.device))
    scale = token_loss_scale(tokens, accumulation, data_world)
    summed = torch.zeros((), device=accelerator.device)
    for batch in window:
        with accelerator.accumulate(model):
            inputs = to_device(batch, accelerator.device)
            inputs["teacher_hidden"] = teacher.hidden(inputs)
            value = model(inputs, GeneralizedJSD(teacher.head_logits, beta=0.5, temperature=0.9))
            accelerator.backward(value * scale)
        summed += value.detach()
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1e9)
    loss = sum_over_ranks(summed) / tokens
    accelerator.print(f"window loss {loss.item():.7f} | grad_norm {float(grad_norm):.7f} | {teacher.describe()}")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
