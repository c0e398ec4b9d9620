"""Distillation's teacher and divergence (mmrecipes.vlm.distill): the step over a window on 2 ranks x 2 micro-batches
equals one process holding the window (loss and gradient norm) under DDP, FSDP2 and ZeRO-3, the teacher kept as the
engine keeps the student (sharded, partitioned); a teacher whose vocabulary or processor differs is refused before any
step, with the reason."""

import re

import pytest
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers import chat_row, tiny
from launch import REPO, run_engine, run_recipe
from mmrecipes.paths import resolve_name
from mmrecipes.vlm.arguments import PromptDataArgs, VLMModelArgs
from mmrecipes.vlm.collate import ChatCollator
from mmrecipes.vlm.distill import DistillCollator, DistillPreprocessor, Teacher, mismatch, on_policy
from mmrecipes.vlm.labels import AnswerLabeller
from mmrecipes.vlm.losses import IGNORE_INDEX
from mmrecipes.vlm.models import load_vlm

TINY_SFT_VLM = resolve_name("embedded:tiny_sft_vlm")

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
    wider, wider_processor = load_vlm(VLMModelArgs(text_hidden_size=192))
    assert mismatch(student, processor, wider, wider_processor) is None
    wider_processor.image_processor.image_mean = [0.0, 0.0, 0.0]  # the same tokens, other pixels
    assert "other inputs (pixel_values)" in mismatch(student, processor, wider, wider_processor)


def test_prompt_rows_and_chat_rows_become_a_prompt_with_the_dataset_answer_after_it():
    """TRL's prompt rows (with a `solution`) and chat rows: the prompt as the processor writes it with the generation
    prompt, then the dataset's answer, its tokens the only targets (a chat row's earlier answers are context, as in a
    sample); a prompt row without a solution has no off-policy answer and is counted."""
    processor = AutoProcessor.from_pretrained(TINY_SFT_VLM)
    stops = [processor.tokenizer.convert_tokens_to_ids("<|end|>")]
    preprocess = DistillPreprocessor(PromptDataArgs(), AnswerLabeller(processor, stops), max_length=64)
    red = Image.new("RGB", (32, 32), (220, 40, 40))
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    earlier = chat_row("Name a colour.", "blue")["messages"]
    rows = [{"prompt": question, "images": [red], "solution": "red"},
            chat_row("What colour is it?", "red", red),
            {"messages": earlier + chat_row("What colour is it?", "red", red)["messages"], "images": [red]},
            {"prompt": "What colour is it?", "images": [red]},  # no solution
            {"prompt": "What colour is it? " * 40, "solution": "red"}]  # over max_length
    out = preprocess({key: [row.get(key) for row in rows] for key in {key for row in rows for key in row}})
    assert preprocess.drops.totals == {"no_target": 1, "too_long": 1}
    prompt = processor(text=processor.apply_chat_template(question, add_generation_prompt=True), images=[red])
    answer = processor.tokenizer("red<|end|>", add_special_tokens=False)["input_ids"]
    for input_ids, labels, length in zip(out["input_ids"][:2], out["labels"][:2], out["prompt_length"][:2]):
        assert list(input_ids[:length]) == list(prompt["input_ids"][0]) and length == len(prompt["input_ids"][0])
        assert [int(t) for t in labels if t != IGNORE_INDEX] == answer == list(input_ids[length:length + 2])
    input_ids, labels, length = out["input_ids"][2], out["labels"][2], out["prompt_length"][2]
    assert [int(t) for t in labels if t != IGNORE_INDEX] == answer  # "blue" is context
    assert processor.tokenizer.decode(input_ids[:length]).count("blue") == 1
    # the collator: the off-policy micro-batch, and each row's prompt for the samplers
    batch = DistillCollator(ChatCollator(processor.tokenizer.pad_token_id, {}))(
        [dict(zip(out, values)) for values in zip(*out.values())])
    assert batch["answers"]["target_tokens"] == 3 * len(answer) and batch["num_samples"] == 3
    assert [len(prompt["input_ids"]) for prompt in batch["prompts"]] == list(out["prompt_length"])


def test_a_step_is_on_policy_with_probability_lmbda_the_same_draw_on_every_rank():
    draws = [on_policy(42, step, 0.3) for step in range(2000)]
    assert sum(draws) / len(draws) == pytest.approx(0.3, abs=0.03)
    assert draws == [on_policy(42, step, 0.3) for step in range(2000)]  # a rank, a resume: the same
    assert draws != [on_policy(7, step, 0.3) for step in range(2000)]
    assert not any(on_policy(42, step, 0.0) for step in range(100)) and all(
        on_policy(42, step, 1.0) for step in range(100))
