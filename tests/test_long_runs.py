"""Runs that survive what clusters do to them (mmrecipes.checkpointing, mmrecipes.step_guard):
a kill inside a save, a preemption signal on one rank, a non-finite batch on one rank."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import CLIPModel

from gloo import free_port
from launch import (
    REPO,
    WITH_FAULTS,
    accelerate_launch,
    assert_same_curves,
    launch_command,
    losses,
    process_tree,
    run_command,
    run_engine,
    run_env,
    run_recipe,
    run_script,
)
from mmrecipes.step_guard import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.launch

# One command line for the first start and every restart (what a requeued Slurm job runs).
RUN = ["--logging_steps", 1, "--per_device_train_batch_size", 16, "--eval_split", "",
       "--resume_from_checkpoint", "latest"]


def fingerprints(directory: Path) -> dict[tuple[int, int], str]:
    """(rank, step) -> fingerprint of that rank's local weights after the step (FAULT_WEIGHTS_LOG)."""
    return {(int(path.stem.rsplit("-", 1)[1]), int(line.split(" ", 1)[0])): line.split(" ", 1)[1]
            for path in directory.glob("weights-rank-*.txt") for line in path.read_text().splitlines()}


def kill_process_tree(pid: int):
    """SIGKILL a process and every descendant (the launcher starts its workers in their own sessions)."""
    for member in process_tree(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_kill_inside_save_resumes_from_previous_complete_checkpoint(tmp_path):
    """SIGKILL every process while checkpoint-4 is being written: `latest` then skips the partial
    directory (removed at start), resumes from checkpoint-2 and repeats steps 3-4 exactly."""
    args = [*RUN, "--max_steps", 8, "--save_steps", 2, "--save_total_limit", 2, "--output_dir", tmp_path]
    job = subprocess.Popen(launch_command("ddp.yaml", *args, recipe=WITH_FAULTS), cwd=REPO,
                           env=run_env({"FAULT_PAUSE_IN_SAVE": "4"}), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (tmp_path / "paused-in-save-0").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_process_tree(job.pid)
    killed_log = job.communicate()[0].replace("\r", "\n")
    assert (tmp_path / "paused-in-save-0").exists(), killed_log[-3000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [".partial-checkpoint-4", "checkpoint-2"]

    resumed = run_engine("ddp.yaml", *args)  # the launcher's part (the kill) is over: the resume itself forked
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert "a checkpoint save that did not finish" in resumed.log
    assert re.search(r"resumed from \S+checkpoint-2 at step 2", resumed.log)
    assert_same_curves(resumed.log, killed_log, range(3, 9), abs=1e-6)  # steps 3 and 4 ran before the kill
    # --save_total_limit 2: of checkpoints 2, 4 and 6 the newest two remain.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-4", "checkpoint-6"]


def test_sigterm_on_one_rank_saves_exits_and_resumes_exactly(tmp_path):
    straight = run_engine("ddp.yaml", *RUN, "--max_steps", 6, "--output_dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.log[-3000:]
    assert "no complete checkpoint under" in straight.log and "starting from step 0" in straight.log

    args = [*RUN, "--max_steps", 6, "--output_dir", tmp_path / "preempted"]
    preempted = accelerate_launch("ddp.yaml", *args, recipe=WITH_FAULTS, env={"FAULT_SIGTERM_AT": "1:3"})
    # Only rank 1 got the signal; both ranks stop after step 3 with the documented exit code.
    assert preempted.returncode != 0
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in preempted.log, preempted.log[-3000:]
    assert "preemption signal: saved" in preempted.log
    assert sorted(losses(preempted.log)) == [1, 2, 3]
    assert (tmp_path / "preempted" / "checkpoints" / "checkpoint-3" / "checkpoint.json").is_file()

    # Fewer data ranks than the checkpoint's: refused before any step.
    fewer = run_recipe(*args)
    assert fewer.returncode != 0 and "data_ranks=2" in fewer.log and not losses(fewer.log)

    resumed = run_engine("ddp.yaml", *args)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert_same_curves(resumed.log, straight.log, [4, 5, 6], abs=1e-6)
    reference = CLIPModel.from_pretrained(tmp_path / "straight").state_dict()
    for name, tensor in CLIPModel.from_pretrained(tmp_path / "preempted").state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


# The three ways a step is skipped: the host reads the verdict (DDP, torch's AdamW), a fused AdamW skips on the
# device (found_inf, here on sharded FSDP2 parameters), DeepSpeed skips inside its engine (ZeRO-3).
@pytest.mark.parametrize("config, fused", [("ddp.yaml", False), ("fsdp2.yaml", True), ("zero3.yaml", False)])
def test_nonfinite_batch_on_one_rank_is_skipped_everywhere(tmp_path, config, fused):
    """NaN pixels on rank 1 in step 2: no rank's weights change in step 2, and training goes on.
    Fused AdamW skips on the device (StepGuard hands it found_inf); DeepSpeed skips by itself."""
    result = run_engine(config, *RUN, "--max_steps", 4, "--warmup_steps", 0, "--output_dir", tmp_path,
                               "--fused_adamw", str(fused).lower(), recipe=WITH_FAULTS,
                               env={"FAULT_NAN_AT": "1:2", "FAULT_WEIGHTS_LOG": str(tmp_path / "weights")})
    assert result.returncode == 0, result.log[-3000:]
    assert "step 2: loss or gradient norm not finite; step skipped (1 in a row, 1 in all)" in result.log
    weights = fingerprints(tmp_path / "weights")
    for rank in (0, 1):
        assert weights[rank, 2] == weights[rank, 1], f"rank {rank} changed its weights in the skipped step"
        assert weights[rank, 1] != weights[rank, 0] and weights[rank, 3] != weights[rank, 2]
    assert sorted(losses(result.log)) == [1, 3, 4]  # step 2 logs loss nan: no step was applied
    assert "skipped_steps 1" in result.log


def test_nonfinite_steps_in_a_row_stop_the_run(tmp_path):
    result = run_script(WITH_FAULTS, "--logging_steps", 1, "--per_device_train_batch_size", 16, "--eval_split", "",
                        "--max_steps", 8, "--save_steps", 2, "--max_skipped_steps", 2, "--output_dir", tmp_path,
                        env={"FAULT_NAN_AT": "0:3-8"})
    assert result.returncode != 0
    assert ("step 5: 3 optimizer steps in a row had a non-finite loss or gradient norm (--max_skipped_steps 2). "
            f"The last complete checkpoint is {tmp_path}/checkpoints/checkpoint-4") in result.log


FAKE_SRUN = """#!/bin/bash
# srun on one node: runs the task and passes SIGTERM on to it, as srun does.
"$@" &
task=$!
trap 'kill -TERM "$task"' TERM
while kill -0 "$task" 2>/dev/null; do wait "$task"; done
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1" in
    show) echo localhost ;;
    requeue) echo "requeue $2" >> "$REQUEUE_LOG" ;;
esac
"""


def test_slurm_template_checkpoints_and_requeues_on_signal(tmp_path):
    """accelerate_configs/slurm_multi_node.sh on one 'node' with 2 processes, srun and scontrol
    stood in for: USR1 to the batch shell (what --signal=B:USR1@120 sends) makes the run save and
    exit, the job requeues itself, and the same script then resumes and finishes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # `accelerate` from this interpreter's environment, as in an activated one
    env = run_env({"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                   "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
                   "SLURM_JOB_ID": "4242", "GPUS_PER_NODE": "2",
                   "MAIN_PROCESS_PORT": str(free_port()), "REQUEUE_LOG": str(tmp_path / "requeued")})
    # One DataLoader worker: the launcher passes SIGTERM to each rank's whole process group, which
    # the worker and its fork server must survive until the step boundary.
    args = ["--max_steps", 24, "--logging_steps", 1, "--per_device_train_batch_size", 16, "--eval_split", "",
            "--dataloader_num_workers", 1, "--report_to", "none", "--ddp_timeout", 120,
            "--output_dir", tmp_path / "run"]
    command = ["bash", str(REPO / "accelerate_configs" / "slurm_multi_node.sh"), *map(str, args)]

    with open(tmp_path / "first.log", "w") as log:
        job = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not re.search(r"^step 2/", (tmp_path / "first.log").read_text().replace("\r", "\n"), re.M):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)
        job.wait(timeout=300)
    first = (tmp_path / "first.log").read_text().replace("\r", "\n")
    assert "no complete checkpoint under" in first
    assert "preemption signal: saved" in first, first[-3000:]
    assert (tmp_path / "requeued").read_text() == "requeue 4242\n"
    stopped_at = max(losses(first))
    assert 2 <= stopped_at < 24

    again = run_command(command, timeout=300, environment=env)
    log = again.log
    assert again.returncode == 0, log[-3000:]
    assert f"at step {stopped_at}" in log and sorted(losses(log)) == list(range(stopped_at + 1, 25))


def test_resume_continues_from_saved_data_position_across_an_epoch(tmp_path):
    """Checkpoint 70 (64 rows a step: into the second epoch of 4096 rows) holds the stream position;
    the resume loads it instead of re-reading 70 steps of data, and steps 71-80 repeat exactly."""
    args = ["--max_steps", 80, "--logging_steps", 1, "--eval_split", "", "--output_dir", tmp_path]
    straight = run_recipe(*args, "--save_steps", 70)
    assert straight.returncode == 0, straight.log[-3000:]
    assert json.loads((tmp_path / "checkpoints" / "checkpoint-70" / "data_state_0.json").read_text())["epoch"] == 1
    resumed = run_recipe(*args, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert "at step 70, the data at its saved position in epoch 1" in resumed.log
    assert_same_curves(resumed.log, straight.log, range(71, 81), abs=1e-6)
