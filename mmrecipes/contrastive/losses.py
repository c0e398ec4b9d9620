"""Contrastive losses that are exact at any data-parallel scale (docs/losses.md).

Each rank passes its own L2-normalised rows. The returned value is this rank's *local* loss,
scaled so that (a) the mean over ranks equals the loss of one process holding every rank's
rows, and (b) each rank's feature gradient is W times the big-batch gradient of its rows, so
the gradient *averaging* of DDP / FSDP / ZeRO yields exactly the big-batch gradient. Per-rank
batch sizes may differ (last batch, dynamic batching, skipped samples): sizes are gathered,
rows padded for the collective, offsets come from a prefix sum and the normaliser is the
global row count N. Without an initialised process group they are plain one-process losses.

Collectives are torch's functional collectives, whose backward is defined
(`torch.distributed.all_gather` returns detached tensors and silently drops every gradient
from other ranks' negatives: tests/test_losses.py swaps it in and the gradient check fails).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
import torch.utils.checkpoint


def _group_rank_world(group):
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    group = group or dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def gather_sizes(num_rows: int, device, group) -> list[int]:
    """Every rank's row count, in rank order (a collective)."""
    size = torch.tensor([num_rows], device=device, dtype=torch.long)
    return funcol.all_gather_single(size, 0, group).tolist()


def all_gather_with_grad(rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's `rows` (sizes may differ) in rank order, differentiably.

    The backward reduce-scatters (sums) the gradient of the gathered tensor, so each rank
    receives the gradient of its rows from every rank's loss.
    """
    max_rows = max(sizes)
    padded = F.pad(rows, (0, 0, 0, max_rows - rows.shape[0]))
    gathered = funcol.all_gather_single_autograd(padded, 0, group)
    if all(size == max_rows for size in sizes):
        return gathered
    valid = torch.cat([torch.arange(r * max_rows, r * max_rows + n) for r, n in enumerate(sizes)])
    return gathered.index_select(0, valid.to(gathered.device))


def clip_loss(image_features, text_features, logit_scale, *, tile_size=None, group=None):
    """Symmetric InfoNCE over the features of all ranks (see the module docstring).

    Args:
        image_features, text_features: this rank's L2-normalised `[b_r, D]` rows; row i of each is a
        pair. logit_scale: the multiplier (already exponentiated), shape `[]` or `[1]`. tile_size:
        if set, compute the loss in `tile_size` x `tile_size` blocks with an online
            log-sum-exp and a recomputing backward: no `[b_r, N]` logits matrix is ever held.
        group: the process group to gather over (default: the world group, if initialised).
    """
    group, rank, world = _group_rank_world(group)
    if world == 1:
        return local_clip_loss(image_features, text_features, logit_scale, gather=lambda rows: rows, offset=0,
                               world=1, tile_size=tile_size)
    sizes = gather_sizes(image_features.shape[0], image_features.device, group)
    return local_clip_loss(image_features, text_features, logit_scale,
                           gather=lambda rows: all_gather_with_grad(rows, sizes, group), offset=sum(sizes[:rank]),
                           world=world, tile_size=tile_size)


def local_clip_loss(image_features, text_features, logit_scale, *, gather, offset, world, tile_size=None):
    """This rank's share of InfoNCE: `gather` maps this rank's rows to every rank's (N rows, this
    rank's at `offset`); the result is scaled by W/(2N) so that the mean over ranks is the global
    loss.

    Each direction gathers its keys just before using them, so in the backward each gathered
    gradient ([N, D]) is reduce-scattered before the other direction's is computed.
    """
    scale = logit_scale.reshape(())
    if tile_size is None:
        labels = torch.arange(image_features.shape[0], device=image_features.device) + offset
        total = F.cross_entropy(scale * image_features @ gather(text_features).T, labels, reduction="sum")
        all_images = gather(image_features)
        total = total + F.cross_entropy(scale * text_features @ all_images.T, labels, reduction="sum")
    else:
        # CE_i = logsumexp_j(s x_i.y_j) - s x_i.y_i; the positive dot product is the same both ways.
        total = tiled_logsumexp(image_features, gather(text_features), scale, tile_size).sum()
        all_images = gather(image_features)
        total = total + tiled_logsumexp(text_features, all_images, scale, tile_size).sum()
        total = total - 2 * scale * (image_features * text_features).sum()
    return total * world / (2 * all_images.shape[0])


def tiled_logsumexp(queries, keys, scale, tile_size):
    """`logsumexp(scale * queries @ keys.T, dim=1)` without holding more than a tile of logits."""
    return _TiledLogSumExp.apply(queries, keys, scale, tile_size)


class _TiledLogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries, keys, scale, tile_size):
        lse = torch.full((queries.shape[0],), -torch.inf, device=queries.device, dtype=queries.dtype)
        for rows, cols in _tiles(queries.shape[0], keys.shape[0], tile_size):
            lse[rows] = torch.logaddexp(lse[rows], torch.logsumexp(scale * queries[rows] @ keys[cols].T, dim=1))
        ctx.save_for_backward(queries, keys, scale, lse)
        ctx.tile_size = tile_size
        return lse

    @staticmethod
    def backward(ctx, grad_lse):
        queries, keys, scale, lse = ctx.saved_tensors
        grad_queries, grad_keys = torch.zeros_like(queries), torch.zeros_like(keys)
        grad_scale = torch.zeros((), device=queries.device, dtype=torch.float64)
        for rows, cols in _tiles(queries.shape[0], keys.shape[0], ctx.tile_size):
            dots = queries[rows] @ keys[cols].T
            # d lse_i / d logit_ij = softmax_ij, recomputed from the saved row lse (in place: one
            # extra tile).
            weights = (dots * scale).sub_(lse[rows, None]).exp_().mul_(grad_lse[rows, None])
            grad_queries[rows].addmm_(weights, keys[cols])
            grad_keys[cols].addmm_(weights.T, queries[rows])
            grad_scale += torch.dot(weights.view(-1), dots.view(-1)).double()
        return grad_queries.mul_(scale), grad_keys.mul_(scale), grad_scale.to(scale.dtype), None


def _tiles(num_rows, num_cols, tile_size):
    for row in range(0, num_rows, tile_size):
        for col in range(0, num_cols, tile_size):
            yield slice(row, row + tile_size), slice(col, col + tile_size)


def siglip_loss(image_features, text_features, logit_scale, logit_bias, *, group=None):
    """Sigmoid loss (SigLIP) over all ranks' pairs, text blocks passed around a ring.

    loss = -(1/N) sum_i sum_j log sigmoid(z_ij (s x_i.y_j + t)), z = +1 on pairs, -1 elsewhere.
    Each rank scores its images against one text block at a time and hands the block to its
    neighbour (with autograd: gradients travel the ring backwards), so no gathered `[N, D]`
    matrix exists; `logit_scale` and `logit_bias` stay local. Uneven sizes: blocks are padded
    to the largest rank's rows and padded columns masked.
    """
    group, rank, world = _group_rank_world(group)
    num_local = image_features.shape[0]
    sizes = [num_local] if world == 1 else gather_sizes(num_local, image_features.device, group)
    return local_siglip_loss(image_features, text_features, logit_scale, logit_bias, sizes=sizes, rank=rank,
                             pass_block=lambda block: _ring_shift(block, rank, world, group))


def local_siglip_loss(image_features, text_features, logit_scale, logit_bias, *, sizes, rank, pass_block):
    """This rank's share of the sigmoid loss, scaled by W/N: `pass_block(block)` returns the text
    block of the previous rank in the ring (`sizes`: every rank's row count, in rank order)."""
    world, num_local, max_rows = len(sizes), image_features.shape[0], max(sizes)
    block = F.pad(text_features, (0, 0, 0, max_rows - num_local))
    columns = torch.arange(max_rows, device=image_features.device)
    total = image_features.new_zeros(())
    for step in range(world):
        # Start the next hand-over before computing on this block, so the two overlap.
        next_block = pass_block(block) if step < world - 1 else None
        source = (rank - step) % world
        logits = logit_scale.reshape(()) * image_features @ block.T + logit_bias.reshape(())
        signs = torch.full_like(logits, -1.0)
        if step == 0:
            signs.diagonal()[:num_local] = 1.0
        valid = (columns < sizes[source]).to(logits.dtype)
        total = total - (F.logsigmoid(signs * logits) * valid).sum()
        block = next_block
    return total * world / sum(sizes)


def _ring_shift(block, rank, world, group):
    """Send `block` to rank+1 and receive rank-1's; the backward sends gradients the other way."""
    send = [0] * world
    receive = [0] * world
    send[(rank + 1) % world] = block.shape[0]
    receive[(rank - 1) % world] = block.shape[0]
    return funcol.all_to_all_single_autograd(block.contiguous(), receive, send, group)
