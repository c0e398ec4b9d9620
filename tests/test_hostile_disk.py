"""Hostile inputs, round three, in process: links that would smuggle a pickle past the checks, saves that fail
on a full or read-only disk, stray files and linked checkpoints beside the checkpoints, the output directory's lock
raced by two processes."""

import errno
import json
import multiprocessing
import os
import pickle
import shutil
import socket
import time

import pytest

from helpers import Payload, make_checkpointer, refit_manifest
from mmrecipes.checkpoint_validation import UnsafeCheckpoint
from mmrecipes.checkpointing import MARKER, CheckpointSaveFailed, checkpoint_weights
from mmrecipes.output_dir import LOCK_NAME, REFRESH_S, OutputDirBusy, OutputDirLock


@pytest.mark.parametrize("linked", ["pytorch_model_fsdp_0", "pytorch_model", "optimizer.bin"])
def test_a_link_inside_a_checkpoint_is_refused_for_resume_and_init(run, tmp_path, linked):  # noqa: F811
    """FSDP2's shard folder, DeepSpeed's ZeRO folder or a file, linked to a prepared payload, with a manifest
    refitted to the files a listing finds (it does not enter a linked folder): before, the manifest and the
    pickle check passed and the load unpickled `.metadata` behind the link."""
    checkpoint, marker = run.checkpoints.root / "checkpoint-4", tmp_path / "payload-ran"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=0))
    (outside / "optimizer.bin").write_bytes(pickle.dumps(Payload(marker), protocol=0))
    target = outside / "optimizer.bin" if linked == "optimizer.bin" else outside
    if linked == "optimizer.bin":
        (checkpoint / linked).unlink()
    (checkpoint / linked).symlink_to(target)
    refit_manifest(checkpoint)
    problems = run.checkpoints.problems(checkpoint)
    assert problems == [f"{linked} is a symbolic link (to {target}): a checkpoint these recipes write holds none, "
                        "and a load would read what it points to"]
    with pytest.raises(UnsafeCheckpoint, match="symbolic link"):
        run.checkpoints.find(str(checkpoint))
    assert run.checkpoints.find("latest").name == "checkpoint-2"  # passed over, with the reason
    with pytest.raises(UnsafeCheckpoint, match=f"cannot seed a run: {linked} is a symbolic link"):
        checkpoint_weights(checkpoint)  # --init_from_checkpoint
    assert not marker.exists()


def test_a_checkpoint_moved_away_and_linked_back_resumes(run, tmp_path):  # noqa: F811
    """The checkpoint folder itself may be a link (old checkpoints moved to other storage)."""
    moved = tmp_path / "storage" / "checkpoint-4"
    moved.parent.mkdir()
    shutil.move(run.checkpoints.root / "checkpoint-4", moved)
    (run.checkpoints.root / "checkpoint-4").symlink_to(moved, target_is_directory=True)
    assert run.checkpoints.problems(run.checkpoints.root / "checkpoint-4") == []
    assert run.checkpoints.open_run("latest", run.loader)[0] == 4


def _a_bug(folder):
    raise RuntimeError("a bug")


@pytest.mark.parametrize("failure, said", [
    (OSError(errno.ENOSPC, "No space left on device", "optimizer.bin"), "No space left on device (optimizer.bin)"),
    (OSError(errno.EROFS, "Read-only file system", "model.safetensors"), "Read-only file system (model.safetensors)"),
    (OSError(errno.EIO, "Input/output error", "random_states_0.pkl"), "Input/output error (random_states_0.pkl)"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
     "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
])
def test_a_save_that_fails_ends_with_one_line_and_the_next_run_resumes(run, saved, monkeypatch, failure,  # noqa: F811
                                                                        said):
    """What torch and the OS raise when the disk fills up, turns read-only or fails mid-save. Before, the raw error
    ended the run (`basic_ios::clear: iostream error`), and its partial folder and a lock without an owner stopped
    the next run."""
    checkpoints = run.checkpoints
    checkpoints.open_run("latest", run.loader)
    save_state = checkpoints.accelerator.save_state

    def full_disk(folder):
        save_state(folder)  # part of the files written, then the failure
        raise failure

    monkeypatch.setattr(checkpoints.accelerator, "save_state", full_disk)
    with pytest.raises(CheckpointSaveFailed) as raised:
        checkpoints.save(6, 0)
    message = str(raised.value)
    assert message == (f"saving checkpoint-6 failed: {said}; the last complete checkpoint is "
                       f"{checkpoints.root / 'checkpoint-4'}. Free space or make {checkpoints.root} writable, then "
                       "run the same command with --resume_from_checkpoint latest")
    assert sorted(path.name for path in checkpoints.root.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    monkeypatch.setattr(checkpoints.accelerator, "save_state", _a_bug)
    with pytest.raises(RuntimeError, match="^a bug$"):  # anything else is not dressed up as a failed write
        checkpoints.save(6, 0)
    monkeypatch.undo()
    (checkpoints.root / ".partial-checkpoint-6").mkdir()  # what a save killed mid-write leaves
    checkpoints.lock.release()
    (checkpoints.lock.path).write_text("")  # and a lock its run died writing (a full disk)
    old = time.time() - REFRESH_S - 1
    os.utime(checkpoints.lock.path, (old, old))
    rerun = make_checkpointer(checkpoints.root.parent, saved.model, saved.tokenizer, saved.image_processor)
    assert rerun.checkpoints.open_run("latest", rerun.loader)[0] == 4
    assert not (checkpoints.root / ".partial-checkpoint-6").exists()
    rerun.checkpoints.lock.release()


def test_rotation_and_the_start_tolerate_stray_files_and_linked_checkpoints(run, tmp_path):  # noqa: F811
    """A user's notes named `.partial-...` (NotADirectoryError at every start before), a link to a checkpoint moved
    to other storage (rotation died on `rmtree` of a link), and a file named like a checkpoint are left alone."""
    root = run.checkpoints.root
    (root / ".partial-notes.txt").write_text("mine")
    moved = tmp_path / "storage" / "checkpoint-1"
    shutil.copytree(root / "checkpoint-2", moved)
    (root / "checkpoint-1").symlink_to(moved, target_is_directory=True)
    (root / ".partial-checkpoint-9").symlink_to(moved, target_is_directory=True)
    run.checkpoints.total_limit = 1
    assert run.checkpoints.open_run("latest", run.loader)[0] == 4
    run.checkpoints.save(6, 0)
    assert sorted(path.name for path in root.iterdir()) == [".partial-checkpoint-9", ".partial-notes.txt",
                                                            "checkpoint-1", "checkpoint-6"]
    assert (moved / MARKER).is_file() and (root / ".partial-notes.txt").read_text() == "mine"
    run.checkpoints.lock.release()


def _take_lock(output_dir, barrier, taken):
    barrier.wait()
    try:
        OutputDirLock(output_dir).acquire()
        taken.put(os.getpid())
    except OutputDirBusy:
        taken.put(None)
    barrier.wait()  # both have tried while the winner still holds it
    os._exit(0)  # the winner's lock stays: the parent lays a stale one anew


def test_two_runs_racing_for_a_stale_lock_never_both_own_it(tmp_path):
    """60 races of two processes over a lock whose owner is gone. Before, 12-18 in 100 ended with two owners (both
    read the stale lock, one replaced it, and the other removed that new lock as the stale one): that code passes 60
    races with a chance under 1e-3 (0.88^60 = 5e-4)."""
    context = multiprocessing.get_context("fork")
    owners = []
    for _ in range(60):
        (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7,
                                                      "start_time": "1", "slurm_job_id": None}))
        barrier, taken = context.Barrier(2), context.SimpleQueue()  # written at once: the racers leave by _exit
        racers = [context.Process(target=_take_lock, args=(tmp_path, barrier, taken)) for _ in range(2)]
        for racer in racers:
            racer.start()
        owners.append(sum(taken.get() is not None for _ in racers))
        for racer in racers:
            racer.join(timeout=30)
    assert owners.count(1) == 60, f"{owners.count(2)} races with two owners, {owners.count(0)} with none"
