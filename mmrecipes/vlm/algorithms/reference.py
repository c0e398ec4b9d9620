"""The reference model of DPO and GRPO's KL: a frozen copy of the starting weights sharded like the
policy, or the policy with its LoRA adapters disabled; its log-probabilities never build a graph,
and DPO's can be computed once in a first pass (`Reference.precompute`)."""

import contextlib
import itertools

import torch
from accelerate.utils import DistributedType
from accelerate.utils.fsdp_utils import fsdp2_prepare_model

from ...distributed import all_ranks_true, batches_in_step
from ...images import to_device
from ..model.outputs import SequenceLogps, TokenLogps


def parameter_values_held(model) -> tuple[int, int]:
    """(the parameter values this rank holds, all of the model's): ZeRO-3's partitions and FSDP2's
    shards."""
    held = total = 0
    for param in model.parameters():
        # ZeRO-3: the full size; numel() is 0 once partitioned
        total += getattr(param, "ds_numel", param.numel())
        held += (param.ds_tensor if hasattr(param, "ds_tensor") else getattr(param, "_local_tensor", param)).numel()
    return held, total


def frozen_reference(accelerator, reference):
    """`reference` (a frozen `VLMForTraining`, copied before `prepare`) as the engine keeps the
    policy: sharded by FSDP2, and partitioned by ZeRO-3 (a DeepSpeed engine without an optimizer, as
    TRL prepares its reference), never gathered whole on a rank; on its device under DDP and
    ZeRO-1/2 (every rank holds the policy whole there too)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        import deepspeed

        plugin = accelerator.state.deepspeed_plugin.deepspeed_config
        stage = plugin["zero_optimization"]["stage"]
        config = {key: plugin[key] for key in ("train_micro_batch_size_per_gpu", "bf16", "fp16") if key in plugin}
        config["zero_optimization"] = plugin["zero_optimization"] if stage == 3 else {"stage": 0}
        engine, *_ = deepspeed.initialize(model=reference, config=config)
        engine.eval()  # returns None
        return engine
    # not registered with the accelerator: not checkpointed
    if accelerator.distributed_type == DistributedType.FSDP:
        return fsdp2_prepare_model(accelerator, reference).eval()
    return reference.to(accelerator.device)


class Reference:
    """The reference's log-probabilities of a batch's rows (`reference(batch, inputs)`, no graph):
    from `model`, a frozen copy, or the prepared policy with its LoRA adapters disabled when
    `peft_model` is given (peft's own switch); or, after `precompute`, from a table kept per pair
    (`pair_key`), with the frozen copy let go."""

    def __init__(self, model, peft_model=None):
        self.model, self.peft_model, self.table = model, peft_model, None

    @classmethod
    def build(cls, accelerator, model, parts) -> "Reference":
        """After `prepare`: the prepared policy `model` with its adapters disabled (LoRA), or the
        frozen copy of the starting weights `parts` holds (`vlm_parts(..., frozen_copy=True)`), kept
        as the engine keeps the policy; `parts` lets it go. MFU counts the policy's step only."""
        if parts.peft_model is not None:
            return cls(model, parts.peft_model)
        if parts.frozen_copy is None:
            raise ValueError("no starting weights to refer to: build the parts with vlm_parts(..., frozen_copy=True)")
        frozen, parts.frozen_copy = parts.frozen_copy, None
        return cls(frozen_reference(accelerator, frozen))

    @torch.no_grad()
    def __call__(self, batch: dict, inputs: dict) -> torch.Tensor:
        if self.table is not None:
            keys = batch["pair_keys"]
            return torch.tensor([self.table[key][0] for key in keys] + [self.table[key][1] for key in keys],
                                device=inputs["input_ids"].device)
        return self._computed(inputs)

    @torch.no_grad()
    def _computed(self, inputs: dict) -> torch.Tensor:
        with self.peft_model.disable_adapter() if self.peft_model is not None else contextlib.nullcontext():
            return self.model(inputs, SequenceLogps())

    @torch.no_grad()
    def token_logps(self, inputs: dict, temperature: float = 1.0) -> torch.Tensor:
        """Each target token's log-probability at `temperature`, `[rows, tokens - 1]` (0 elsewhere):
        GRPO's KL."""
        with self.peft_model.disable_adapter() if self.peft_model is not None else contextlib.nullcontext():
            return self.model(inputs, TokenLogps(temperature))

    def describe(self) -> str:
        if self.peft_model is not None:
            return "reference: the policy with its LoRA adapters disabled"
        held, total = parameter_values_held(self.model)
        return (f"reference: a frozen copy of the starting model, {type(self.model).__name__} holding {held:,} of its "
                f"{total:,} parameter values on this rank")

    def precompute(self, loaders, device) -> str:
        """Fill the table with every pair of `loaders` (one epoch of this rank's training rows, the
        held-out pairs), every rank forwarding equally often (`batches_in_step`), and let the frozen
        copy go. Returns the log line."""
        table = {}
        if self.peft_model is not None:
            self.model.eval()
        # A DataLoader's iterator draws its seed from the global RNG: the training's draws stay as
        # they were.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for loader in loaders:
                batches = iter(loader)
                first = next(batches, None)
                if not all_ranks_true(first is not None, device):
                    raise RuntimeError("A data rank has no preference pairs: use more data shards/rows or fewer "
                                       "processes (pairs that cannot be read are skipped).")
                for batch, real in batches_in_step(itertools.chain([first], batches), first, device):
                    logps = self._computed(to_device(batch, device)).tolist()
                    if real:
                        for index, key in enumerate(batch["pair_keys"]):
                            table[key] = (logps[index], logps[index + len(batch["pair_keys"])])
        if self.peft_model is None:
            self.model = None  # the frozen copy let go
        else:
            self.model.train()
        self.table = table
        return f"reference: log-probabilities of {len(table):,} pairs on this rank precomputed in a first pass"
