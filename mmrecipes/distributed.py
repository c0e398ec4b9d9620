"""Data-parallel helpers: a real multi-process CPU accelerator, the engine line, data ranks
(`Ranks`).

`make_accelerator` exists because accelerate 1.15 silently runs the wrong thing on a CPU-only
machine when you only swap `--config_file` (one process, two unconnected processes, or DDP
instead of FSDP/ZeRO) and still exits 0 (docs/engines.md, "CPU runs"). With several
processes and no GPU it creates the gloo process group first, so the same YAML files that
run on GPUs run for real on CPU. On GPUs and in a single process it is plain `Accelerator`.
"""

import os
import zlib
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs


def make_accelerator(*, timeout_s: int = 1800, **accelerator_kwargs) -> Accelerator:
    """`Accelerator(**accelerator_kwargs)` whose process group is real on multi-process CPU runs.

    `timeout_s` bounds every collective: a rank left waiting raises instead of hanging.
    """
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if config_file != "none" and config_file.endswith(".json") and not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"The accelerate config's deepspeed_config_file {config_file} does not exist as seen from {os.getcwd()}: "
            "accelerate reads it relative to the directory you launch from. Give it as an absolute path, or write the "
            "settings inline in the YAML (zero_stage: ..., as accelerate_configs/zero3.yaml does).")
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # 'cpu', not 'cpu:0': FSDP compares the compute device with its device_id.
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
        # gloo group with the launcher's rank/world size
        PartialState(cpu=True, **timeout.to_kwargs())
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
    mesh = accelerator.torch_device_mesh  # HSDP, TP, CP: which dimensions, of which sizes
    mesh_part = (" mesh=" + ",".join(f"{name}:{size}" for name, size in zip(mesh.mesh_dim_names, mesh.mesh.shape))
                 if mesh is not None else "")
    return (
        f"[engine] distributed_type={accelerator.distributed_type.value} num_processes={accelerator.num_processes} "
        f"backend={backend} world_size={dist.get_world_size() if dist.is_initialized() else 1}{mesh_part} "
        f"model={type(prepared_model).__name__} mixed_precision={accelerator.mixed_precision}"
    )


def fsdp_block_classes(model) -> list[str]:
    """The block classes FSDP2 wraps: accelerate reads them from `model._no_split_modules` when the
    config names none (accelerate_configs/fsdp2.yaml), so one file serves every model.

    transformers' list, less classes absent from this model (Llava's list names CLIP's text
    embeddings), less any block holding the input embedding: accelerate shards that one on its
    own, and a second `fully_shard` of it inside a wrapped block fails.
    """
    embedding = model.get_input_embeddings()
    present, holding_embedding = set(), set()
    for module in model.modules():
        name = type(module).__name__
        present.add(name)
        if any(sub is embedding for sub in module.modules()):
            holding_embedding.add(name)
    return sorted(name for name in model._no_split_modules if name in present and name not in holding_embedding)


def data_parallel_rank_and_world(accelerator: Accelerator, sequence_parallel_size: int = 1) -> tuple[int, int]:
    """The rank and world size that data must be split over (see `mesh_data_rank_and_world`).
    Sequence-parallel groups of `sequence_parallel_size` consecutive ranks read the same rows: their
    data rank is the group's index."""
    mesh = accelerator.torch_device_mesh
    if mesh is None:
        return accelerator.process_index // sequence_parallel_size, accelerator.num_processes // sequence_parallel_size
    if sequence_parallel_size > 1:
        raise ValueError("--sequence_parallel_size with a device mesh (HSDP, accelerate's parallelism_config) is not "
                         "supported: drop the parallelism_config from the accelerate config, or the flag")
    return mesh_data_rank_and_world(mesh)


@dataclass(frozen=True)
class Ranks:
    """Which rows each rank reads and how its sums count: torchtitan's ParallelDims for these
    recipes (`of`, after `Accelerator()`; built by hand, one process's share of a data world).
    `split`: the split of each training sequence over a group of `split_size` consecutive ranks
    (`vlm.sequence_parallel.SequenceParallel`), or None. A group's ranks read the same rows (their
    data rank is the group's index; on an HSDP mesh, `mesh_data_rank_and_world`), and only the first
    of the `replicas` ranks that read the same rows counts them (`counts_reads`, a checkpoint's data
    position too); evaluation reads whole sequences, so there every rank reads rows of its own
    (`reads(evaluation= True)`). `sum_over_data`: a sum over the data-parallel ranks, the rows each
    group read counted once."""

    data_rank: int = 0
    data_world: int = 1
    split: object = None
    replicas: int = 1
    counts_reads: bool = True
    eval_rank: int | None = None  # None: data_rank
    eval_world: int | None = None
    device: object = "cpu"  # where its collectives run

    @classmethod
    def of(cls, accelerator: Accelerator, split=None) -> "Ranks":
        size = split.size if split is not None else 1
        data_rank, data_world = data_parallel_rank_and_world(accelerator, size)
        replicas = accelerator.num_processes // data_world
        grouped = size > 1
        return cls(data_rank=data_rank, data_world=data_world, split=split, replicas=replicas,
                   counts_reads=accelerator.process_index % replicas == 0,
                   eval_rank=accelerator.process_index if grouped else None,
                   eval_world=accelerator.num_processes if grouped else None, device=accelerator.device)

    @property
    def split_size(self) -> int:
        return self.split.size if self.split is not None else 1

    def reads(self, evaluation: bool = False) -> dict:
        """`data_rank` and `data_world` of the training rows, or of the held-out ones."""
        if evaluation and self.eval_world is not None:
            return {"data_rank": self.eval_rank, "data_world": self.eval_world}
        return {"data_rank": self.data_rank, "data_world": self.data_world}

    def share(self, total: int) -> int:
        """This rank's share of `total` held-out rows (the last ranks' may run short)."""
        return -(-total // self.reads(evaluation=True)["data_world"])

    def teams(self, size: int) -> "Ranks":
        """These ranks in teams of `size` consecutive data ranks that read the same rows, as one
        batch (GRPO's prompt reader: a team's completions are whole groups): a team's index is its
        data rank, and only its first member counts what it reads."""
        return replace(self, data_rank=self.data_rank // size, data_world=self.data_world // size,
                       replicas=self.replicas * size, counts_reads=self.counts_reads and self.data_rank % size == 0)

    def loss_scale(self, local: torch.Tensor, accumulation: int) -> torch.Tensor:
        """`token_loss_scale` of a window whose loss sums over `local` items on this rank (target
        tokens, pairs, completions): one all-reduce, each group's items once."""
        return token_loss_scale(self.sum_over_data(local.to(self.device)), accumulation, self.data_world)

    def sum_over_data(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over every rank, the rows each group read counted once (its ranks hold
        the same)."""
        return sum_over_ranks(values) / self.replicas

    def describe(self) -> str:
        line = f"data: {self.data_world} data-parallel rank{'s' * (self.data_world > 1)}"
        return line + (f"; {self.split.describe()}" if self.split is not None else "")


def token_loss_scale(window_tokens: torch.Tensor, accumulation_steps: int, data_world: int) -> torch.Tensor:
    """Multiplier for a micro-batch's summed CE so that the engine's gradient is the exact
    token mean over the window: GA cancels `accelerator.backward`'s (or DeepSpeed's) division by
    the accumulation steps, W cancels the gradient averaging over data ranks, N normalises.

    `window_tokens`: N, the window's target tokens summed over data ranks (count each data replica
    once: tensor-parallel peers hold the same batch). A window with none gives 0 (no update).
    """
    return accumulation_steps * data_world / window_tokens.clamp_min(1)


def mesh_data_rank_and_world(mesh) -> tuple[int, int]:
    """Data rank/world on a device mesh: only data-parallel peers read different data.

    With dp_replicate x dp_shard (HSDP) the data rank is r_replicate * |dp_shard| + r_shard and
    the data world |dp_replicate| * |dp_shard|; tensor/context-parallel peers
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


def max_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of a small tensor over ranks (a collective; call it on every rank)."""
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


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


class DivergenceGuard:
    """Debug mode: before any module runs, every rank agrees on which module it is about to run.

    Ranks that run different module sequences (a vision tower on some ranks only) hang or abort in
    the engine's collectives; under FSDP2 and ZeRO-3 that happens *inside* the forward, at a
    parameter all-gather, with at best a bare size-mismatch error. With the guard, a pre-forward
    hook on every module (run before the engine's own hooks) all-gathers a hash of the module's
    name, and on a mismatch every rank raises an error naming each rank's module. It uses its own
    gloo group with its own timeout: a rank that stops calling modules altogether is reported
    after `timeout_s` instead of hanging. One small collective per module call: off by default
    (`--debug_divergence`, or the environment variable MMRECIPES_DEBUG_DIVERGENCE=1).
    """

    ENV = "MMRECIPES_DEBUG_DIVERGENCE"

    def __init__(self, module: torch.nn.Module, timeout_s: int = 60):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s, self.calls = timeout_s, 0
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.names = {zlib.crc32(name.encode()): name or "<root>" for name, _ in module.named_modules()}
        self.handles = [submodule.register_forward_pre_hook(partial(self.check, name or "<root>"), prepend=True)
                        for name, submodule in module.named_modules()]

    @classmethod
    def requested(cls, flag: bool) -> bool:
        return (flag or os.environ.get(cls.ENV, "0") not in ("", "0", "false")) and dist.is_initialized()

    @classmethod
    def if_requested(cls, flag: bool, accelerator, prepared_model, *, compiled: bool, timeout_s: int):
        """The guard on the prepared model's modules (after `prepare`: its hooks run before the
        engine's), said in the log, where it is asked for; else None. Compiled blocks skip Python's
        module calls: refused."""
        if not cls.requested(flag):
            return None
        if compiled:
            raise ValueError("--debug_divergence checks every module call from Python, which compiled blocks skip: "
                             "drop --torch_compile while you debug")
        accelerator.print("divergence guard on: the ranks compare every module call")
        return cls(accelerator.unwrap_model(prepared_model), timeout_s=timeout_s)

    def check(self, name, module, args):
        self.calls += 1
        mine = torch.tensor([zlib.crc32(name.encode())], dtype=torch.long)
        everyone = [torch.zeros_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(everyone, mine, group=self.group)
        except RuntimeError as error:
            raise RuntimeError(
                f"divergence guard: rank {self.rank} waited {self.timeout_s} s to run '{name}' (module call "
                f"{self.calls}) and another rank never ran a module: it left the forward early or runs fewer "
                "modules (a branch skipped on some ranks?)") from error
        if any(int(other) != int(mine) for other in everyone):
            calls = ", ".join(f"rank {rank} is about to run '{self.names.get(int(h), '?')}'"
                              for rank, h in enumerate(everyone))
            raise RuntimeError(
                f"divergence guard: ranks run different modules at module call {self.calls}: {calls}. Every rank must "
                "call the same modules in the same order, or the engine's collectives hang or abort (for a VLM: give "
                "text-only batches the dummy image, mmrecipes.vlm.model.step).")

    def remove(self):
        for handle in self.handles:
            handle.remove()


def batches_in_step(batches, filler, device):
    """(batch, real) for this rank's `batches`, then (`filler`, False) until every rank has run out.

    Ranks may hold different numbers of eval batches, but FSDP and ZeRO-3 run collectives inside
    the forward, so every rank must run it equally often: a rank that has run out forwards
    `filler` (any valid batch) and discards the result until all are done.
    """
    batches = iter(batches)
    while not all_ranks_true((batch := next(batches, None)) is None, device):
        yield (filler, False) if batch is None else (batch, True)
