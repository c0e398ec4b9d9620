"""Token-level losses (captioning, SFT, DPO, GRPO) under accumulation and data parallelism.

The right gradient is (1/N) * grad(sum of CE over every target token of the window on all ranks), N
= the window's target tokens on all data ranks. A per-micro-batch mean weights a micro-batch of 3
target tokens like one of 300. Count N once per window (one all-reduce), then back-propagate each
micro-batch's *summed* CE times `distributed.token_loss_scale` (`Ranks.loss_scale`; docs/losses.md).
"""

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..rows.labels import IGNORE_INDEX


def token_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token CE over the positions whose (shifted) label is not IGNORE_INDEX, in
    fp32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def head_cross_entropy_sum(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, *,
                           num_chunks: int = 8, softcap: float | None = None, shifted: bool = False) -> torch.Tensor:
    """`token_cross_entropy_sum(head(hidden), labels)` without the `[batch, tokens, vocab]` fp32
    logits.

    The shifted positions go through `head` (the LM's output layer) in `num_chunks` slices; each
    slice's logits are upcast to fp32 and recomputed in backward (activation checkpointing), so the
    peak holds one slice's logits instead of every position's (torchtune's `num_output_chunks`). A
    fixed number of slices, not a fixed slice size: every rank calls `head` the same number of times
    whatever its batch (under ZeRO-3 each call gathers the weight, a collective), and the slices'
    shapes come from the batch's shape, never from its values (no host read, no recompile for a new
    count of targets). Ignored positions (prompt, image, padding) add exactly 0. `softcap`:
    Gemma-style final logit soft-capping (`tanh(logits / cap) * cap`). `shifted`: `labels` are
    already each position's next-token target (a sequence-parallel shard's:
    `sequence_parallel.Shard.targets`).
    """
    return _chunked_sum(hidden, head, labels, num_chunks, softcap, per_row=False, shifted=shifted)


def head_cross_entropy_per_row(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, *,
                               num_chunks: int = 8, softcap: float | None = None,
                               shifted: bool = False) -> torch.Tensor:
    """Each row's summed CE, `[rows]` (its answers' negative log-probability), as
    `head_cross_entropy_sum`."""
    return _chunked_sum(hidden, head, labels, num_chunks, softcap, per_row=True, shifted=shifted)


def head_cross_entropy_per_token(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, *,
                                 num_chunks: int = 8, softcap: float | None = None,
                                 temperature: float = 1.0, shifted: bool = False) -> torch.Tensor:
    """Each target's CE, `[rows, tokens - 1]` (0 elsewhere; `[rows, tokens]` `shifted`), of the
    logits divided by `temperature` (the distribution GRPO sampled from, as TRL scores it), as
    `head_cross_entropy_sum`."""
    if not shifted:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    positions, targets = hidden.flatten(0, 1), labels.flatten()
    parts = [torch.utils.checkpoint.checkpoint(_chunk_token_cross_entropy, part, part_targets, head, softcap,
                                               temperature, use_reentrant=False)
             for part, part_targets in zip(positions.tensor_split(num_chunks), targets.tensor_split(num_chunks))]
    return torch.cat(parts).view(len(hidden), hidden.shape[1])


def _chunked_sum(hidden, head, labels, num_chunks: int, softcap, per_row: bool, shifted=False) -> torch.Tensor:
    if not shifted:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    positions, targets = hidden.flatten(0, 1), labels.flatten()
    rows = torch.arange(len(hidden), device=hidden.device).repeat_interleave(hidden.shape[1]) if per_row else None
    row_parts = rows.tensor_split(num_chunks) if per_row else [None] * num_chunks
    total = hidden.new_zeros(len(hidden) if per_row else (), dtype=torch.float32)
    for part, part_targets, part_rows in zip(positions.tensor_split(num_chunks), targets.tensor_split(num_chunks),
                                             row_parts):
        total = total + torch.utils.checkpoint.checkpoint(_chunk_cross_entropy_sum, part, part_targets, head, softcap,
                                                          part_rows, len(hidden), use_reentrant=False)
    return total


def _chunk_cross_entropy_sum(hidden, targets, head, softcap, rows=None, num_rows=0):
    """The chunk's summed CE, or with `rows` (each position's row) its sum per row."""
    logits = soft_capped(head(hidden).float(), softcap)
    if rows is None:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    losses = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
    return losses.new_zeros(num_rows).index_add(0, rows, losses)


def _chunk_token_cross_entropy(hidden, targets, head, softcap, temperature):
    return F.cross_entropy(soft_capped(head(hidden).float(), softcap) / temperature, targets,
                           ignore_index=IGNORE_INDEX, reduction="none")


def head_generalized_jsd_sum(student_hidden: torch.Tensor, student_head: torch.nn.Module,
                             teacher_hidden: torch.Tensor, teacher_head: torch.nn.Module, mask: torch.Tensor, *,
                             beta: float, temperature: float = 1.0, num_chunks: int = 8,
                             student_softcap: float | None = None,
                             teacher_softcap: float | None = None) -> torch.Tensor:
    """The generalised Jensen-Shannon divergence between the teacher's and the student's next-token
    distributions at `temperature`, summed over the positions where `mask` holds (GKD, Agarwal et
    al. 2024, as TRL 1.16 defines it): beta KL(p_t || m) + (1 - beta) KL(p_s || m) with m = (1 -
    beta) p_s + beta p_t; beta 0 is the forward KL(p_t || p_s), 1 the reverse KL(p_s || p_t).
    `*_hidden`: `[..., hidden]` positions aligned with `mask` `[...]` (each predicting the same next
    token), each model's own width; the vocabularies must be the same.

    As `head_cross_entropy_sum`: the positions go through both heads in `num_chunks` slices, each
    slice's logits in fp32 and recomputed in backward, so neither model's logits of the whole batch
    exist at once, and every rank calls each head equally often. The gradient reaches the student
    only."""
    student, teacher = student_hidden.flatten(0, -2), teacher_hidden.flatten(0, -2)
    parts = zip(student.tensor_split(num_chunks), teacher.tensor_split(num_chunks),
                mask.flatten().tensor_split(num_chunks))
    total = student.new_zeros((), dtype=torch.float32)
    for student_part, teacher_part, mask_part in parts:
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_generalized_jsd, student_part, teacher_part, mask_part, student_head, teacher_head, beta,
            temperature, student_softcap, teacher_softcap, use_reentrant=False)
    return total


def _chunk_generalized_jsd(student_hidden, teacher_hidden, mask, student_head, teacher_head, beta, temperature,
                           student_softcap, teacher_softcap):
    log_ps = F.log_softmax(soft_capped(student_head(student_hidden).float(), student_softcap) / temperature, dim=-1)
    with torch.no_grad():
        log_pt = F.log_softmax(soft_capped(teacher_head(teacher_hidden).float(), teacher_softcap) / temperature, dim=-1)
    if beta == 0:
        divergence = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    elif beta == 1:
        divergence = (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    else:
        log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
        divergence = (beta * log_pt.exp() * (log_pt - log_m) + (1 - beta) * log_ps.exp() * (log_ps - log_m)).sum(-1)
    return (divergence * mask).sum()


def soft_capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-style final logit soft-capping, `tanh(logits / cap) * cap`; the logits as they are for
    None."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap
