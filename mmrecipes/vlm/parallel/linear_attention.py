"""Sequence parallelism through a linear-attention layer (Qwen3.5's Gated DeltaNet): head-parallel
around the whole block, as Ulysses is around attention.

A recurrence over the sequence cannot run on a shard of it: a rank that started its shard's state at
zero would miss everything before it. So each rank projects its shard (the token-wise input
projections), an all-to-all gives every rank the whole sequence for its share of the heads
(`_to_heads`), the depthwise convolution runs with those heads' channels of its weights, the
recurrence runs for those heads over the whole sequence, and an all-to-all gives each rank its shard
back for every head (`_to_sequence`) before the token-wise gated norm and output projection. torch's
differentiable all-to-all carries the gradients back the same way. Decided by the layer's structure
(`parallel_layer`: the projections, the convolution and the decay parameters of a Gated DeltaNet),
never by a name.
"""

import sys

import torch
import torch.nn.functional as F
from torch.distributed import _functional_collectives as collectives

PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj",
         "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


def parallel_layer(layer) -> bool:
    """Whether `layer` has a Gated DeltaNet's parts, which the head-parallel forward runs."""
    return all(hasattr(layer, name) for name in PARTS)


def heads_refusal(layer, size: int) -> str | None:
    """Why `layer`'s heads cannot be shared out over `size` ranks, or None."""
    if layer.num_k_heads % size or layer.num_v_heads % size:
        return (f"its {type(layer).__name__} layers' {layer.num_k_heads} key heads and {layer.num_v_heads} value heads "
                f"do not split over {size} ranks")
    return None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x[i] to rank i of `group`; the result's [j] from rank j (dim 0: the group's size)."""
    return collectives.all_to_all_single_autograd(x.contiguous(), None, None, group)


def _to_heads(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """`[rows, shard, heads, dim]` of this rank's shard -> `[rows, size x shard, heads / size,
    dim]`: the whole sequence of this rank's share of the heads."""
    rows, shard, heads, dim = x.shape
    blocks = x.reshape(rows, shard, size, heads // size, dim).permute(2, 0, 1, 3, 4)
    # [source rank: its shard, rows, shard, heads / size, dim]
    gathered = _all_to_all(blocks, group)
    return gathered.permute(1, 0, 2, 3, 4).reshape(rows, size * shard, heads // size, dim)


def _to_sequence(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """`_to_heads` undone: `[rows, size x shard, heads / size, dim]` -> `[rows, shard, heads,
    dim]`."""
    rows, length, heads, dim = x.shape
    blocks = x.reshape(rows, size, length // size, heads, dim).permute(1, 0, 2, 3, 4)
    gathered = _all_to_all(blocks, group)  # [source rank: its heads, rows, shard, heads, dim]
    return gathered.permute(1, 2, 0, 3, 4).reshape(rows, length // size, size * heads, dim)


def head_parallel_forward(layer, hidden_states: torch.Tensor, size: int, rank: int, group) -> torch.Tensor:
    """The Gated DeltaNet `layer` on this rank's shard of the sequence, `[rows, shard, hidden]`, as
    the layer computes it on the whole sequence (no cache, no padding mask: a split sequence has
    neither)."""
    # the layer's own mixers: the kernels where installed
    module = sys.modules[type(layer).__module__]
    rows, shard, _ = hidden_states.shape
    key_heads, value_heads = layer.num_k_heads // size, layer.num_v_heads // size
    key_width, value_width = key_heads * layer.head_k_dim, value_heads * layer.head_v_dim
    query, key, value = layer.in_proj_qkv(hidden_states).split([layer.key_dim, layer.key_dim, layer.value_dim], -1)
    query, key = (_to_heads(x.reshape(rows, shard, layer.num_k_heads, -1), size, group) for x in (query, key))
    value = _to_heads(value.reshape(rows, shard, layer.num_v_heads, -1), size, group)
    b, a = (_to_heads(projection(hidden_states)[..., None], size, group)[..., 0]
            for projection in (layer.in_proj_b, layer.in_proj_a))
    length = query.shape[1]
    # this rank's heads' channels of the depthwise convolution, in the layer's order: queries, keys,
    # values
    channels = torch.cat([torch.arange(rank * key_width, (rank + 1) * key_width),
                          layer.key_dim + torch.arange(rank * key_width, (rank + 1) * key_width),
                          2 * layer.key_dim + torch.arange(rank * value_width, (rank + 1) * value_width)])
    channels = channels.to(hidden_states.device)
    bias = layer.conv1d.bias[channels] if layer.conv1d.bias is not None else None
    mixed = torch.cat([x.reshape(rows, length, -1) for x in (query, key, value)], dim=-1).transpose(1, 2)
    mixed = module.causal_conv1d_fn(mixed, layer.conv1d.weight.squeeze(1)[channels], bias,
                                    activation=layer.activation).transpose(1, 2)
    query, key, value = mixed.split([key_width, key_width, value_width], dim=-1)
    query, key = (x.reshape(rows, length, key_heads, -1) for x in (query, key))
    value = value.reshape(rows, length, value_heads, -1)
    mine = slice(rank * value_heads, (rank + 1) * value_heads)
    g = -layer.A_log[mine].float().exp() * F.softplus(a.float() + layer.dt_bias[mine])
    core, _ = module.torch_chunk_gated_delta_rule(query, key, value, g=g, beta=b.sigmoid(), initial_state=None,
                                                  output_final_state=False, use_qk_l2norm_in_kernel=True)
    core = _to_sequence(core, size, group)  # [rows, shard, value heads, value dim]
    gate = layer.in_proj_z(hidden_states).reshape(-1, layer.head_v_dim)
    core = layer.norm(core.reshape(-1, layer.head_v_dim), gate).reshape(rows, shard, -1)
    return layer.out_proj(core)
