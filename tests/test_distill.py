"""Distillation's teacher and divergence (mmrecipes.vlm.distill): the step over a window on 2 ranks x 2 micro-batches
equals one process holding the window (loss and gradient norm) under DDP, FSDP2 and ZeRO-3, the teacher kept as the
engine keeps the student (sharded, partitioned); a teacher whose vocabulary or processor differs is refused before any
step, with the reason."""

import re

import pytest
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers import tiny
from launch import REPO, run_engine, run_recipe
from mmrecipes.vlm.arguments import VLMModelArgs
from mmrecipes.vlm.distill import Teacher, mismatch
from mmrecipes.vlm.models import load_vlm

WINDOW = REPO / "tests" / "distill_window.py"
LINE = re.compile(r"window loss ([\d.]+) \| grad_norm ([\d.]+) \| teacher: (.*)")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A wider tiny Llava of the student's tokenizer and processor (the teacher of a smaller student)."""
    directory = tmp_path_factory.mktemp("teacher")
    model, processor = load_vlm(VLMModelArgs(text_hidden_size=192, text_layers=3))
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def window_line(result):
    assert result.returncode == 0, result.log[-3000:]
    return LINE.search(result.log).groups()


@pytest.mark.launch
def test_two_ranks_by_two_micro_batches_equal_one_process_with_the_teacher_sharded(teacher_dir):
    truth = window_line(run_recipe(teacher_dir, 4, 2, recipe=WINDOW))
    for config in ("ddp.yaml", "fsdp2.yaml", "zero3.yaml"):
        loss, grad_norm, held = window_line(run_engine(config, teacher_dir, 2, 2, recipe=WINDOW))
        assert float(loss) == pytest.approx(float(truth[0]), rel=1e-5), config
        assert float(grad_norm) == pytest.approx(float(truth[1]), rel=1e-5), config
        values = [int(number.replace(",", "")) for number in re.findall(r"[\d,]+", held)[:2]]
        assert (values[0] < values[1]) == (config != "ddp.yaml"), (config, held)  # sharded, partitioned, whole


def test_a_teacher_of_another_vocabulary_or_processor_is_refused(tiny_vlms, tmp_path):
    student, processor, _ = tiny()
    other = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen2_5_vl"])
    assert "output layer has" in mismatch(student, processor, other, AutoProcessor.from_pretrained(
        tiny_vlms["qwen2_5_vl"]))
    # the same tokenizer, images at another size: another image token count
    wider, wider_processor = load_vlm(VLMModelArgs(image_size=64))
    assert "as other tokens" in mismatch(student, processor, wider, wider_processor)
    wider.save_pretrained(tmp_path)
    wider_processor.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs a teacher of the student's vocabulary and processor"):
        Teacher.load(str(tmp_path), student, processor)
    assert mismatch(student, processor, *load_vlm(VLMModelArgs(text_hidden_size=192))) is None
