"""Multi-turn vlm_grpo.py (--environment_factory: the zoom task's environment, the tiny zoom model that calls it) on
2 CPU processes under DDP and ZeRO-3 gives what one process holding the whole step gives: the same
trajectories (their model tokens' mean length, the calls and failed calls, the rewards), losses, gradient norms and
weights, 2 micro-batches a step on each rank (groups of 4 in micro-batches of 4, as tests/test_grpo_engines.py's
FSDP2 run). Turns are sampled at temperature 1, so calls that do not parse (counted as failed, the error the tool's
result) and answers without a call mix with well-formed calls: trajectories of different turn counts on the ranks,
sampled in step (the synced loop, ZeRO-3's here: a filler where a rank has fewer going on; FSDP2's synced
loop samples in test_grpo_engines.py, the turns above it are the same code). Failures on one
rank only: the tool fails on rank 1's rows (their `fail_zoom`), and the benchmark at the end (AI2D) has documents of
another form on rank 1 only; each is said once with that rank, and every rank goes on in step."""

import re

import datasets
import pytest
from transformers import LlavaForConditionalGeneration

from helpers import documents, write_task
from launch import REPO, assert_adam_weights_close, assert_engine, metric, run_engine, run_recipe

pytestmark = pytest.mark.launch

GRPO_RECIPE = REPO / "recipes" / "vlm_grpo.py"
STEPS = 1  # multi-turn sampling is most of a step: one shows the step, the weights after it
COMMON = ["--model_name_or_path", "embedded:tiny_zoom_vlm", "--environment_factory",
          "tools_for_tests:ZoomFailingWhereAsked", "--max_length", 512, "--max_completion_length", 160,
          "--max_steps", STEPS, "--logging_steps", 1, "--eval_steps", 100, "--learning_rate", 1e-3,
          "--warmup_steps", 0, "--dataset_name", "parquet", "--dataset_weights", "", "--shuffle_buffer_size", 1,
          "--eval_dataset_name", "", "--ddp_timeout", 60, "--num_generations", 4]
RANKS = ["--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 2]
SINGLE = ["--per_device_train_batch_size", 16, "--gradient_accumulation_steps", 1]
ENGINES = ("ddp.yaml", "zero3.yaml")
COMPARED = ("completions/mean_length", "reward", "tools/call_frequency", "tools/failure_frequency", "loss",
            "grad_norm")
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{engine or "single": (result, output directory)}: rank r reads rank{r}.parquet (2 prompts a step), one
    process reads the steps' 4 prompts in the ranks' order."""
    data = tmp_path_factory.mktemp("zoom_scenario")
    prompts = datasets.load_dataset("parquet", data_files=str(REPO / "data" / "vlm_zoom" / "prompts" /
                                                             "test-*.parquet"), split="train").select(range(8))
    prompts = prompts.add_column("fail_zoom", [index in (2, 3, 6, 7) for index in range(8)])  # rank 1's rows
    # AI2D's documents 1 and 3 (rank 1's of the first 4, strided) with letters for answers: unscorable there only
    write_task(data / "benchmarks", "ai2d", [doc | {"answer": "ABCD"[int(doc["answer"])]} if index % 2 else doc
                                             for index, doc in enumerate(documents("ai2d")[:4])])
    benchmark = ["--benchmarks", "ai2d", "--benchmark_data_dir", data / "benchmarks"]
    ranks = [prompts.select([0, 1, 4, 5]), prompts.select([2, 3, 6, 7])]
    for rank, rows in enumerate(ranks):
        rows.to_parquet(data / f"rank{rank}.parquet")
    (data / "single").mkdir()
    prompts.to_parquet(data / "single" / "all.parquet")  # steps: rank 0's two, rank 1's two
    single_dir = tmp_path_factory.mktemp("zoom_single")
    results = {"single": (run_recipe(*COMMON, *SINGLE, *benchmark, "--data_files", data / "single" / "all.parquet",
                                     "--output_dir", single_dir, recipe=GRPO_RECIPE), single_dir)}
    for config in ENGINES:
        output_dir = tmp_path_factory.mktemp(f"zoom_{config[:-5]}")
        results[config] = (run_engine(config, *COMMON, *RANKS, *benchmark, "--data_files", data / "rank*.parquet",
                                      "--output_dir", output_dir, recipe=GRPO_RECIPE,
                                      env={"PYTHONPATH": str(REPO / "tests")}), output_dir)
    return results


@pytest.mark.parametrize("config", ENGINES, ids=[config[:-5] for config in ENGINES])
def test_two_ranks_sample_multi_turn_trajectories_and_step_as_one_process(runs, config):
    single, single_dir = runs["single"]
    ranks, output_dir = runs[config]
    assert single.returncode == 0, single.log[-3000:]
    assert ranks.returncode == 0, ranks.log[-3000:]
    assert_engine(ranks.log, config, wrapped="VLMForTraining")
    for name in COMPARED:
        got, expected = metric(ranks.log, name, nan=True), metric(single.log, name, nan=True)
        assert sorted(got) == list(range(1, STEPS + 1)), (name, ranks.log[-2000:])
        for step in got:
            assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-6), (name, step)
    calls = metric(ranks.log, "tools/call_frequency", nan=True)
    assert 0 < min(calls.values()) and max(calls.values()) < 2  # calls, and answers without one
    # failures on rank 1 only: said once, naming that rank and the user's error; the benchmark scored the rest
    assert ranks.log.count("tool calls failed (zoom/raised) on rank 1: RuntimeError: the zoom failed on this "
                           "row") == 1, ranks.log[-3000:]
    assert "benchmark ai2d: 2 documents could not be scored (unscorable), left out of its numbers: document 1: " \
           "ValueError" in ranks.log
    benchmark_lines = [re.search(rf"^eval step {STEPS} \|.*$", log, re.M)[0] for log in (ranks.log, single.log)]
    assert benchmark_lines[0] == benchmark_lines[1] and "bench/ai2d/documents 2 " in benchmark_lines[0]
    assert benchmark_lines[0].endswith("bench/ai2d/unscorable 2"), benchmark_lines
    assert max(metric(ranks.log, "grad_norm", nan=True).values()) > 0
    assert_adam_weights_close(LlavaForConditionalGeneration.from_pretrained(output_dir).state_dict(),
                              LlavaForConditionalGeneration.from_pretrained(single_dir).state_dict(),
                              learning_rate=1e-3, steps=STEPS)
