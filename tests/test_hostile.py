"""Hostile flags, data and checkpoints, as a new user meets them: each case ends in a clear error before the
first step or a counted skip; no checkpoint runs code, nothing hangs, no checkpoint is lost. Everything runs
in this process (the checkpoint validator, the output directory's lock, the flag checks, the data pipeline);
one test runs the recipe, in one process, to show the whole resume path refusing a planted pickle."""

import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from PIL import Image

from helpers import Payload, make_checkpointer, refit_manifest
from launch import REPO, VLM_RECIPE, assert_same_curves, load_recipe, run_recipe
from mmrecipes.checkpoint_validation import UnsafeCheckpoint
from mmrecipes.checkpointing import MARKER
from mmrecipes.config import parse_args
from mmrecipes.contrastive.arguments import DataArgs, ModelArgs
from mmrecipes.contrastive.data import COUNTED, build_dataloader
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.distributed import Ranks, make_accelerator
from mmrecipes.images import decode_image
from mmrecipes.loader import batches_forever
from mmrecipes.output_dir import LOCK_NAME, STALE_AFTER_S, OutputDirBusy, OutputDirLock
from mmrecipes.paths import SHAPES_DATA
from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.rows.chat_data import CHAT_COUNTED, build_chat_dataloader
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.template_checks import check_template

CLIP_RECIPE, VLM = load_recipe(), load_recipe(VLM_RECIPE)


# ----------------------------------------------------------------------------------------------- flags

@pytest.mark.parametrize("flag, value, message", [
    ("--max_grad_norm", "nan", "--max_grad_norm nan: must be a finite number, 0 or more, or unset"),
    ("--max_grad_norm", "-1", "--max_grad_norm -1.0: must be a finite number, 0 or more"),
    ("--save_total_limit", "-1", "--save_total_limit -1: must be a positive integer, or unset"),
    ("--save_total_limit", "0", "--save_total_limit 0: must be a positive integer, or unset"),
    ("--max_steps", "0", "--max_steps 0: must be a positive integer"),
    ("--max_steps", "-3", "--max_steps -3: must be a positive integer"),
    ("--logging_steps", "0", "--logging_steps 0: must be a positive integer (the default is 20)"),
    ("--eval_steps", "0", "--eval_steps 0: must be a positive integer"),
    ("--gradient_accumulation_steps", "0", "--gradient_accumulation_steps 0: must be a positive integer"),
    ("--per_device_train_batch_size", "0", "--per_device_train_batch_size 0: must be a positive integer"),
    ("--learning_rate", "nan", "--learning_rate nan: must be a finite number above 0"),
    ("--learning_rate", "1e30", "--learning_rate 1e+30: must be a finite number above 0 and at most 1"),  # NaN before
    ("--dataset_weights", "nan,1", "--dataset_weights 'nan,1': give one finite weight"),  # numpy's NaN error before
    ("--dataset_weights", "1,inf", "--dataset_weights '1,inf': give one finite weight"),
    ("--mixed_precision", "fp16", "--mixed_precision fp16 needs a GPU"),  # said fp16, computed fp32
    ("--warmup_steps", "-1", "--warmup_steps -1: must be 0 or a positive integer"),
    ("--preemption_signals", "SIGTERM,SIGFOO", "SIGFOO is not a signal a process can catch"),
    ("--preemption_signals", "SIGKILL", "SIGKILL is not a signal a process can catch"),
    ("--shuffle_buffer_size", "0", "--shuffle_buffer_size 0: must be a positive integer"),
    ("--dataloader_num_workers", "-1", "--dataloader_num_workers -1: must be 0 or a positive integer, or unset"),
    ("--max_image_pixels", "0", "--max_image_pixels 0: must be a positive integer"),
    ("--max_image_aspect_ratio", "0", "--max_image_aspect_ratio 0.0: must be a finite number above 0"),
])
def test_bad_flags_are_refused_before_anything_runs(flag, value, message):
    for recipe in (CLIP_RECIPE, VLM):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_args(recipe.ARGUMENTS, [flag, value])


def test_bad_values_from_yaml_and_recipe_flags_are_refused(tmp_path):
    (tmp_path / "run.yaml").write_text("max_steps: 0\nlogging_steps: 5\n")
    with pytest.raises(ValueError, match="--max_steps 0: must be a positive integer"):
        parse_args(CLIP_RECIPE.ARGUMENTS, [str(tmp_path / "run.yaml")])
    with pytest.raises(ValueError, match="--max_num_patches 100000: must be a positive integer, at most 4096"):
        parse_args(CLIP_RECIPE.ARGUMENTS, ["--max_num_patches", "100000"])  # no step in 300 s before
    with pytest.raises(ValueError, match="--loss_tile_size 0: must be a positive integer, or unset"):
        parse_args(CLIP_RECIPE.ARGUMENTS, ["--loss_tile_size", "0"])
    with pytest.raises(ValueError, match="--max_length 0: must be a positive integer"):
        parse_args(VLM.ARGUMENTS, ["--max_length", "0"])
    # Weights for a single source do nothing: refused, not ignored (a default weighting is ignored there).
    with pytest.raises(ValueError, match="one source: nothing to mix, drop --dataset_weights"):
        parse_args(VLM.ARGUMENTS, ["--dataset_name", "json", "--data_files", "a.json", "--dataset_weights", "0.5,0.5"])
    parse_args(VLM.ARGUMENTS, ["--dataset_name", "json", "--data_files", "a.json"])
    with pytest.raises(ValueError, match="--lora_dropout 1.0: must be a number from 0 up to"):
        parse_args(VLM.ARGUMENTS, ["--lora_dropout", "1"])
    # Several problems are named at once.
    with pytest.raises(ValueError, match="--max_steps 0.*; --logging_steps 0"):
        parse_args(CLIP_RECIPE.ARGUMENTS, ["--max_steps", "0", "--logging_steps", "0"])


def test_max_grad_norm_zero_turns_clipping_off():
    """0 (or None from YAML) means: measure the norm, clip nothing (it used to clip every gradient to 0)."""
    for value in ("0", "0.0"):
        args = parse_args(CLIP_RECIPE.ARGUMENTS, ["--max_grad_norm", value])[-1]
        assert args.max_grad_norm == float("inf")
    gradient = torch.nn.Parameter(torch.ones(3))
    gradient.grad = torch.full((3,), 10.0)
    norm = torch.nn.utils.clip_grad_norm_([gradient], args.max_grad_norm)
    assert norm == pytest.approx(10 * 3 ** 0.5) and torch.equal(gradient.grad, torch.full((3,), 10.0))


def test_a_recipe_with_a_bad_flag_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="--save_total_limit -1"):
        CLIP_RECIPE.main(["--save_total_limit", "-1", "--output_dir", str(tmp_path / "out"), "--report_to", "none"])
    assert not (tmp_path / "out").exists()


def test_a_deepspeed_json_that_is_not_there_is_named(monkeypatch, tmp_path):
    """accelerate reads `deepspeed_config_file` relative to where it is launched from; from elsewhere the run
    used to fail inside DeepSpeed. The shipped ZeRO configs are inline and need no file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "accelerate_configs/zero3.json")
    with pytest.raises(FileNotFoundError, match="does not exist as seen from .*: accelerate reads it relative"):
        make_accelerator()
    for stage in (2, 3):
        text = (REPO / "accelerate_configs" / f"zero{stage}.yaml").read_text()
        assert f"zero_stage: {stage}" in text and "deepspeed_config_file" not in text.split("deepspeed_config:")[1]


# ------------------------------------------------------------------------------------------ checkpoints

def test_a_clean_checkpoint_validates_and_resumes_where_the_run_stood(run, saved):
    checkpoint = run.checkpoints.root / "checkpoint-4"
    assert run.checkpoints.problems(checkpoint) == []
    start, resumed_epoch = run.checkpoints.open_run("latest", run.loader)
    assert start == 4 and resumed_epoch == 0
    batches = batches_forever(run.loader, resumed_epoch)
    for expected in saved.after:
        assert torch.equal(next(batches)[1]["input_ids"], expected)


@pytest.mark.parametrize("name", ["random_states_0.pkl", "optimizer.bin"])
def test_a_pickle_of_any_protocol_is_refused_even_with_a_fitting_manifest(run, tmp_path, name):
    """Protocol 0 starts with 'c', not 0x80: the old check let it through, and torch's legacy loader ran it."""
    checkpoint, marker = run.checkpoints.root / "checkpoint-4", tmp_path / "payload-ran"
    for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
        (checkpoint / name).write_bytes(pickle.dumps(Payload(marker), protocol=protocol))
        refit_manifest(checkpoint)
        problems = run.checkpoints.problems(checkpoint)
        assert any(f"{name}: unpickling it would call posix.system" in problem for problem in problems), problems
    # a benign first pickle followed by a payload (torch's legacy format reads several)
    (checkpoint / name).write_bytes(pickle.dumps(1) + pickle.dumps(Payload(marker), protocol=0))
    refit_manifest(checkpoint)
    assert any("posix.system" in problem for problem in run.checkpoints.problems(checkpoint))
    with pytest.raises(UnsafeCheckpoint, match="posix.system"):
        run.checkpoints.find(str(checkpoint))
    assert not marker.exists()


def test_dcp_metadata_and_its_non_tensor_items_are_checked(run, tmp_path):
    """FSDP2's files: torch.distributed.checkpoint reads `.metadata` with pickle.load and the non-tensor items
    of its `.distcp` files with torch.load(weights_only=False); a payload in either is refused."""
    checkpoint, marker = run.checkpoints.root / "checkpoint-4", tmp_path / "payload-ran"
    folder = checkpoint / "pytorch_model_fsdp_0"
    dcp.save({"weight": torch.ones(3), "lr": 0.1, "betas": (0.9, 0.99)}, checkpoint_id=folder, no_dist=True)
    refit_manifest(checkpoint)
    assert run.checkpoints.problems(checkpoint) == []  # what DCP writes is plain data
    metadata = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=0))
    refit_manifest(checkpoint)
    assert any(".metadata: unpickling it would call posix.system" in p for p in run.checkpoints.problems(checkpoint))
    (folder / ".metadata").write_bytes(metadata)
    shutil.rmtree(folder)
    dcp.save({"weight": torch.ones(3), "lr": Payload(marker)}, checkpoint_id=folder, no_dist=True)
    refit_manifest(checkpoint)
    assert any("posix.system" in problem for problem in run.checkpoints.problems(checkpoint))
    assert not marker.exists()


@pytest.mark.parametrize("damage, named", [
    (lambda c: (c / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda c: (c / "random_states_0.pkl").unlink(), "random_states_0.pkl is missing"),
    (lambda c: (c / "optimizer.bin").write_bytes((c / "optimizer.bin").read_bytes()[:1000]),
     r"optimizer.bin has 1000 bytes, the save wrote \d+ \(truncated\?\)"),
    (lambda c: (c / "data_state_0.json").write_text(
        (c / "data_state_0.json").read_text().replace('"epoch": 0', '"epoch": 7')),
     "data_state_0.json differs from what the save wrote"),
    (lambda c: (c / "extra.pt").write_bytes(b"hello"), "extra.pt is not a file the save wrote"),
    (lambda c: (c / MARKER).write_text(json.dumps({"step": 4})), "has no file manifest"),
])
def test_latest_falls_back_to_the_newest_checkpoint_that_validates(run, damage, named, capsys):
    damage(run.checkpoints.root / "checkpoint-4")
    assert re.search(named, "; ".join(run.checkpoints.problems(run.checkpoints.root / "checkpoint-4")))
    assert run.checkpoints.find("latest") == run.checkpoints.root / "checkpoint-2"
    assert re.search(f"resuming from checkpoint-2, the newest checkpoint that validates; passed over checkpoint-4: "
                     f".*{named}", capsys.readouterr().out)
    damage(run.checkpoints.root / "checkpoint-2")
    with pytest.raises(UnsafeCheckpoint, match="no checkpoint under .* validates"):
        run.checkpoints.find("latest")
    assert sorted(path.name for path in run.checkpoints.root.iterdir()) == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.parametrize("edit, named", [
    (lambda state: state.update(epoch=7), "epoch 7 is not an epoch 4 steps can reach"),
    (lambda state: state["loader"]["dataset_state"].update(rows_done=99999), "rows_done=99999 is out of range"),
    (lambda state: state["loader"]["dataset_state"].update(kept=-5), "kept=-5 is out of range"),
    (lambda state: state["loader"]["dataset_state"].update(block="0"), "block='0' is out of range"),
])
def test_a_data_position_out_of_range_is_refused(run, edit, named):
    checkpoint = run.checkpoints.root / "checkpoint-4"
    state = json.loads((checkpoint / "data_state_0.json").read_text())
    edit(state)
    (checkpoint / "data_state_0.json").write_text(json.dumps(state))
    refit_manifest(checkpoint)
    assert any(named in problem for problem in run.checkpoints.problems(checkpoint))


def test_a_scheduler_state_that_is_not_the_schedulers_is_refused(run):
    checkpoint = run.checkpoints.root / "checkpoint-4"
    (checkpoint / "scheduler.json").write_text("{}")
    refit_manifest(checkpoint)
    assert any("scheduler.json holds [], not the scheduler's state" in p for p in run.checkpoints.problems(checkpoint))


def test_a_copy_beside_the_checkpoints_is_not_a_checkpoint(run):
    shutil.copytree(run.checkpoints.root / "checkpoint-4", run.checkpoints.root / "checkpoint-6-backup")
    assert [path.name for path in run.checkpoints.complete()] == ["checkpoint-2", "checkpoint-4"]
    assert run.checkpoints.find("latest") == run.checkpoints.root / "checkpoint-4"


def test_a_resume_with_another_dataset_or_model_is_refused_unless_asked(saved, tmp_path):
    shutil.copytree(saved.root / "checkpoints", tmp_path / "checkpoints")
    other_data = tmp_path / "other"
    other_data.mkdir()
    shutil.copy(SHAPES_DATA / "train-00000-of-00004.parquet", other_data / "train-00000-of-00001.parquet")
    args = DataArgs(dataset_name=str(other_data))
    run = make_checkpointer(tmp_path, saved.model, saved.tokenizer, saved.image_processor, data_args=args)
    with pytest.raises(ValueError, match=r"was saved with data=\[.*5 files.*\]; this run has data=\[.*1 files"):
        run.checkpoints.find("latest")
    # A moved copy of the same dataset is the same data.
    moved = tmp_path / "moved"
    shutil.copytree(SHAPES_DATA, moved)
    same = make_checkpointer(tmp_path, saved.model, saved.tokenizer, saved.image_processor,
                             data_args=DataArgs(dataset_name=str(moved)))
    assert same.checkpoints.find("latest") == tmp_path / "checkpoints" / "checkpoint-4"
    # --ignore_data_skip: the rest is restored, the data start from the beginning.
    anyway = make_checkpointer(tmp_path, saved.model, saved.tokenizer, saved.image_processor, data_args=args,
                               ignore_data_skip=True)
    assert anyway.checkpoints.open_run("latest", anyway.loader) == (4, None)
    anyway.checkpoints.lock.release()

    other_model, _, _ = build_contrastive(ModelArgs(hidden_size=32))
    wrong = make_checkpointer(tmp_path, other_model, saved.tokenizer, saved.image_processor)
    with pytest.raises(ValueError,
                       match=r"holds another model: \d+ parameters differ, e.g. .*341x64 there, 341x32 here"):
        wrong.checkpoints.find("latest")


@pytest.mark.launch
def test_the_recipe_passes_over_a_planted_checkpoint_and_runs_no_code(tmp_path):
    """End to end, one process: checkpoint-4's RNG file replaced by a protocol-0 payload with a fitting
    manifest; `latest` resumes from checkpoint-2, says why, and the payload never runs."""
    args = ["--max_steps", 6, "--save_steps", 2, "--logging_steps", 1, "--per_device_train_batch_size", 16,
            "--eval_split", "", "--zeroshot_dataset", "", "--output_dir", tmp_path / "out"]
    first = run_recipe(*args)
    assert first.returncode == 0, first.log[-3000:]
    checkpoint, marker = tmp_path / "out" / "checkpoints" / "checkpoint-4", tmp_path / "payload-ran"
    (checkpoint / "random_states_0.pkl").write_bytes(pickle.dumps(Payload(marker), protocol=0))
    refit_manifest(checkpoint)
    resumed = run_recipe(*args, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert "passed over checkpoint-4: " in resumed.log and "unpickling it would call posix.system" in resumed.log
    assert re.search(r"resumed from \S+checkpoint-2 at step 2", resumed.log)
    assert_same_curves(resumed.log, first.log, [3, 4, 5, 6], abs=1e-6)
    assert not marker.exists()


# ------------------------------------------------------------------------------------- the output dir lock

def write_lock(output_dir, **owner):
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": None, "start_time": None,
                                                    "slurm_job_id": None} | owner))


def start_time(pid):
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def test_a_second_run_in_one_output_dir_is_refused_and_deletes_nothing(run, tmp_path):
    """The first run is alive (here: a sleeping process holding the lock) and mid-save: the second run stops
    before it removes anything, naming the owner."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, pid=owner.pid, start_time=start_time(owner.pid))
        (run.checkpoints.root / ".partial-checkpoint-6").mkdir()
        with pytest.raises(OutputDirBusy, match=f"is in use by pid {owner.pid} on {socket.gethostname()}"):
            run.checkpoints.open_run("latest", run.loader)
        assert (run.checkpoints.root / ".partial-checkpoint-6").is_dir()
    finally:
        owner.kill()
        owner.wait()
    # Its process is gone: the lock is stale and taken over, and the leftover save removed.
    start, _ = run.checkpoints.open_run("latest", run.loader)
    assert start == 4 and not (run.checkpoints.root / ".partial-checkpoint-6").exists()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    run.checkpoints.lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_whose_process_was_killed_but_not_yet_reaped_is_stale(tmp_path):
    """A SIGKILLed run stays a zombie until something reaps it (its launcher, killed too, cannot; a
    container's PID 1 may take its time): its /proc entry, start time included, is still there."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, pid=owner.pid, start_time=start_time(owner.pid))
        with pytest.raises(OutputDirBusy, match=f"in use by pid {owner.pid}"):
            OutputDirLock(tmp_path).acquire()
        os.kill(owner.pid, signal.SIGKILL)
        while Path(f"/proc/{owner.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.05)  # dead, not reaped: this test holds off wait()
        lock = OutputDirLock(tmp_path)
        assert "its process no longer runs" in lock.acquire()
        lock.release()
    finally:
        owner.kill()
        owner.wait()


def test_locks_from_other_hosts_go_stale_by_time_or_by_slurm_job(tmp_path, monkeypatch):
    write_lock(tmp_path, host="node-17", pid=4242)
    with pytest.raises(OutputDirBusy, match="in use by pid 4242 on node-17"):
        OutputDirLock(tmp_path).acquire()
    old = time.time() - STALE_AFTER_S - 10
    os.utime(tmp_path / LOCK_NAME, (old, old))
    lock = OutputDirLock(tmp_path)
    assert "not refreshed for" in lock.acquire()
    lock.release()
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    write_lock(tmp_path, host="node-17", pid=4242, slurm_job_id="99")  # the same job, requeued on other nodes
    lock = OutputDirLock(tmp_path)
    assert "the same Slurm job 99, requeued" in lock.acquire()
    lock.release()


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_first_step(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OutputDirBusy, match="cannot be created"):
        OutputDirLock(tmp_path / "a-file" / "out").acquire()
    with pytest.raises(OutputDirBusy, match="is not writable"):  # even for root
        OutputDirLock("/proc/self").acquire()


# ------------------------------------------------------------------------------------------------- data

@pytest.fixture(scope="module")
def clip_tiny():
    _, tokenizer, image_processor = build_contrastive(ModelArgs())
    return tokenizer, image_processor


def image_bytes(colour=(200, 10, 10), size=(24, 20), fmt="PNG"):
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=fmt)
    return buffer.getvalue()


def clip_rows(clip_tiny, data_args, *, batch_size=64, shuffle_seed=None):
    """(kept captions' token counts, counts by kind) of one epoch of the CLIP stream."""
    loader = build_dataloader(data_args, "train", data_args.data_files, *clip_tiny, batch_size=batch_size,
                              ranks=Ranks(), shuffle_seed=shuffle_seed)
    batches = list(loader)
    counts = dict(zip(COUNTED, sum(batch["data_counts"] for batch in batches).tolist()))
    return sum(len(batch["input_ids"]) for batch in batches), counts


def test_empty_unreadable_and_truncated_parquet_files_are_skipped_and_counted(tmp_path, clip_tiny):
    table = pa.table({"image": [{"bytes": image_bytes(), "path": None}] * 5, "text": [f"row {i}" for i in range(5)]})
    pq.write_table(table, tmp_path / "a-good.parquet")
    pq.write_table(table.slice(0, 0), tmp_path / "b-empty.parquet")  # 0 rows: "BatchSize must be greater than 0"
    (tmp_path / "c-zero-bytes.parquet").write_bytes(b"")
    (tmp_path / "d-cut.parquet").write_bytes((tmp_path / "a-good.parquet").read_bytes()[:300])
    pq.write_table(table, tmp_path / "e-good.parquet")
    kept, counts = clip_rows(clip_tiny, DataArgs(dataset_name="parquet", data_files=f"{tmp_path}/*.parquet"))
    assert kept == 10 and counts["bad_shard"] == 3


def test_an_empty_shard_in_the_training_stream_resumes_across_epochs(tmp_path, clip_tiny):
    """One empty shard of two used to crash the run after step 5, and every resume at the same point."""
    table = pa.table({"image": [{"bytes": image_bytes(), "path": None}] * 24, "text": [f"row {i}" for i in range(24)]})
    pq.write_table(table, tmp_path / "train-0.parquet")
    pq.write_table(table.slice(0, 0), tmp_path / "train-1.parquet")
    args = DataArgs(dataset_name="parquet", data_files=f"{tmp_path}/train-*.parquet", shuffle_buffer_size=10)

    def stream():
        loader = build_dataloader(args, "train", args.data_files, *clip_tiny, batch_size=5,
                                  ranks=Ranks(), shuffle_seed=0)
        return loader, batches_forever(loader)

    loader, batches = stream()
    straight = [next(batches) for _ in range(12)]  # 24 rows in 5 batches an epoch: into the third epoch
    assert {epoch for epoch, _ in straight} == {0, 1, 2}
    loader, batches = stream()
    for _ in range(6):
        next(batches)
    state = loader.state_dict()
    loader, _ = stream()
    loader.load_state_dict(state)
    resumed = batches_forever(loader, resumed_epoch=straight[5][0])
    for (_, expected), (_, batch) in zip(straight[6:], (next(resumed) for _ in range(6))):
        assert torch.equal(batch["input_ids"], expected["input_ids"])
    assert sum(batch["data_counts"][COUNTED.index("bad_shard")] for _, batch in straight) >= 2  # once an epoch


def test_img2dataset_parquet_with_a_binary_image_column_decodes(tmp_path, clip_tiny):
    """img2dataset writes `jpg` as plain bytes (no datasets Image feature): every row used to be undecodable."""
    table = pa.table({"jpg": [image_bytes(fmt="JPEG")] * 6, "txt": [f"a red thing {i}" for i in range(6)],
                      "key": [str(i) for i in range(6)]})
    pq.write_table(table, tmp_path / "00000.parquet")
    kept, counts = clip_rows(clip_tiny, DataArgs(dataset_name="parquet", data_files=str(tmp_path / "00000.parquet"),
                                                 image_column="jpg", caption_column="txt"))
    assert kept == 6 and counts["undecodable"] == 0


def add_member(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_webdataset_members_that_break_the_reader_are_counted(tmp_path, clip_tiny):
    """A first sample without `.txt` (datasets inferred the columns from it and refused the shard), a
    non-UTF-8 `.txt` (UnicodeDecodeError), and a tar cut inside a member (read 27 of 48 rows silently)."""
    noise = numpy.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=numpy.uint8)
    with tarfile.open(tmp_path / "whole.tar", "w") as tar:
        for key in range(8):
            buffer = io.BytesIO()
            Image.fromarray(noise).save(buffer, format="PNG")
            add_member(tar, f"{key:03d}.jpg", buffer.getvalue())
            add_member(tar, f"{key:03d}.txt", f"caption {key}".encode())
    with tarfile.open(tmp_path / "whole.tar") as tar:
        cut = tar.getmember("004.jpg").offset_data + 100
    (tmp_path / "shard-0.tar").write_bytes((tmp_path / "whole.tar").read_bytes()[:cut])  # 4 whole samples
    (tmp_path / "whole.tar").unlink()
    with tarfile.open(tmp_path / "shard-1.tar", "w") as tar:
        add_member(tar, "000.jpg", image_bytes(fmt="JPEG"))  # no 000.txt
        add_member(tar, "001.jpg", image_bytes(fmt="JPEG"))
        add_member(tar, "001.txt", b"caf\xe9 in latin-1")
        for key in range(2, 8):
            add_member(tar, f"{key:03d}.jpg", image_bytes(fmt="JPEG"))
            add_member(tar, f"{key:03d}.txt", f"good caption {key}".encode())
    args = DataArgs(dataset_name="webdataset", data_files=f"{tmp_path}/shard-{{0..1}}.tar", image_column="jpg",
                    caption_column="txt")
    kept, counts = clip_rows(clip_tiny, args)
    assert counts["no_caption"] == 1 and counts["bad_text"] == 1 and counts["bad_shard"] == 1
    assert kept == 4 + 6  # the cut tar's samples before the cut, and the good ones


def test_sixteen_bit_and_extreme_images(tmp_path):
    buffer = io.BytesIO()
    Image.fromarray(numpy.full((8, 8), 40000, dtype=numpy.uint16)).save(buffer, format="PNG")
    image, problem = decode_image(buffer.getvalue(), 10**6)
    assert problem == "converted" and image.getpixel((0, 0)) == (156, 156, 156)  # 40000 / 257, not clipped to 255
    long = io.BytesIO()
    Image.new("L", (400_000, 1)).save(long, format="PNG")  # 1.6 kB; resized to a 32 px short side: 12.8M pixels
    assert len(long.getvalue()) < 4000
    assert decode_image(long.getvalue(), 50_000_000, max_aspect_ratio=50) == (None, "too_large")
    image, problem = decode_image(long.getvalue(), 50_000_000, max_aspect_ratio=500_000)  # the user's choice
    assert image.size == (400_000, 1)
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    answers = []
    reader = threading.Thread(target=lambda: answers.append(decode_image(str(fifo), 10**6)), daemon=True)
    reader.start()
    reader.join(10)
    assert answers == [(None, "undecodable")]  # opening a FIFO would block for good
    assert decode_image(str(tmp_path), 10**6) == (None, "undecodable")


@pytest.fixture(scope="module")
def vlm_tiny():
    model, processor = load_vlm(VLMModelArgs())
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    return labeller, ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model))


def chat_counts(vlm_tiny, args):
    labeller, collator = vlm_tiny
    batches = list(build_chat_dataloader(args, labeller, collator, batch_size=64, ranks=Ranks()))
    counts = dict(zip(CHAT_COUNTED, sum(batch["data_counts"] for batch in batches).tolist()))
    return sum(batch["num_samples"] for batch in batches), counts


def test_malformed_llava_rows_are_counted_not_raised(tmp_path, vlm_tiny):
    """Each of these raised KeyError/TypeError in a DataLoader worker and crashed the recipe."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (32, 32), (0, 200, 0)).save(tmp_path / "images" / "green.png")
    Image.new("RGB", (32, 32), (0, 0, 200)).save(tmp_path / "outside.png")
    os.mkfifo(tmp_path / "images" / "fifo.png")
    question = {"from": "human", "value": "<image>\nWhat colour?"}
    good = {"image": "green.png", "conversations": [question, {"from": "gpt", "value": "green"}]}
    bad_rows = [
        {"image": "green.png", "conversations": [question, {"from": "gpt", "value": None}]},
        {"image": "green.png", "conversations": [question, {"from": "gpt", "value": 3}]},
        {"image": "green.png", "conversations": [question, {"from": "gpt"}]},
        {"image": "green.png", "conversations": None},
        {"image": 7, "conversations": good["conversations"]},
        {"image": [None], "conversations": good["conversations"]},
        {"image": "green.png", "conversations": [question, {"from": "robot", "value": "green"}]},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "user", "content": [{"text": "no type"}]}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"content": "no role"}]},
    ]
    outside = [dict(good, image="../outside.png"), dict(good, image=str(tmp_path / "outside.png"))]
    rows = [good, {"image": "green.png", "conversations": [{"from": "user", "value": "<image>\nWhat colour?"},
                                                            {"from": "assistant", "value": "green"}]},
            *bad_rows, *outside, dict(good, image="fifo.png"), good]
    lines = [json.dumps(row).encode() for row in rows]
    lines.insert(3, b'{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "x"}]}')
    lines.insert(4, b'{"not json')
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(lines))
    args = ChatDataArgs(dataset_name="json", data_files=str(tmp_path / "rows.jsonl"), dataset_weights=None,
                        image_folder=str(tmp_path / "images"), eval_dataset_name=None)
    kept, counts = chat_counts(vlm_tiny, args)
    assert kept == 3  # both speaker spellings, and the last row
    assert counts["bad_row"] == len(bad_rows) + 1 and counts["bad_text"] == 1
    assert counts["outside_folder"] == 2 and counts["undecodable"] == 1  # the FIFO, without blocking
    args.allow_images_outside_folder = True
    kept, counts = chat_counts(vlm_tiny, args)
    assert kept == 5 and counts["outside_folder"] == 0


def test_a_max_length_below_the_templates_own_overhead_is_refused_before_the_first_step(vlm_tiny):
    """--max_length 1 gave a ZeroDivisionError; 8 would skip every row as too_long."""
    labeller = vlm_tiny[0]
    for max_length in (1, 8):
        with pytest.raises(ValueError, match=rf"--max_length {max_length} is below what the chat template needs .*"
                                             r"\(14 tokens\): every row would be skipped as too_long"):
            check_template(labeller, "the tiny Llava", max_length)
    assert "assistant turns found by" in check_template(labeller, "the tiny Llava", 14)


def test_a_json_array_with_a_non_utf8_byte_keeps_its_other_rows(tmp_path, vlm_tiny):
    """LLaVA's files are one JSON array: one bad byte made pyarrow refuse the whole file ("Invalid octet")."""
    good = {"conversations": [{"from": "human", "value": "One?"}, {"from": "gpt", "value": "two"}]}
    text = json.dumps([good, {"conversations": [{"from": "human", "value": "BAD"}, {"from": "gpt", "value": "x"}]},
                       good]).encode().replace(b"BAD", b"\xff\xfe")
    (tmp_path / "llava.json").write_bytes(text)
    args = ChatDataArgs(dataset_name="json", data_files=str(tmp_path / "llava.json"), dataset_weights=None,
                        eval_dataset_name=None)
    kept, counts = chat_counts(vlm_tiny, args)
    assert kept == 2 and counts["bad_text"] == 1
