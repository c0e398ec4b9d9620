"""Data-parallel helpers: a real multi-process CPU accelerator, the engine line, data ranks.

`make_accelerator` exists because accelerate 1.15 silently runs the wrong thing on a CPU-only
machine when you only swap `--config_file` (one process, two unconnected processes, or DDP
instead of FSDP/ZeRO) and still exits 0 (shared/design/CPU_ENGINES.md). With several
processes and no GPU it creates the gloo process group first, so the same YAML files that
run on GPUs run for real on CPU. On GPUs and in a single process it is plain `Accelerator`.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs


def make_accelerator(*, timeout_s: int = 1800, **accelerator_kwargs) -> Accelerator:
    """`Accelerator(**accelerator_kwargs)` whose process group is real on multi-process CPU runs.

    `timeout_s` bounds every collective: a rank left waiting raises instead of hanging.
    """
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # 'cpu', not 'cpu:0': FSDP compares the compute device with its device_id.
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
        PartialState(cpu=True, **timeout.to_kwargs())  # gloo group with the launcher's rank/world size
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            # AcceleratorState enables FSDP only for GPU-like distributed types.
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        # DeepSpeed needs nothing more: AcceleratorState switches to DEEPSPEED by itself and
        # deepspeed.comm reuses the gloo group created above.
    handlers = list(accelerator_kwargs.pop("kwargs_handlers", [])) + [timeout]
    return Accelerator(kwargs_handlers=handlers, **accelerator_kwargs)


def engine_line(accelerator: Accelerator, prepared_model) -> str:
    """One line saying which engine really runs; tests assert it so a silent fallback fails."""
    backend = dist.get_backend() if dist.is_initialized() else "none"
    return (
        f"[engine] distributed_type={accelerator.distributed_type.value} num_processes={accelerator.num_processes} "
        f"backend={backend} world_size={dist.get_world_size() if dist.is_initialized() else 1} "
        f"model={type(prepared_model).__name__} mixed_precision={accelerator.mixed_precision}"
    )


def data_parallel_rank_and_world(accelerator: Accelerator) -> tuple[int, int]:
    """The rank and world size that data must be split over (see `mesh_data_rank_and_world`)."""
    mesh = accelerator.torch_device_mesh
    if mesh is None:
        return accelerator.process_index, accelerator.num_processes
    return mesh_data_rank_and_world(mesh)


def mesh_data_rank_and_world(mesh) -> tuple[int, int]:
    """Data rank/world on a device mesh: only data-parallel peers read different data.

    With dp_replicate x dp_shard (HSDP) the data rank is r_replicate * |dp_shard| + r_shard and
    the data world |dp_replicate| * |dp_shard| (FIELD_NOTES §1.3); tensor/context-parallel peers
    (any other mesh dimension) share a data rank and so read the same batch.
    """
    rank, world = 0, 1
    for name in ("dp_replicate", "dp_shard"):  # row-major: dp_replicate is the outer dimension
        if name in (mesh.mesh_dim_names or ()):
            size = mesh[name].size()
            rank, world = rank * size + mesh[name].get_local_rank(), world * size
    return rank, world


def all_ranks_true(flag: bool, device) -> bool:
    """True only if `flag` is true on every rank; the same answer everywhere (a collective)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of a small tensor over ranks (a collective; call it on every rank)."""
    if dist.is_initialized():
        values = values.clone()
        dist.all_reduce(values)
    return values


def reconcile_deepspeed_config(accelerator: Accelerator, **recipe_values):
    """Fill the DeepSpeed config's "auto" entries from the recipe; reject numbers that disagree.

    Without this an integer in the JSON silently wins at `prepare` (accelerate only warns), e.g.
    a different gradient_accumulation_steps than the loop and the loss normalisation assume.
    A no-op without DeepSpeed. Call it before `accelerator.prepare`.
    """
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    conflicts = []
    for key, value in recipe_values.items():
        if config.get(key, "auto") == "auto":
            config[key] = value
        elif config[key] != value:
            conflicts.append(f"{key}={config[key]} (the recipe uses {value})")
    if conflicts:
        raise ValueError(f"The DeepSpeed config disagrees with the recipe: {', '.join(conflicts)}. Write \"auto\" "
                         "for these keys in the DeepSpeed JSON (the recipe fills them), or pass matching recipe flags.")
