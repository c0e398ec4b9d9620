"""vlm_finetune.py as a user runs it: the default run learns, its output answers through the
pipeline, it loads back, the freezing presets hold under each engine, resume is exact."""

import re

import datasets
import pytest
import torch
from accelerate.utils import set_seed
from huggingface_hub import ModelCard
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor, LlavaForConditionalGeneration, pipeline

from launch import (
    HELD_OUT_64,
    REPO,
    VLM_RECIPE,
    assert_engine,
    assert_same_curves,
    losses,
    run_engine,
    run_recipe,
)
from mmrecipes.model_card import CURVES_SIZE
from mmrecipes.vlm.arguments import VLMModelArgs
from mmrecipes.vlm.model.parts import load_vlm

pytestmark = pytest.mark.launch

MAJORITY_BASELINE = 0.344  # data_prep/make_vlm_data.py: the most common answer per question kind


def accuracies(log: str) -> dict[int, float]:
    pairs = re.findall(r"^eval step (\d+) \| answer_accuracy ([\d.]+)", log, re.M)
    return {int(step): float(acc) for step, acc in pairs}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("vlm_default")
    result = run_recipe("--output_dir", output_dir, "--dataloader_num_workers", 1, recipe=VLM_RECIPE)  # the default
    assert result.returncode == 0, result.log[-3000:]
    return result, output_dir


def test_default_run_learns_and_counts_bad_rows(default_run):
    result, _ = default_run
    assert "[engine] distributed_type=NO num_processes=1" in result.log
    loss, accuracy = losses(result.log), accuracies(result.log)
    assert loss[500] < 0.25 * loss[20]
    assert accuracy[500] > MAJORITY_BASELINE + 0.1, accuracy  # the image is used, not just the question
    # Greedy generation from the processor's own prompt on 64 held-out questions, independent of the labels:
    # with targets that start where generation starts, it scores what the teacher-forced match does.
    generated = re.search(r"^eval step 500 \| .*\| generated_accuracy ([\d.]+) \| eval_generated 64$", result.log, re.M)
    assert generated and float(generated.group(1)) > MAJORITY_BASELINE + 0.1, result.log[-2000:]
    last = [line for line in result.log.splitlines() if line.startswith("step 500/500")][-1]
    for skipped in ("undecodable", "image_mismatch", "too_long"):  # the embedded data's broken rows
        assert int(re.search(rf"{skipped} (\d+)", last).group(1)) > 0, skipped


def test_output_answers_through_the_pipeline_as_the_eval_scores_it(default_run):
    """The saved directory loads with the Auto classes and the image-text-to-text pipeline, and its
    greedy answers are right exactly where the recipe's teacher-forced exact match says so."""
    _, output_dir = default_run
    processor = AutoProcessor.from_pretrained(output_dir)
    model = LlavaForConditionalGeneration.from_pretrained(output_dir)
    answer = pipeline("image-text-to-text", model=str(output_dir))
    test = datasets.load_dataset("parquet", data_files=str(REPO / "data/vlm_shapes/image_chat/test-*.parquet"),
                                 split="train").select(range(32))
    agree = correct = 0
    for example in test:
        question, expected = example["messages"][0]["content"][-1]["text"], example["messages"][1]["content"][0]["text"]
        chat = [{"role": "user", "content": [{"type": "image", "image": example["images"][0]},
                                             {"type": "text", "text": question}]}]
        generated = answer(text=chat, max_new_tokens=8, return_full_text=False)[0]["generated_text"].strip()
        encoded = processor.apply_chat_template(
            chat + [{"role": "assistant", "content": expected}], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, return_tensors="pt")
        with torch.no_grad():
            logits = model(**{k: v for k, v in encoded.items() if k != "assistant_masks"}).logits
        targets = encoded["assistant_masks"][0, 1:].bool()
        scored_right = bool((logits[0, :-1].argmax(-1) == encoded["input_ids"][0, 1:])[targets].all())
        correct += generated == expected
        agree += (generated == expected) == scored_right
    assert agree >= 31, (agree, correct)
    assert correct / len(test) > MAJORITY_BASELINE


def test_output_has_a_model_card_with_curves(default_run):
    _, output_dir = default_run
    card = ModelCard.load(output_dir / "README.md")
    assert card.data.pipeline_tag == "image-text-to-text" and card.data.library_name == "transformers"
    assert {"mmrecipes", "vlm", "full fine-tune", "LlavaForConditionalGeneration"} <= set(card.data.tags)
    assert card.data.base_model is None and "answer_accuracy" in card.text and "conversations" in card.text
    with Image.open(output_dir / "training_curves.png") as image:
        assert image.size == CURVES_SIZE


def test_model_name_or_path_continues_from_a_saved_llava(default_run, tmp_path):
    _, output_dir = default_run
    result = run_recipe("--model_name_or_path", output_dir, "--max_steps", 2, "--logging_steps", 1,
                        "--eval_dataset_name", "", "--peak_tflops", 0.001, "--output_dir", tmp_path, recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert losses(result.log)[1] < 0.6  # trained weights, not a fresh init (about 6 at step 1)
    assert re.search(r"^step 2/2 .*\| MFU \d+\.\d+% \|", result.log, re.M)  # FLOPs counted before prepare


def initial_weights():
    set_seed(42)  # the recipe's default seed: the same tiny Llava it starts from
    model, _ = load_vlm(VLMModelArgs())
    return model.state_dict()


def changed(saved_dir, initial):
    saved = LlavaForConditionalGeneration.from_pretrained(saved_dir).state_dict()
    return {name for name, tensor in saved.items() if not torch.equal(tensor, initial[name])}


PRESET_RUN = ["--max_steps", 3, "--logging_steps", 1, "--per_device_train_batch_size", 1,
              "--gradient_accumulation_steps", 2, "--eval_dataset_name", "", "--warmup_steps", 0]


@pytest.mark.parametrize("config, preset, checkpointing", [
    ("ddp.yaml", "projector", True), ("zero3.yaml", "projector", False), ("fsdp2.yaml", "all", True)])
def test_freezing_presets_with_gradient_checkpointing(config, preset, checkpointing, tmp_path):
    """Frozen parts stay bit-identical and get no optimizer state, without find_unused_parameters;
    gradient checkpointing trains through a frozen embedding (enable_input_require_grads). ZeRO-3 with
    the LM frozen and no checkpointing aborted on a text-only rank before the embedding's output was
    made to require grad there too (the image rank's backward ran through the LM, the text rank's not)."""
    result = run_engine(config, *PRESET_RUN, "--train_modules", preset, "--gradient_checkpointing",
                               str(checkpointing).lower(), "--save_steps", 2, "--output_dir", tmp_path,
                               recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert sorted(losses(result.log)) == [1, 2, 3]
    moved = changed(tmp_path, initial_weights())
    projector = {name for name in initial_weights() if "multi_modal_projector" in name}
    if preset == "projector":
        assert moved == projector
    else:
        assert projector < moved and any("vision_tower" in n for n in moved) and any("language_model" in n
                                                                                     for n in moved)
        assert not any("post_layernorm" in n for n in moved)  # unreached: frozen, and said so
        assert "froze 2 parameters no forward path reaches: model.vision_tower.post_layernorm.weight" in result.log
    if config == "ddp.yaml":
        optimizer = torch.load(tmp_path / "checkpoints" / "checkpoint-2" / "optimizer.bin", weights_only=False)
        assert len(optimizer["state"]) == len(projector)  # frozen parameters hold no Adam state


def test_vision_tower_gets_its_own_learning_rate(tmp_path):
    result = run_recipe(*PRESET_RUN, "--train_modules", "all", "--learning_rate", 1.0e-3,
                        "--vision_tower_learning_rate", 2.0e-6, "--save_steps", 2, "--output_dir", tmp_path,
                        recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    optimizer = torch.load(tmp_path / "checkpoints" / "checkpoint-2" / "optimizer.bin", weights_only=False)
    assert sorted({group["initial_lr"] for group in optimizer["param_groups"]}) == [2.0e-6,
                                                                                    1.0e-3]  # before the schedule


def test_unknown_preset_is_rejected_before_training(tmp_path):
    result = run_recipe("--train_modules", "language_model", "--output_dir", tmp_path, recipe=VLM_RECIPE)
    assert result.returncode != 0
    assert "--train_modules 'language_model': must be one of projector, projector,language_model, all" in result.log
    assert not losses(result.log)


RESUME_RUN = ["--max_steps", 6, "--logging_steps", 1, "--per_device_train_batch_size", 1,
              "--gradient_accumulation_steps", 2, "--eval_steps", 6, "--per_device_eval_batch_size", 256,
              "--save_steps", 3, "--dataloader_num_workers", 1,  # the default: the data position comes from a worker
              "--eval_generation_rows", 8, "--eval_dataset_name", HELD_OUT_64]


def test_default_mixture_at_batch_size_1_and_exact_resume(tmp_path):
    """The default mixture (25% text-only rows) at per-device batch 1 under ZeRO-2 (the other engines run the
    mixed-ranks scenario in test_vlm_engines.py): the dummy runs on text-only micro-batches, every rank
    evaluates the whole held-out set, and the resume from a DataLoader worker's saved position is exact."""
    straight = run_engine("zero2.yaml", *RESUME_RUN, "--output_dir", tmp_path / "straight", recipe=VLM_RECIPE)
    assert straight.returncode == 0, straight.log[-3000:]
    assert_engine(straight.log, "zero2.yaml")
    dummies = sum(map(int, re.findall(r"^step \d+/6 .*\| dummy_image_batches (\d+)", straight.log, re.M)))
    assert dummies > 0  # some micro-batches were text-only: the dummy ran on those ranks
    assert "eval_answers 64" in straight.log  # every rank agrees on the whole held-out set
    resumed = run_engine("zero2.yaml", *RESUME_RUN, "--output_dir", tmp_path / "resumed",
                                "--resume_from_checkpoint", tmp_path / "straight" / "checkpoints" / "checkpoint-3",
                                recipe=VLM_RECIPE)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert "the data at its saved position in epoch 0" in resumed.log  # through the DataLoader worker
    assert_same_curves(resumed.log, straight.log, [4, 5, 6], abs=1e-5)
    saved = load_file(tmp_path / "straight" / "model.safetensors")
    for name, tensor in load_file(tmp_path / "resumed" / "model.safetensors").items():
        torch.testing.assert_close(tensor, saved[name], rtol=1e-5, atol=1e-6, msg=name)
