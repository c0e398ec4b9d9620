"""A recipe run with the faults long runs meet, injected on purpose (tests/test_long_runs.py).

    FAULT_SIGTERM_AT=1:3 accelerate launch --config_file ... tests/recipe_with_faults.py [recipe args]

Environment (RANK:STEP means on global rank RANK during optimizer step STEP of this run):
  FAULT_RECIPE         the recipe to run (default recipes/clip_pretrain.py)
  FAULT_SIGTERM_AT     RANK:STEP  the rank sends itself SIGTERM before the step boundary
  FAULT_SIGKILL_AT     RANK:STEP  the rank SIGKILLs itself there (no chance to save or clean up)
  FAULT_NAN_AT         RANK:STEP[-LAST]  the rank's pixel values are NaN in those steps
  FAULT_PAUSE_IN_SAVE  STEP  every rank stops inside the save of checkpoint STEP, after its
                       files and before the completeness marker, and writes
                       <output_dir>/paused-in-save-RANK
  FAULT_WEIGHTS_LOG    DIR: every rank appends a fingerprint of its local weights after each
                       step to DIR/weights-rank-RANK.txt (a file per rank: lines two ranks
                       print to one pipe can interleave with the other's log lines)
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

import mmrecipes.images
from mmrecipes.step_guard import StepGuard

REPO = Path(__file__).resolve().parents[1]
RANK = int(os.environ.get("RANK", "0"))
steps_done = 0  # optimizer steps this run has reached the step boundary of
prepared = {}


def at(variable):
    """The steps of this rank a RANK:STEP[-LAST] variable names."""
    if not os.environ.get(variable):
        return range(0)
    rank, steps = os.environ[variable].split(":")
    first, _, last = steps.partition("-")
    return range(int(first), int(last or first) + 1) if int(rank) == RANK else range(0)


def local_weights_fingerprint(model):
    """Sum and sum of squares of this rank's own copy or shard of every parameter."""
    total = torch.zeros(2, dtype=torch.float64)
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):  # ZeRO-3 partition, less its uninitialised padding
            size = param.ds_tensor.numel()
            local = param.ds_tensor.flatten()[:max(0, min(size, param.ds_numel - RANK * size))]
        else:
            local = param.to_local() if hasattr(param, "to_local") else param.data  # FSDP2 shard, or the tensor
        local = local.detach().double()
        total += torch.stack([local.sum(), local.square().sum()])
    return " ".join(f"{value:.17g}" for value in total.tolist())


should_call_optimizer = StepGuard.should_call_optimizer


def faulty_should_call_optimizer(self, losses, grad_norm, step):
    global steps_done
    if step in at("FAULT_SIGTERM_AT"):
        os.kill(os.getpid(), signal.SIGTERM)
    if step in at("FAULT_SIGKILL_AT"):
        os.kill(os.getpid(), signal.SIGKILL)
    steps_done += 1
    return should_call_optimizer(self, losses, grad_norm, step)


def with_nan_pixels(model_inputs):
    def faulty_model_inputs(batch, device):
        inputs = model_inputs(batch, device)
        if steps_done + 1 in at("FAULT_NAN_AT"):
            inputs["pixel_values"] = torch.full_like(inputs["pixel_values"], float("nan"))
        return inputs
    return faulty_model_inputs


def log_weights():
    directory = Path(os.environ["FAULT_WEIGHTS_LOG"])
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"weights-rank-{RANK}.txt", "a") as log:
        log.write(f"{steps_done} {local_weights_fingerprint(prepared['model'])}\n")


def logging_zero_grad(zero_grad):
    def zero_grad_and_log(self, *args, **kwargs):
        result = zero_grad(self, *args, **kwargs)
        log_weights()
        return result
    return zero_grad_and_log


prepare = accelerate.Accelerator.prepare


def remembering_prepare(self, *objects, **kwargs):
    result = prepare(self, *objects, **kwargs)
    prepared["model"] = result[0]
    log_weights()
    return result


save_state = accelerate.Accelerator.save_state


def pausing_save_state(self, output_dir=None, **kwargs):
    result = save_state(self, output_dir, **kwargs)
    pause_at = os.environ.get("FAULT_PAUSE_IN_SAVE")
    if pause_at and str(output_dir).endswith(f"checkpoint-{pause_at}"):
        Path(output_dir).parents[1].joinpath(f"paused-in-save-{RANK}").touch()
        time.sleep(3600)  # the test kills the job here
    return result


if __name__ == "__main__":
    StepGuard.should_call_optimizer = faulty_should_call_optimizer
    mmrecipes.images.to_device = with_nan_pixels(mmrecipes.images.to_device)
    accelerate.Accelerator.save_state = pausing_save_state
    if os.environ.get("FAULT_WEIGHTS_LOG"):
        accelerate.Accelerator.prepare = remembering_prepare
        for optimizer_class in (AcceleratedOptimizer, DeepSpeedOptimizerWrapper):
            optimizer_class.zero_grad = logging_zero_grad(optimizer_class.zero_grad)
    recipe = os.environ.get("FAULT_RECIPE", str(REPO / "recipes" / "clip_pretrain.py"))
    sys.argv[0] = recipe
    runpy.run_path(recipe, run_name="__main__")
