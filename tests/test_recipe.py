"""clip_pretrain.py behaviour: accumulation communication, exact resume, config rejection, real-data path."""

import json
import re

import pytest
import torch
import yaml
from PIL import Image
from transformers import CLIPModel

from launch import (
    REPO,
    assert_same_curves,
    load_recipe,
    losses,
    run_engine,
    run_recipe,
    run_recipe_on_ranks,
)
from mmrecipes.contrastive.arguments import DataArgs, ModelArgs
from mmrecipes.contrastive.models import build_contrastive
from webdataset_shards import make_webdataset

pytestmark = pytest.mark.launch


def _count_gradient_allreduces(rank, world_size, argv):
    """Run the recipe in this gloo process, counting DDP's gradient all-reduces (one per bucket)."""
    import accelerate
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = []
    prepare = accelerate.Accelerator.prepare

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    def counting_prepare(self, *objects):
        prepared = prepare(self, *objects)
        prepared[0].register_comm_hook(None, counting_hook)
        return prepared

    accelerate.Accelerator.prepare = counting_prepare
    load_recipe().main(argv)
    return len(calls)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_gradients_all_reduced_once_per_optimizer_step(tmp_path, accumulation):
    """With `accelerator.accumulate` the all-reduce count per optimizer step does not
    grow with the accumulation window (it would be x4 if every micro-batch synchronised)."""
    steps = 3
    argv = ["--report_to", "none", "--max_steps", str(steps), "--gradient_accumulation_steps", str(accumulation),
            "--per_device_train_batch_size", "8", "--eval_split", "", "--output_dir", str(tmp_path)]
    counts = run_recipe_on_ranks(_count_gradient_allreduces, 2, argv)
    # The tiny model fits one 25 MB DDP bucket: one all-reduce per optimizer step, whatever the window.
    assert counts == [steps, steps]


CONTROL_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                       "broadcast_object_list", "barrier", "reduce", "reduce_scatter_tensor", "all_to_all_single")


def _count_control_collectives(rank, world_size, argv):
    """Run the recipe in this gloo process, counting its `torch.distributed` collectives (DDP's
    gradient buckets and the loss's functional collectives do not go through these) and the host
    reads (`item`, `tolist`, `bool`, `float`) of their results: on a GPU each is a wait for the
    device (a host copy started at once and read later is not)."""
    import torch.distributed as dist

    calls, results, reads = [], {}, []  # results: id -> tensor (kept alive, so no id is reused)
    for name in CONTROL_COLLECTIVES:
        def counted(*args, _name=name, _collective=getattr(dist, name), **kwargs):
            calls.append(_name)
            if args and isinstance(args[0], torch.Tensor):
                results[id(args[0])] = args[0]
            return _collective(*args, **kwargs)
        setattr(dist, name, counted)
    for method in ("item", "tolist", "__bool__", "__float__"):
        def read(self, *args, _method=getattr(torch.Tensor, method), **kwargs):
            if id(self) in results or id(self._base) in results:
                reads.append(self)
            return _method(self, *args, **kwargs)
        setattr(torch.Tensor, method, read)
    load_recipe().main(argv)
    return len(calls), len(reads)


@pytest.mark.parametrize("fused", [False, True])
def test_one_control_collective_per_optimizer_step(tmp_path, fused):
    """The step boundary's one small all-reduce (StepGuard: finite? stop?) is the only collective a
    steady-state optimizer step adds, whatever the accumulation window: no per-micro-step "every
    rank has a batch" agreement, no per-step counters or loss reduction (those wait for logging).
    With fused AdamW (the CUDA default) the step never waits for its result on the host: the
    optimizer skips a non-finite step on the device; others read the verdict once per step."""
    def per_step(steps):
        argv = ["--report_to", "none", "--max_steps", str(steps), "--gradient_accumulation_steps", "4",
                "--per_device_train_batch_size", "4", "--logging_steps", "1000", "--eval_split", "",
                "--fused_adamw", str(fused).lower(), "--output_dir", str(tmp_path / str(steps))]
        return run_recipe_on_ranks(_count_control_collectives, 2, argv)

    short, long = per_step(2), per_step(5)
    assert short[0] == short[1] and long[0] == long[1]
    collectives, host_reads = ((after - before) / 3 for after, before in zip(long[0], short[0]))
    assert collectives == 1
    assert host_reads == (0 if fused else 1)


def test_resume_continues_exactly(tmp_path):
    """Two sources mixed at --dataset_weights (the embedded shapes and a folder of other captions): the resume
    repeats the straight run's steps, the log counts each source's rows, and its counters go on from the
    checkpoint's (they restarted from zero before)."""
    (tmp_path / "other").mkdir()
    for index in range(16):
        Image.new("RGB", (16, 16), (0, index * 16, 0)).save(tmp_path / "other" / f"{index}.png")
    (tmp_path / "other" / "metadata.csv").write_text(
        "file_name,text\n" + "".join(f"{index}.png,a green square number {index}\n" for index in range(16)))
    common = ["--max_steps", 4, "--logging_steps", 1, "--per_device_train_batch_size", 16,
              "--gradient_accumulation_steps", 2, "--eval_split", "", "--output_dir", tmp_path / "run",
              "--dataset_name", f"{DataArgs().dataset_name},{tmp_path / 'other'}", "--dataset_weights", "0.75,0.25"]
    straight = run_recipe(*common, "--save_steps", 2)
    rows = [tuple(map(int, found)) for found in re.findall(r"rows_shapes (\d+) \| rows_other (\d+)$", straight.log,
                                                           re.M)]
    assert len(rows) == 4 and sum(rows[-1]) == 4 * 32 and 0 < rows[-1][1] < 64, rows
    assert straight.returncode == 0, straight.log[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "checkpoint-2").is_dir()
    resumed = run_recipe(*common, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert "resumed from" in resumed.log and "at step 2" in resumed.log
    # Same weights, optimizer, schedule and data position: steps 3 and 4 repeat to float precision.
    assert_same_curves(resumed.log, straight.log, [3, 4], abs=1e-6)
    counters = r"^step 4/4 .*\| skipped_steps 0 (.*)$"  # the data counters and the rows of each source
    assert re.search(counters, resumed.log, re.M)[1] == re.search(counters, straight.log, re.M)[1]


def test_adam_betas_and_the_warmup_stable_decay_schedule_reach_the_run(tmp_path):
    """--adam_beta1/2 and --adam_epsilon (HF's names) are what the run's AdamW steps with (its checkpoint's
    optimizer state), and warmup_stable_decay with its --lr_scheduler_kwargs warms up, holds the peak and decays."""
    peak = 1.0e-3
    result = run_recipe("--max_steps", 8, "--warmup_steps", 2, "--lr_scheduler_type", "warmup_stable_decay",
                        "--lr_scheduler_kwargs", '{"num_decay_steps": 3}', "--learning_rate", peak,
                        "--adam_beta1", 0.8, "--adam_beta2", 0.98, "--adam_epsilon", 1.0e-6, "--logging_steps", 1,
                        "--per_device_train_batch_size", 16, "--eval_split", "", "--zeroshot_dataset", "",
                        "--save_steps", 4, "--output_dir", tmp_path)
    assert result.returncode == 0, result.log[-3000:]
    (group,) = torch.load(tmp_path / "checkpoints" / "checkpoint-4" / "optimizer.bin")["param_groups"][:1]
    assert tuple(group["betas"]) == (0.8, 0.98) and group["eps"] == 1.0e-6
    rates = {int(step): float(lr) for step, lr in re.findall(r"^step (\d+)/8 \|.*?\| lr ([\d.e+-]+)", result.log, re.M)}
    assert sorted(rates) == list(range(1, 9)), result.log[-2000:]
    assert rates[1] < peak and all(rates[step] == pytest.approx(peak) for step in (2, 3, 4, 5)), rates
    assert peak > rates[6] > rates[7] > rates[8], rates


def test_deepspeed_accumulation_mismatch_rejected_before_first_step(tmp_path):
    """A user's DeepSpeed JSON (by absolute path) whose accumulation disagrees with the recipe's."""
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
                 "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    launch_config = yaml.safe_load((REPO / "accelerate_configs" / "zero2.yaml").read_text())
    launch_config["deepspeed_config"] = {"deepspeed_config_file": str(tmp_path / "ds.json"), "zero3_init_flag": False}
    (tmp_path / "zero2.yaml").write_text(yaml.safe_dump(launch_config))
    result = run_engine(tmp_path / "zero2.yaml", "--gradient_accumulation_steps", 2, "--max_steps", 2,
                        "--output_dir", tmp_path / "out")
    assert result.returncode != 0
    assert "gradient_accumulation_steps=4 (the recipe uses 2)" in result.log
    assert not losses(result.log)  # rejected before the first step


def test_indivisible_global_batch_rejected(tmp_path):
    result = run_recipe("--global_batch_size", 30, "--gradient_accumulation_steps", 4, "--output_dir", tmp_path)
    assert result.returncode != 0
    assert "--global_batch_size 30 is not divisible" in result.log and "e.g. 32" in result.log


def test_pretrained_model_and_local_imagefolder(tmp_path):
    """The real-data path: --model_name_or_path (a saved CLIP dir) and an imagefolder dataset."""
    first = run_recipe("--max_steps", 1, "--eval_split", "", "--logit_scale_init_value", 3.3,
                       "--output_dir", tmp_path / "model")
    assert first.returncode == 0, first.log[-3000:]
    loaded, _, _ = build_contrastive(ModelArgs(model_name_or_path=str(tmp_path / "model")))
    assert loaded.logit_scale.shape == (1,)  # reshaped for FSDP/DeepSpeed, but not re-initialised
    assert loaded.logit_scale.item() == pytest.approx(CLIPModel.from_pretrained(tmp_path / "model").logit_scale.item())
    assert loaded.logit_scale.item() == pytest.approx(3.3, abs=0.01)
    for split, count in (("train", 24), ("test", 8)):
        folder = tmp_path / "folder" / split
        folder.mkdir(parents=True)
        rows = []
        for i in range(count):
            Image.new("RGB", (40, 48), (10 * i, 100, 200 - 5 * i)).save(folder / f"{i}.png")
            rows.append(f"{i}.png,a picture number {i}")
        (folder / "metadata.csv").write_text("file_name,caption\n" + "\n".join(rows) + "\n")
    result = run_recipe("--model_name_or_path", tmp_path / "model", "--dataset_name", tmp_path / "folder",
                        "--caption_column", "caption", "--max_steps", 3, "--logging_steps", 1,
                        "--per_device_train_batch_size", 8, "--output_dir", tmp_path / "finetuned")
    assert result.returncode == 0, result.log[-3000:]
    assert "eval_pairs 8" in result.log and sorted(losses(result.log)) == [1, 2, 3]


def test_feature_cache_window_trains_like_one_big_batch(tmp_path):
    """--contrastive_accumulation feature_cache with 2 micro-batches of 16 reads the same rows as
    one batch of 32 and must give the same gradients, hence the same loss curve."""
    common = ["--max_steps", 3, "--logging_steps", 1, "--eval_split", ""]
    cached = run_recipe(*common, "--per_device_train_batch_size", 16, "--gradient_accumulation_steps", 2,
                        "--contrastive_accumulation", "feature_cache", "--output_dir", tmp_path / "cached")
    big = run_recipe(*common, "--per_device_train_batch_size", 32, "--output_dir", tmp_path / "big")
    assert cached.returncode == 0 and big.returncode == 0, cached.log[-2000:] + big.log[-2000:]
    assert losses(cached.log) == pytest.approx(losses(big.log), rel=1e-4)
    plain = run_recipe(*common, "--per_device_train_batch_size", 16, "--gradient_accumulation_steps", 2,
                       "--output_dir", tmp_path / "plain")
    assert losses(plain.log)[1] < losses(big.log)[1] - 0.3  # 16 negatives per row, not 32: a different objective


def test_empty_data_shard_stops_every_rank_with_one_error(tmp_path):
    """One row, two data ranks: rank 1 has nothing to read. Both ranks must stop at the first
    step with the same clear error (an all-reduced flag), not hang in the next collective."""
    (tmp_path / "data").mkdir()
    image = Image.new("RGB", (16, 16), (255, 0, 0))
    image.save(tmp_path / "data" / "0.png")
    (tmp_path / "data" / "metadata.csv").write_text("file_name,text\n0.png,a red square\n")
    result = run_engine("ddp.yaml", "--dataset_name", tmp_path / "data", "--eval_split", "", "--max_steps", 2,
                        "--output_dir", tmp_path / "out", timeout=300)
    assert result.returncode != 0
    assert result.log.count("RuntimeError: A data rank has no training rows (2 data ranks)") == 2  # both ranks
    assert "this rank's share of the data is empty (1 files or shards)" in result.log  # the rank without rows
    assert not losses(result.log)
    # Own data, no zero-shot flags: the embedded shapes are not evaluated beside it.
    assert "--zeroshot_dataset is off: you train on your own data" in result.log


def test_builder_with_only_training_files_never_globs_the_working_directory(tmp_path):
    """`--dataset_name parquet` with brace-range and comma-listed training files, run from the repo
    root (whose files a glob for the eval split would try to read): evaluation is off with one line.
    A missing eval file stops the run before the first step."""
    for shard in range(4):
        name = f"train-{shard:05d}-of-00004.parquet"
        (tmp_path / name).write_bytes((REPO / "data" / "shapes" / name).read_bytes())
    files = f"{tmp_path}/train-{{00000..00001}}-of-00004.parquet,{tmp_path}/train-00003-of-00004.parquet"
    args = ["--dataset_name", "parquet", "--data_files", files, "--max_steps", 2, "--logging_steps", 1,
            "--per_device_train_batch_size", 16]
    result = run_recipe(*args, "--output_dir", tmp_path / "out")
    assert result.returncode == 0, result.log[-3000:]
    assert "evaluation: retrieval off: --dataset_name parquet reads only the files it is given" in result.log
    assert sorted(losses(result.log)) == [1, 2]
    missing = run_recipe(*args, "--eval_data_files", tmp_path / "missing.parquet", "--output_dir", tmp_path / "out2")
    assert missing.returncode != 0 and "missing.parquet" in missing.log and not losses(missing.log)


def test_webdataset_tar_shards_train_and_evaluate(tmp_path):
    """open_clip users' command line: a brace range of img2dataset tars, `jpg`/`txt` columns, an eval tar."""
    written = make_webdataset(tmp_path)
    result = run_recipe("--dataset_name", "webdataset", "--data_files", f"{tmp_path}/train-{{00000..00003}}.tar",
                        "--eval_data_files", tmp_path / "test-00000.tar", "--image_column", "jpg",
                        "--caption_column", "txt", "--max_steps", 8, "--logging_steps", 4, "--eval_steps", 8,
                        "--per_device_train_batch_size", 60, "--output_dir", tmp_path / "out")
    assert result.returncode == 0, result.log[-3000:]
    assert sorted(losses(result.log)) == [4, 8] and f"eval_pairs {written['test']}" in result.log
    last = re.findall(r"^step 8/8 .*$", result.log, re.M)[0]
    assert re.search(r"undecodable [1-9]", last) and re.search(r"no_caption [1-9]", last)  # 2 epochs of 4 tars


def test_data_wait_is_a_fraction_in_every_log_line_and_the_tracker(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_recipe("--report_to", "tensorboard", "--max_steps", 6, "--logging_steps", 2, "--eval_split", "",
                        "--per_device_train_batch_size", 16, "--output_dir", tmp_path)
    assert result.returncode == 0, result.log[-3000:]
    logged = [float(value) for value in re.findall(r"^step \d+/6 \|.*\| data_wait ([\d.]+) \|", result.log, re.M)]
    assert len(logged) == 3 and all(0 <= value <= 1 for value in logged)
    tracked = EventAccumulator(str(tmp_path / "clip_pretrain")).Reload().Scalars("data_wait")  # the run's scalars
    assert [event.step for event in tracked] == [2, 4, 6]
    assert [round(event.value, 3) for event in tracked] == logged
