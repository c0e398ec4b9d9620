"""Ulysses sequence parallelism for a VLM (`--sequence_parallel_size N`): DeepSpeed's
`UlyssesSPAttentionHF` around the language model's attention, the sequence split after the vision
merge.

The N ranks of a group hold the same rows (their data rank is the group's index:
`distributed.data_parallel_rank_and_world`). Each encodes a share of their images and frames and the
features are gathered (`vision.VisionShare`; where a tower does not split by image, each runs it on
all of them), so every rank merges the whole batch's features and runs the same graph (the dummy
image too). A pre-hook on the language model splits what the merge made into N contiguous shards,
the sequence padded at its end to a multiple of N: the embeddings, the positions (mRoPE's computed
on the whole sequence), Qwen3-VL's deepstack features. Around attention DeepSpeed's all-to-all swaps
the sequence split for a head split. Each rank computes the step's output on its shard (`Shard`: its
positions, their targets in the whole sequence) and the output reduces itself over the group
(`outputs.StepOutput.reduce`, a sum by default): every rank of a group holds the whole sequence's
loss, as a data-parallel rank without the split does, and the backward gives each shard the group's
gradients. So with the window's target tokens counted once per group, the engine's average over
every rank (DDP, FSDP2, ZeRO-2/3 alike) is the exact token mean, as without the split.

Layers that attend causally get no mask (causal over the gathered sequence: the padding is at its
end). Sliding windows and image tokens attending both ways (Gemma 3, Gemma 4) need theirs: the model
builds one per layer type for the whole sequence before the language model, the split pads them
(`whole_sequence_masks`) and each layer's reaches the core attention after the all-to-all, where the
whole sequence is. Other per-token inputs (Gemma 4's per-layer embeddings) split with the
embeddings.

Only the language model's attention is wrapped, under its own name (`ATTENTION`): accelerate's path
(`ParallelismConfig(sp_backend="deepspeed")`) replaces transformers' sdpa everywhere, the vision
tower's attention included. Only the outputs that say so (`splits`) split, in training mode
(`splitting`); evaluation, sampling and `generate` run whole sequences: each rank holds whole
sequences there.
"""

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as collectives  # differentiable collectives
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..model.families import stateful_mixer_classes, stateful_mixers, vision_inputs
from ..rows.labels import IGNORE_INDEX
from .linear_attention import head_parallel_forward, heads_refusal, parallel_layer
from .vision import VisionShare

ATTENTION = "ulysses"  # the language model's attn_implementation while it trains split
# per-token inputs the split handles itself
SPLIT_APART = {"position_ids", "attention_mask", "visual_pos_masks"}


def refusal(model, size: int) -> str | None:
    """Why `model`'s language model cannot be split over `size` ranks exactly, or None. Its
    attention heads and its linear attention's must split over the group; layers that need their
    mask (sliding windows, image tokens attending both ways) get the whole sequence's
    (`needs_masks`), the others attend causally over the gathered sequence."""
    text = model.config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    if not vision_inputs(model):
        return ("it only hears (no vision tower: Qwen2-Audio's clips enter as merged embeddings, Voxtral's through "
                "its own forward), paths whose shards are not checked against the whole sequence yet: train it "
                "without --sequence_parallel_size")
    if heads % size or (kv_heads % size and size % kv_heads):
        return (f"its language model's {heads} attention heads ({kv_heads} key/value heads) do not split over "
                f"{size} ranks: give a size that divides the heads (and divides or is a multiple of the key/value "
                "heads)")
    if layers := mixer_layers(model):
        if not all(parallel_layer(layer) for layer in layers):
            return (f"its {' and '.join(stateful_mixers(model))} carry a state along the sequence, which the split "
                    "would cut (only a Gated DeltaNet's runs head-parallel)")
        if why := heads_refusal(layers[0], size):
            return f"{why}: give a size that divides both"
    if text._attn_implementation == "eager":
        return ("eager attention is not causal without its mask, which Ulysses attention drops: "
                "--attn_implementation sdpa (or flash_attention_2)")
    return None


@dataclass(frozen=True)
class Shard:
    """This rank's part of the last split sequence: positions `start` to `end` of the sequence
    padded at its end to `padded` tokens (`length` before the padding), and the ranks of its
    `group`."""

    start: int
    end: int
    padded: int
    length: int
    group: object

    def take(self, per_token: torch.Tensor, fill=0) -> torch.Tensor:
        """A per-token tensor of the whole sequence, `[rows, length, ...]`, at the shard's
        positions."""
        trailing = [0, 0] * (per_token.dim() - 2)
        return F.pad(per_token, (*trailing, 0, self.padded - per_token.shape[1]), value=fill)[:, self.start:self.end]

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """The next-token targets of the shard's positions, `[rows, end - start]` (IGNORE_INDEX past
        the sequence)."""
        return self.take(labels[:, 1:], fill=IGNORE_INDEX)

    def place(self, value: torch.Tensor) -> torch.Tensor:
        """A per-position value of the shard, `[rows, end - start]`, at its place in the padded
        sequence (0 elsewhere)."""
        return F.pad(value, (self.start, self.padded - self.end))

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the group, on every rank of it: torch's differentiable all-reduce,
        whose backward sums the group's gradients into each shard (a group's ranks computing the
        same loss give each shard its gradient times the group's size; the engine's average over
        every rank divides it back)."""
        return collectives.all_reduce(value, "sum", self.group)


def needs_masks(model) -> bool:
    """Whether some layer of `model`'s language model attends other than causally over the whole
    sequence: sliding windows (Gemma 3, Gemma 4), image tokens attending both ways (Gemma 3's
    token_type_ids, Gemma 4's use_bidirectional_attention)."""
    text = model.config.get_text_config()
    mixer_kinds = stateful_mixer_classes(model)
    other = {kind for kind in getattr(text, "layer_types", None) or () if kind != "full_attention"} - set(mixer_kinds)
    both_ways = "token_type_ids" in inspect.signature(model.forward).parameters
    flags = [getattr(text, name, None) for name in ("use_sliding_window", "use_bidirectional_attention")]
    return bool(other or any(flags) or both_ways)


def whole_sequence_mask(mask: torch.Tensor | None, length: int, padded: int) -> torch.Tensor | None:
    """A mask the model built for the whole sequence of `length` tokens, for its end padded to
    `padded`: a padding mask `[rows, length]` or a mask `[rows, heads, length, length]` (True or 0
    where a query attends a key). The padding is attended by no real token and attends itself only
    (a row attending nothing would give NaN)."""
    if mask is None:  # causal: what the core does over the gathered sequence
        return None
    extra = padded - length
    if mask.dim() == 2:
        return F.pad(mask, (0, extra))
    if mask.dim() != 4 or mask.shape[-2:] != (length, length):
        raise RuntimeError(f"sequence parallel: a mask of shape {tuple(mask.shape)} for a sequence of {length} tokens "
                           "is not one the split can extend to the whole padded sequence")
    blocked = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    mask = F.pad(mask, (0, extra, 0, extra), value=blocked)
    pads = torch.arange(length, padded, device=mask.device)
    mask[:, :, pads, pads] = mask.dtype == torch.bool
    return mask


def whole_sequence_masks(masks, length: int, padded: int) -> dict:
    """The masks by layer type the model built for the whole sequence (Gemma 3's and 4's), each
    padded."""
    if not isinstance(masks, dict):
        raise RuntimeError("sequence parallel: the language model's sliding-window or bidirectional layers need the "
                           "whole sequence's masks by layer type, and it was given none (a model that builds them "
                           "itself from each shard cannot split)")
    return {kind: whole_sequence_mask(mask, length, padded) for kind, mask in masks.items()}


class SplitForward:
    """One forward of the language model, split over the group or whole (`SequenceParallel.splitting`
    yields it): where it splits, the language model's pre-hook sets `shard` (this rank's part of the
    padded sequence, `Shard`) and `positions` (its places in the whole sequence, which causal masking
    reads)."""

    def __init__(self, split: bool):
        self.split, self.shard, self.positions = split, None, None


WHOLE = SplitForward(False)  # every forward outside a split's block: never given a shard


def mixer_layers(model) -> list[torch.nn.Module]:
    """The language model's stateful mixer layers (`families.stateful_mixer_classes`: Qwen3.5's
    Gated DeltaNet)."""
    classes = tuple(set().union(*stateful_mixer_classes(model).values()))
    return [module for module in model.get_decoder().modules() if classes and isinstance(module, classes)]


class SequenceParallel:
    """The split of every training sequence over `size` consecutive ranks (`rank // size` is the
    group). Build it after `Accelerator()` (it makes the groups) and before `prepare`;
    `VLMForTraining(model, sequence_parallel=...)` trains on the shards."""

    def __init__(self, model, size: int, processor=None):
        from deepspeed import comm
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % size or world == 1:
            raise ValueError(f"--sequence_parallel_size {size} needs a multiple of {size} processes (there are "
                             f"{world}): launch with --num_processes a multiple of it")
        if why := refusal(model, size):
            raise ValueError(f"--sequence_parallel_size: {type(model).__name__} cannot split its sequences: {why}")
        # DeepSpeed's all-to-all runs on deepspeed.comm, over the engine's group
        if not comm.is_initialized():
            comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
        rank = dist.get_rank()
        groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
        self.size, self.rank, self.group = size, rank % size, groups[rank // size]
        self.vision, self.vision_line = VisionShare.of(model, self.group, size, self.rank, processor)
        text = model.config.get_text_config()
        self.core = ALL_ATTENTION_FUNCTIONS[text._attn_implementation]
        head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self._shape = dict(attn_head_count=text.num_attention_heads, kv_head_count=text.num_key_value_heads,
                           attn_head_size=head_size, num_hidden_layers=text.num_hidden_layers, process_group=self.group,
                           seq_length_is_variable=True)
        self._ulysses_class, self._by_rows = UlyssesSPAttentionHF, {}
        self._ulysses(1)  # DeepSpeed's own checks, now
        ALL_ATTENTION_FUNCTIONS.register(ATTENTION, self._attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS[text._attn_implementation])
        text._attn_implementation = ATTENTION
        # The forward a `splitting` block asks for, and the language model's last one: its attention reads it, and
        # so does its recomputation in the backward (gradient checkpointing), which runs after the block.
        self.asked = self.running = WHOLE
        self.masked = needs_masks(model)  # its layers get the whole sequence's masks, padded
        decoder, mixers = model.get_decoder(), mixer_layers(model)
        decoder.register_forward_pre_hook(self._split, with_kwargs=True)
        # linear attention: head-parallel around the whole block
        self.head_parallel = [(layer, self._head_parallel(layer, layer.forward)) for layer in mixers]
        for layer, forward in self.head_parallel:
            layer.forward = forward
        self.patched = [f"attention {ATTENTION!r} registered in transformers and set as the language model's",
                        f"a pre-hook on {type(decoder).__name__} that splits its inputs"]
        if mixers:
            self.patched.append(f"{len(mixers)} {type(mixers[0]).__name__} forwards made head-parallel")

    @classmethod
    def of(cls, accelerator, model, size: int, processor=None):
        """The split for `--sequence_parallel_size size`, None for 1; accelerate's own sequence
        parallelism refused (it replaces sdpa in the vision tower too). What cannot run split with
        other flags is refused when they are parsed (`arguments.VLMModelArgs.check_with`). The
        processor makes the images the tower's check encodes, where the model's config alone cannot
        (`image_sizes`, `image_position_ids`)."""
        config = accelerator.parallelism_config
        if config is not None and (config.sp_size or 1) > 1:
            raise ValueError("the accelerate config's parallelism_config_sp_size wraps every sdpa attention, the "
                             "vision tower's too: drop it from the config and give the recipe --sequence_parallel_size")
        return cls(model, size, processor) if size > 1 else None

    def describe(self) -> str:
        return (f"sequence parallel: each sequence split over {self.size} ranks after the vision merge (DeepSpeed's "
                f"Ulysses attention in the language model); {self.vision_line}; patched: {'; '.join(self.patched)}")

    def image_features(self, encoder, inputs: dict):
        """(`encoder(**inputs)`'s output, features encoded and left unused or None): while a split
        is asked, each rank of the group encodes a share of the images and frames, gathered
        (`VisionShare`), else every rank all."""
        if self.asked.split and self.vision is not None:
            return self.vision.encode(encoder, inputs)
        return encoder(**inputs, return_dict=True), None

    def _ulysses(self, rows: int):
        if rows not in self._by_rows:  # its shapes are fixed per batch size
            self._by_rows[rows] = self._ulysses_class(self.core, batch_size=rows, **self._shape)
        return self._by_rows[rows]

    @contextmanager
    def splitting(self, split: bool):
        """Yields the `SplitForward` of the language model's forward inside: split where `split`
        (its `shard` set once it ran); any other forward (sampling, evaluation, `generate`) runs
        whole sequences with their mask."""
        self.asked = SplitForward(split)
        try:
            yield self.asked
        finally:
            self.asked = WHOLE

    def _split(self, module, args, kwargs):
        # what the attention of this forward (and of its recomputation) does
        self.running = forward = self.asked
        if not forward.split:
            return None
        # transformers 5.25's `kernels` drop a layer's own forward on train() and eval(): each shard would run the
        # recurrence from a zero state, silently; the head-parallel forwards go back before every split forward
        for layer, head_parallel in self.head_parallel:
            if vars(layer).get("forward") is not head_parallel:
                layer.forward = head_parallel
        embeds = kwargs.get("inputs_embeds")
        if args or embeds is None:
            raise RuntimeError(f"sequence parallel: {type(module).__name__} was called without inputs_embeds as a "
                               "keyword; the split after the vision merge needs them")
        rows, length = embeds.shape[:2]
        padded = -(-length // self.size) * self.size
        start, end = self.rank * padded // self.size, (self.rank + 1) * padded // self.size
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=embeds.device).expand(rows, length)
        extra = torch.arange(1, padded - length + 1, device=embeds.device)
        # mRoPE's [3, rows, length] too
        positions = torch.cat([positions, positions[..., -1:] + extra], dim=-1)
        forward.shard = Shard(start, end, padded, length, self.group)
        forward.positions = torch.arange(start, end, device=embeds.device).expand(rows, end - start)
        kwargs |= {"position_ids": positions[..., start:end],
                   "attention_mask": whole_sequence_masks(kwargs.get("attention_mask"), length, padded)
                   if self.masked else None}
        # the embeddings, Gemma 4's per-layer embeddings: each token's inputs
        for name, value in kwargs.items():
            if name not in SPLIT_APART and torch.is_tensor(value) and value.shape[:2] == (rows, length):
                kwargs[name] = forward.shard.take(value)
        # Qwen3-VL's deepstack: the shard's visual tokens' rows
        if kwargs.get("visual_pos_masks") is not None:
            masks = F.pad(kwargs["visual_pos_masks"], (0, padded - length))
            in_shard = torch.zeros_like(masks)
            in_shard[:, start:end] = True
            kept = in_shard[masks]
            kwargs["visual_pos_masks"] = masks[:, start:end]
            kwargs["deepstack_visual_embeds"] = [embeds[kept] for embeds in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    def _head_parallel(self, layer, whole):
        def forward(*args, **kwargs):
            if not self.running.split:
                return whole(*args, **kwargs)
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            return head_parallel_forward(layer, hidden, self.size, self.rank, self.group)

        return forward

    def _attention(self, module, query, key, value, attention_mask, *args, **kwargs):
        if not self.running.split:  # whole sequences, with their mask
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        # DeepSpeed gathers them; causal masking needs them monotonic
        kwargs["position_ids"] = self.running.positions
        # DeepSpeed sets it where it replicates heads
        groups = getattr(module, "num_key_value_groups", None)
        try:
            # the whole sequence's, or causal over it
            mask = attention_mask if self.masked else None
            return self._ulysses(len(query))(module, query, key, value, mask, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups  # what a whole-sequence forward needs
