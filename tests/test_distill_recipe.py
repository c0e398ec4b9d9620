"""vlm_distill.py: on 2 CPU processes it gives what one process holding the whole window gives (the same samples, the
same divergence and gradient norm every step, the same weights after it, the same held-out divergence), with the
teacher kept as the engine keeps the student; the default run trains on the embedded data and its output loads with
the Auto class and the pipeline; bad settings are refused before the first step.

The student is the embedded SFT'd tiny Llava, the teacher the embedded wider one (`data_prep/tiny_sft_vlm.py`). With
--seed 0 and --lmbda 0.5 steps 2 and 4 train on the student's samples and steps 1 and 3 on the dataset's answers (or,
--seq_kd, on the teacher's samples). Orthogonal runs (tests/README.md):
- FSDP2: the student samples by the synced loop (every forward gathers); a sharded teacher of 64 px images (64
  image tokens against 16) reads rows of its own; the dataset's answers off-policy;
- ZeRO-3: the student samples by `generate` on the gathered model (--ds3_gather_for_generation), the partitioned
  teacher by the synced loop (--seq_kd); held-out divergence and accuracy at steps 0 and 4; resumed from step 2.
"""

import re

import pytest
from PIL import Image
from transformers import AutoModelForImageTextToText, LlavaForConditionalGeneration, pipeline

from helpers import chat_row, write_chat_parquet
from launch import (
    REPO,
    assert_adam_weights_close,
    assert_engine,
    assert_resume_repeats,
    load_recipe,
    run_engine,
    run_recipe,
)
from mmrecipes.vlm.arguments import VLMModelArgs
from mmrecipes.vlm.model.parts import load_vlm
from test_grpo_engines import metric

DISTILL_RECIPE = REPO / "recipes" / "vlm_distill.py"
STEPS = 4
COMMON = ["--max_steps", STEPS, "--logging_steps", 1, "--max_completion_length", 5, "--learning_rate", 1e-3,
          "--seed", 0, "--lmbda", 0.5, "--beta", 0.5, "--temperature", 1.5, "--dataset_name", "parquet",
          "--dataset_weights", "", "--shuffle_buffer_size", 1, "--ddp_timeout", 60]
RANKS = ["--per_device_train_batch_size", 1, "--gradient_accumulation_steps", 2]
SINGLE = ["--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 1]
NO_EVALUATION = ["--eval_dataset_name", "", "--eval_steps", 100]
RUNS = {  # engine -> its flags, the same for its one-process ground truth
    "fsdp2.yaml": [*NO_EVALUATION, "--teacher_model_name_or_path", "LARGER_IMAGES"],
    "zero3.yaml": ["--seq_kd", "true", "--ds3_gather_for_generation", "true", "--eval_dataset_name", "parquet",
                   "--eval_data_files", "HELD_OUT", "--eval_steps", STEPS, "--eval_generation_rows", 4,
                   "--per_device_eval_batch_size", 2, "--save_steps", 2],
}
EVAL = r"^eval step {step} \|.* {name} ([\d.]+)"


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """rank{0,1}.parquet (two rows a step each: image and text-only questions) and single/all.parquet (a step's rows of
    rank 0, then rank 1's); held_out/test.parquet."""
    data = tmp_path_factory.mktemp("distill_scenario")
    square = {name: Image.new("RGB", (32, 32), rgb) for name, rgb in
              (("red", (220, 40, 40)), ("blue", (40, 40, 220)), ("green", (40, 200, 40)), ("yellow", (230, 220, 40)))}
    pictures = [chat_row("What colour is the shape?", name, image) for name, image in square.items()]
    texts = [chat_row(question, answer) for question, answer in
             (("What colour is the sky?", "blue"), ("What number comes after one?", "two"),
              ("What colour is snow?", "white"), ("What is the opposite of below?", "above, as a rule"))]
    rank0 = [pictures[0], texts[0], texts[1], pictures[1]] * 2
    rank1 = [texts[2], pictures[2], pictures[3], texts[3]] * 2
    write_chat_parquet(data / "rank0.parquet", rank0)
    write_chat_parquet(data / "rank1.parquet", rank1)
    (data / "single").mkdir()
    single = [row for step in range(4) for row in rank0[2 * step:2 * step + 2] + rank1[2 * step:2 * step + 2]]
    write_chat_parquet(data / "single" / "all.parquet", single)
    (data / "held_out").mkdir()
    write_chat_parquet(data / "held_out" / "test.parquet", pictures[::-1] + texts)
    # a wider teacher of 64 px images (64 image tokens against the student's 16): it reads rows of its own
    model, processor = load_vlm(VLMModelArgs(image_size=64, text_hidden_size=192))
    model.save_pretrained(data / "teacher")
    processor.save_pretrained(data / "teacher")
    return data


def run_flags(config, scenario):
    """RUNS[config] with the scenario's paths in."""
    paths = {"HELD_OUT": scenario / "held_out" / "test.parquet", "LARGER_IMAGES": scenario / "teacher"}
    return [paths.get(flag, flag) for flag in RUNS[config]]


def engine_flags(config, scenario):
    return [*COMMON, *RANKS, *run_flags(config, scenario), "--data_files", scenario / "rank*.parquet"]


@pytest.fixture(scope="module")
def runs(scenario, tmp_path_factory):
    """{engine: (2-process result, one-process result, the 2-process run's output directory, the one process's)}."""
    results = {}
    for config in RUNS:
        single_dir = tmp_path_factory.mktemp("distill_single")
        single = run_recipe(*COMMON, *SINGLE, *run_flags(config, scenario), "--data_files",
                            scenario / "single" / "all.parquet", "--output_dir", single_dir, recipe=DISTILL_RECIPE)
        assert single.returncode == 0, single.log[-3000:]
        output_dir = tmp_path_factory.mktemp(f"distill_{config[:-5]}")
        ranks = run_engine(config, *engine_flags(config, scenario), "--output_dir", output_dir,
                           recipe=DISTILL_RECIPE)
        results[config] = ranks, single, output_dir, single_dir
    return results


@pytest.mark.launch
@pytest.mark.parametrize("config", list(RUNS), ids=[config[:-5] for config in RUNS])
def test_two_ranks_sample_and_step_as_one_process_with_the_teacher_sharded(runs, config):
    ranks, single, output_dir, single_dir = runs[config]
    assert ranks.returncode == 0, ranks.log[-3000:]
    assert_engine(ranks.log, config, wrapped="VLMForTraining")
    held, total = (int(value.replace(",", "")) for value in re.search(
        r"teacher: LlavaForConditionalGeneration holding ([\d,]+) of its ([\d,]+)", ranks.log).groups())
    assert held < total, ranks.log  # sharded, partitioned: never whole on a rank
    assert ("sampling: generate, the whole model gathered" in ranks.log) == (config == "zero3.yaml")
    assert ("reading rows of its own" in ranks.log) == (config == "fsdp2.yaml")
    assert metric(single.log, "on_policy") == {1: 0.0, 2: 1.0, 3: 0.0, 4: 1.0}  # --seed 0's draws
    sampled = [1, 2, 3, 4] if "--seq_kd" in RUNS[config] else [2, 4]  # the teacher's samples, or the answers
    for name in ("on_policy", "sample_length", "loss", "grad_norm"):
        got, expected = metric(ranks.log, name), metric(single.log, name)
        assert sorted(got) == sorted(expected) == (sampled if name == "sample_length" else [1, 2, 3, 4]), name
        for step in got:
            assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-6), (name, step)
    # the gradients themselves, through four AdamW steps: the saved students hold the same weights
    assert_adam_weights_close(LlavaForConditionalGeneration.from_pretrained(output_dir).state_dict(),
                              LlavaForConditionalGeneration.from_pretrained(single_dir).state_dict(),
                              learning_rate=1e-3, steps=STEPS)
    if "--seq_kd" in RUNS[config]:  # held-out: the student at steps 0 and 4, the teacher once
        for step, name in ((0, "divergence"), (4, "divergence"), (0, "teacher_generated_accuracy"),
                           (4, "answer_accuracy"), (4, "eval_tokens"), (4, "eval_generated")):
            pattern = re.compile(EVAL.format(step=step, name=name), re.M)
            assert float(pattern.search(ranks.log)[1]) == pytest.approx(float(pattern.search(single.log)[1]),
                                                                         rel=1e-5), (step, name)


@pytest.mark.launch
def test_a_resume_repeats_the_straight_run(runs, scenario, tmp_path):
    """From ZeRO-3's checkpoint-2: the same draws, samples (the teacher's at step 3, the student's at step 4),
    divergence and gradient norms at steps 3 and 4, and the same held-out scores at step 4, every number as printed."""
    straight, _, output_dir, _ = runs["zero3.yaml"]
    resumed = run_engine("zero3.yaml", *engine_flags("zero3.yaml", scenario), "--output_dir", tmp_path,
                         "--resume_from_checkpoint", output_dir / "checkpoints" / "checkpoint-2",
                         recipe=DISTILL_RECIPE)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert_resume_repeats(resumed.log, straight.log, [3, 4])  # eval step 4's held-out scores too
    assert re.search(EVAL.format(step=4, name="divergence"), resumed.log, re.M)
    assert "eval step 0" not in resumed.log  # the start's evaluation is the straight run's


def test_the_default_run_distils_the_embedded_teacher_into_a_model_that_loads(tmp_path, capsys):
    """The default run's settings for a few steps: the teacher's and the student's held-out scores at step 0, the
    student's after, and a benchmark's (AI2D's 16-token answers); its output loads with the Auto class and answers
    through the pipeline; its card says what it learnt from."""
    load_recipe(DISTILL_RECIPE).main(["--max_steps", "4", "--logging_steps", "2", "--eval_steps", "4",
                                      "--eval_generation_rows", "8", "--report_to", "none",
                                      "--output_dir", str(tmp_path), "--benchmarks", "ai2d", "--benchmark_data_dir",
                                      "embedded:benchmarks", "--benchmark_limit", "3"])
    log = capsys.readouterr().out
    assert re.search(r"eval step 4 \| bench/ai2d/exact_match [\d.]+ \| bench/ai2d/documents 3 \|", log)
    assert re.search(r"eval step 0 \|.*divergence [\d.]+ .*teacher_generated_accuracy [\d.]+", log), log[-2000:]
    assert re.search(r"eval step 4 \| answer_accuracy [\d.]+ .*generated_accuracy [\d.]+ .*divergence", log)
    assert "teacher: LlavaForConditionalGeneration holding 2,110,272 of its 2,110,272" in log
    model = AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    answer = pipeline("image-text-to-text", model=str(tmp_path))(
        text=[{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (32, 32), (220, 40, 40))},
                                           {"type": "text", "text": "What colour is the shape?"}]}],
        max_new_tokens=3, return_full_text=False)
    assert isinstance(answer[0]["generated_text"], str)
    card = (tmp_path / "README.md").read_text()
    assert "distillation" in card and "teacher " in card and "tiny_teacher_vlm" in card


@pytest.mark.parametrize("flags, message", [
    (["--teacher_model_name_or_path", "embedded:tiny_lm"], "is not an image-text-to-text|Unrecognized"),
    (["--lmbda", "1.5"], "--lmbda 1.5: must be a number from 0 to 1"),
    (["--beta", "-0.1"], "--beta -0.1: must be a number from 0 to 1"),
    (["--packing", "true"], "GRPO and distillation sample whole completions"),
])
def test_bad_settings_are_refused_before_the_first_step(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        load_recipe(DISTILL_RECIPE).main([*flags, "--report_to", "none", "--output_dir", str(tmp_path)])
