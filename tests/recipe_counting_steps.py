"""A recipe run that records, at every optimizer step, how many host reads and compiled graphs it
took so far (tests/test_step_costs.py).

    STEP_COUNTS=counts.json python tests/recipe_counting_steps.py [recipe args]

Environment:
  STEP_COUNTS         where to write [{"step": N, "host_reads": R, "transformers_reads": T, "graphs": G},
                      ...], one entry per optimizer step, taken right after its StepGuard verdict;
                      transformers_reads: the reads made inside transformers' code (of R)
  STEP_COUNTS_RECIPE  the recipe to run (default recipes/clip_pretrain.py)
  STEP_COUNTS_READS   1: count host reads, the operations that need a tensor's value in Python
                      (`aten._local_scalar_dense`: item, float, int, bool; `nonzero` and the other
                      ops whose output size depends on values; tolist and numpy). On a GPU each is a
                      device synchronisation. A dispatch mode counts them, and torch.compile does not
                      compile under one: a run counts either reads or graphs (dynamo's counters).
  STEP_COUNTS_BACKEND the torch.compile backend of the recipe's --torch_compile (default: the
                      recipe's, inductor). aot_eager keeps dynamo's and AOTAutograd's guards, the
                      ones every device shares, without inductor's code generator, whose guards
                      depend on the device (on CPU: whether batch x length exceeds 4096).

Reads in DataLoader workers (collation, with --dataloader_num_workers >= 1) are not counted: they
happen on host data, in other processes.
"""

import atexit
import json
import os
import runpy
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from mmrecipes.step_guard import StepGuard

REPO = Path(__file__).resolve().parents[1]
VALUE_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.unique_consecutive.default,
               torch.ops.aten._unique2.default}
TORCH = str(Path(torch.__file__).parent)
steps = []
host_reads = transformers_reads = 0


def count_read():
    """One host read, attributed to the first caller outside torch and this file."""
    global host_reads, transformers_reads
    host_reads += 1
    frame = sys._getframe(2)
    while frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == __file__:
        frame = frame.f_back
    transformers_reads += f"{os.sep}transformers{os.sep}" in frame.f_code.co_filename


class CountHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in VALUE_READS:
            count_read()
        return func(*args, **(kwargs or {}))


def counting(method):  # tolist and numpy read a CPU tensor's memory without dispatching an op
    def read(self, *args, **kwargs):
        count_read()
        return method(self, *args, **kwargs)
    return read


should_call_optimizer = StepGuard.should_call_optimizer


def recording_should_call_optimizer(self, losses, grad_norm, step):
    result = should_call_optimizer(self, losses, grad_norm, step)
    steps.append({"step": step, "host_reads": host_reads, "transformers_reads": transformers_reads,
                  "graphs": counters["stats"]["unique_graphs"]})
    return result


def with_backend(compile_module, backend):
    def compile_with_backend(self, *args, **kwargs):
        return compile_module(self, *args, **kwargs, backend=backend)
    return compile_with_backend


def write_counts():
    Path(os.environ["STEP_COUNTS"]).write_text(json.dumps(steps))


if __name__ == "__main__":
    StepGuard.should_call_optimizer = recording_should_call_optimizer
    if os.environ.get("STEP_COUNTS_BACKEND"):
        torch.nn.Module.compile = with_backend(torch.nn.Module.compile, os.environ["STEP_COUNTS_BACKEND"])
    atexit.register(write_counts)
    recipe = os.environ.get("STEP_COUNTS_RECIPE", str(REPO / "recipes" / "clip_pretrain.py"))
    sys.argv[0] = recipe
    if os.environ.get("STEP_COUNTS_READS") == "1":
        torch.Tensor.tolist, torch.Tensor.numpy = counting(torch.Tensor.tolist), counting(torch.Tensor.numpy)
        with CountHostReads():
            runpy.run_path(recipe, run_name="__main__")
    else:
        runpy.run_path(recipe, run_name="__main__")
