"""Resume with DataLoader workers, as on a GPU host (each rank reads with several workers), under FSDP2: one
rank SIGKILLed (no chance to save) ends the whole launch, leaves no worker behind, and `latest` then resumes
from the saved per-worker stream positions exactly as the straight run went on; a resume with another
worker count is refused before the first step; the FSDP2 checkpoint carrying a pickled payload is refused.
(DDP resumes with a worker in tests/test_long_runs.py's Slurm test, ZeRO-2 in tests/test_vlm_recipe.py.)"""

import os
import pickle
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from transformers import CLIPModel

from launch import (
    REPO,
    WITH_FAULTS,
    assert_same_curves,
    launch_command,
    losses,
    process_tree,
    run_engine,
    run_env,
    run_recipe,
)
from mmrecipes.checkpoint_validation import check_plain_data

pytestmark = pytest.mark.launch

STEPS = 8
# 2 ranks x 2 workers, each worker one of the 4 shards; 16 rows a step: checkpoint 4 is mid-epoch.
RUN = ["--max_steps", STEPS, "--logging_steps", 1, "--per_device_train_batch_size", 16, "--eval_split", "",
       "--zeroshot_dataset", "", "--save_steps", 4, "--dataloader_num_workers", 2]


def assert_same_weights(output_dir, reference_dir):
    reference = CLIPModel.from_pretrained(reference_dir).state_dict()
    for name, tensor in CLIPModel.from_pretrained(output_dir).state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run under FSDP2, saving checkpoint-4 on the way."""
    output_dir = tmp_path_factory.mktemp("fsdp2")
    result = run_engine("fsdp2.yaml", *RUN, "--output_dir", output_dir)
    assert result.returncode == 0, result.log[-3000:]
    return {"fsdp2.yaml": (result, output_dir)}


def test_sigkill_of_one_rank_ends_the_launch_and_latest_resumes_exactly(straight, tmp_path):
    """Under FSDP2 (a sharded engine): rank 1 SIGKILLs itself at step 6. The launch ends (torchrun
    stops the other rank), every process it started, DataLoader workers included, is gone, and the
    resume from checkpoint-4 gives the straight FSDP2 run's losses and weights."""
    fsdp2, fsdp2_dir = straight["fsdp2.yaml"]
    args = [*RUN, "--output_dir", tmp_path, "--resume_from_checkpoint", "latest"]
    job = subprocess.Popen(launch_command("fsdp2.yaml", *args, recipe=WITH_FAULTS), cwd=REPO,
                           env=run_env({"FAULT_SIGKILL_AT": "1:6"}), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    processes = set()
    while job.poll() is None:  # every process of the launch, workers included, while their parents live
        processes |= set(process_tree(job.pid))
        time.sleep(0.2)
    killed_log = job.communicate()[0].replace("\r", "\n")
    assert job.returncode != 0 and "SIGKILL" in killed_log, killed_log[-3000:]
    assert max(losses(killed_log)) < STEPS
    assert len(processes) >= 7, processes  # launcher, 2 ranks, their fork servers and workers
    deadline = time.monotonic() + 30
    while (alive := {pid for pid in processes if Path(f"/proc/{pid}").exists()}) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"outlived the launch: {alive}"

    # The checkpoint records the worker count (the sample order depends on it): another is refused.
    other = run_recipe(*args, "--dataloader_num_workers", 1)
    assert other.returncode != 0 and "dataloader_num_workers=2" in other.log and not losses(other.log)

    resumed = run_engine("fsdp2.yaml", *args)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert re.search(r"resumed from \S+checkpoint-4 at step 4", resumed.log)
    assert_same_curves(resumed.log, fsdp2.log, range(5, STEPS + 1), abs=1e-6)
    assert_same_weights(tmp_path, fsdp2_dir)


class Payload:
    """What a malicious checkpoint would carry: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_carrying_a_pickled_payload_is_refused(straight, tmp_path):
    """The straight run's own checkpoint (FSDP2: torch.distributed.checkpoint folders) passes; the same with
    a payload planted in the RNG state (a torch.save file) or as DCP's metadata is refused before anything is
    unpickled."""
    _, output_dir = straight["fsdp2.yaml"]
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(output_dir / "checkpoints" / "checkpoint-4", checkpoint)
    check_plain_data(checkpoint)
    marker = tmp_path / "payload-ran"
    torch.save({"step": 4, "random_state": Payload(marker)}, checkpoint / "random_states_0.pkl")
    with pytest.raises(ValueError, match=r"random_states_0.pkl: unpickling it would call posix.system"):
        check_plain_data(checkpoint)
    (checkpoint / "random_states_0.pkl").unlink()
    (checkpoint / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match=r"\.metadata: unpickling it would call posix.system"):
        check_plain_data(checkpoint)
    assert not marker.exists()
