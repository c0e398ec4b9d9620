"""vlm_finetune.py under every engine, 2 CPU processes: mixed text-only / image batches never break
a rank, the token-mean loss is exact, engines agree, resume repeats the straight run.

Scenario data (one parquet shard per data rank, read in order): per-device batch 1 and
accumulation 2, so one rank's whole first window is text-only while the other's has images, the
second window is the reverse, and the third mixes both within each rank. Text answers are 6x
longer than image answers: a per-micro-batch mean would weight the ranks' tokens unequally.
"""

import pytest
import torch
from PIL import Image
from transformers import LlavaForConditionalGeneration

from launch import REPO, VLM_RECIPE, accelerate_launch, engine_line, grad_norms, losses, run_recipe
from test_chat_data import chat_row, write_chat_parquet

pytestmark = pytest.mark.launch

EXPECTED_ENGINE = {
    "ddp.yaml": "distributed_type=MULTI_CPU num_processes=2 backend=gloo world_size=2 model=DistributedDataParallel",
    "fsdp2.yaml": "distributed_type=FSDP num_processes=2 backend=gloo world_size=2 model=FSDPVLMForTraining",
    "zero2.yaml": "distributed_type=DEEPSPEED num_processes=2 backend=gloo world_size=2 model=DeepSpeedEngine",
    "zero3.yaml": "distributed_type=DEEPSPEED num_processes=2 backend=gloo world_size=2 model=DeepSpeedEngine",
}
WITHOUT_DUMMY = REPO / "tests" / "recipe_without_dummy.py"
STEPS = 6
COMMON = ["--max_steps", STEPS, "--logging_steps", 1, "--per_device_train_batch_size", 1,
          "--gradient_accumulation_steps", 2, "--ddp_timeout", 60]
SCENARIO = [*COMMON, "--dataset_name", "parquet", "--dataset_weights", "", "--shuffle_buffer_size", 1,
            "--eval_dataset_name", ""]


def image_row():
    return chat_row("What colour is the shape?", "red", Image.new("RGB", (32, 32), (220, 40, 40)))


def text_row():
    return chat_row("What is the opposite of above?", "below, below, below, below, below, below, below")


def write_scenario(data):
    """rank{0,1}.parquet (one shard per data rank) and single/all.parquet (the same windows for one process)."""
    image, text = image_row(), text_row()
    write_chat_parquet(data / "rank0.parquet", [image, image, text, text, image, text] * 4)
    write_chat_parquet(data / "rank1.parquet", [text, text, image, image, text, image] * 4)
    (data / "single").mkdir()
    write_chat_parquet(data / "single" / "all.parquet", [image, image, text, text] * 12)
    return data


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    return write_scenario(tmp_path_factory.mktemp("scenario"))


@pytest.fixture(scope="module")
def scenario_runs(scenario, tmp_path_factory):
    results = {}
    for config in EXPECTED_ENGINE:
        output_dir = tmp_path_factory.mktemp("scenario_" + config.split(".")[0])
        results[config] = (accelerate_launch(config, *SCENARIO, "--data_files", scenario / "rank*.parquet",
                                             "--output_dir", output_dir, recipe=VLM_RECIPE), output_dir)
    return results


@pytest.fixture(scope="module")
def single_process(scenario, tmp_path_factory):
    """The ground truth: one process holds each whole window as ONE batch of 4 rows, where the mean
    over the batch's tokens is the token mean (a per-micro-batch mean on 2 ranks x 2 micro-batches
    of 1 row would weight a 2-token answer like a 15-token one, and fail the comparison)."""
    output_dir = tmp_path_factory.mktemp("single")
    result = run_recipe(*SCENARIO, "--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 1,
                        "--data_files", scenario / "single" / "all.parquet", "--output_dir", output_dir,
                        recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    return result, output_dir


@pytest.mark.parametrize("config", list(EXPECTED_ENGINE))
def test_mixed_ranks_match_one_process(scenario_runs, single_process, config):
    """Text-only and image micro-batches on different ranks run under every engine, and every step's
    token-mean loss and gradient norm equal one process holding the whole window."""
    result, output_dir = scenario_runs[config]
    assert result.returncode == 0, result.log[-3000:]
    assert EXPECTED_ENGINE[config] in engine_line(result.log)
    truth, truth_dir = single_process
    assert sorted(losses(result.log)) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert losses(result.log)[step] == pytest.approx(losses(truth.log)[step], rel=1e-4), f"loss, step {step}"
        assert grad_norms(result.log)[step] == pytest.approx(grad_norms(truth.log)[step],
                                                             rel=1e-4), f"grad, step {step}"
    reference = LlavaForConditionalGeneration.from_pretrained(truth_dir).state_dict()
    for name, tensor in LlavaForConditionalGeneration.from_pretrained(output_dir).state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("config", list(EXPECTED_ENGINE))
def test_same_scenario_without_the_dummy_fails(scenario, config, tmp_path):
    """What most trainers do (a text-only batch skips the tower) fails on the same data: the passing
    runs above prove the dummy is what makes them work. Gloo aborts within seconds (a mismatched
    collective); on NCCL the same mistake hangs until the timeout. With a DataLoader worker, which
    must end with its crashed rank (or the launcher's output pipe stays open and this test hangs)."""
    result = accelerate_launch(config, *SCENARIO, "--data_files", scenario / "rank*.parquet", "--output_dir", tmp_path,
                               "--ddp_timeout", 30, "--dataloader_num_workers", 1, recipe=WITHOUT_DUMMY, timeout=300)
    assert result.returncode != 0
    assert f"step {STEPS}/{STEPS}" not in result.log
    assert "Received data size doesn't match expected size" in result.log or "Expected to have finished reduction" in result.log


@pytest.mark.parametrize("config", ["ddp.yaml", "fsdp2.yaml"])
def test_divergence_guard_names_the_diverging_modules(scenario, config, tmp_path):
    """--debug_divergence turns the same failure into one clear error on every rank, raised before
    the engine's collective (FSDP2 would all-gather the tower's parameters on one rank only)."""
    result = accelerate_launch(config, *SCENARIO, "--data_files", scenario / "rank*.parquet", "--output_dir", tmp_path,
                               "--ddp_timeout", 30, "--debug_divergence", "true", recipe=WITHOUT_DUMMY, timeout=300)
    assert result.returncode != 0
    message = ("RuntimeError: divergence guard: ranks run different modules at module call 2: rank 0 is about to "
               "run 'model.model.vision_tower', rank 1 is about to run 'model'")
    for rank in (0, 1):  # the same error on every rank, naming each rank's module
        assert f"[rank{rank}]: {message}" in result.log
    assert "Received data size doesn't match" not in result.log


def test_divergence_guard_passes_the_dummy_runs(scenario, scenario_runs, tmp_path):
    """Switched on by the environment variable, the guard finds nothing to stop in runs that are
    right, and changes no number."""
    result = accelerate_launch("fsdp2.yaml", *SCENARIO, "--data_files", scenario / "rank*.parquet",
                               "--output_dir", tmp_path, recipe=VLM_RECIPE, env={"MMRECIPES_DEBUG_DIVERGENCE": "1"})
    assert result.returncode == 0, result.log[-3000:]
    assert losses(result.log) == losses(scenario_runs["fsdp2.yaml"][0].log)
