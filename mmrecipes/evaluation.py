"""Evaluation that every rank agrees on: retrieval R@1 (contrastive) and answer exact match (VLM)."""

import torch
import torch.distributed as dist

from .chat_collate import chat_model_inputs
from .data import model_inputs
from .distributed import all_ranks_true, sum_over_ranks
from .losses import IGNORE_INDEX, all_gather_with_grad, gather_sizes


def retrieval_recall_at_1(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> dict:
    """Image->text and text->image R@1 where row i of each is a pair (features L2-normalised)."""
    similarity = image_embeds @ text_embeds.T
    targets = torch.arange(len(similarity), device=similarity.device)
    return {
        "image_to_text_R@1": (similarity.argmax(dim=1) == targets).float().mean().item(),
        "text_to_image_R@1": (similarity.argmax(dim=0) == targets).float().mean().item(),
        "eval_pairs": len(similarity),
    }


def batches_in_step(batches, filler, device):
    """(batch, real) for this rank's `batches`, then (`filler`, False) until every rank has run out.

    Ranks may hold different numbers of eval batches, but FSDP and ZeRO-3 run collectives inside
    the forward, so every rank must run it equally often: a rank that has run out forwards
    `filler` (any valid batch) and discards the result until all are done.
    """
    batches = iter(batches)
    while not all_ranks_true((batch := next(batches, None)) is None, device):
        yield (filler, False) if batch is None else (batch, True)


@torch.no_grad()
def evaluate_retrieval(model, eval_loader, filler_batch, device) -> dict:
    """Embed this rank's share of the eval set, gather every rank's, score R@1 ({} if no rows).
    Every rank forwards equally often (`batches_in_step`)."""
    model.eval()
    image_parts, text_parts, width = [], [], None
    for batch, real in batches_in_step(eval_loader, filler_batch, device):
        image_embeds, text_embeds = model(**model_inputs(batch, device))[:2]
        width = image_embeds.shape[1]
        if real:
            image_parts.append(image_embeds.float())
            text_parts.append(text_embeds.float())
    model.train()
    if width is None:  # the eval set is empty on every rank
        return {}
    empty = torch.zeros(0, width, device=device)
    images, texts = torch.cat(image_parts or [empty]), torch.cat(text_parts or [empty])
    if dist.is_initialized():
        sizes = gather_sizes(len(images), images.device, dist.group.WORLD)
        images = all_gather_with_grad(images, sizes, dist.group.WORLD)
        texts = all_gather_with_grad(texts, sizes, dist.group.WORLD)
    return retrieval_recall_at_1(images, texts)


@torch.no_grad()
def evaluate_answers(model, eval_loader, filler_batch, device) -> dict:
    """Exact-match accuracy of the answers (the labelled tokens, up to and including the
    end-of-turn token), summed over every rank's share of the eval set ({} if it is empty).

    Scored in one teacher-forced forward per batch: greedy decoding reproduces an answer exactly
    when the argmax at every answer position is the answer's next token, which is what this
    checks. One forward per batch keeps every rank's collectives (FSDP2, ZeRO-3) in step, where
    `generate` would stop after a different number of tokens on each rank. A rank that has run
    out forwards `filler_batch` and discards the result (`batches_in_step`).
    """
    model.eval()
    totals = torch.zeros(2, device=device)  # correct answers, answers
    for batch, real in batches_in_step(eval_loader, filler_batch, device):
        inputs = chat_model_inputs(batch, device)
        _, logits = model(**inputs, return_logits=True)
        if real:
            targets = inputs["labels"][:, 1:]
            scored = targets != IGNORE_INDEX
            correct = ((logits[:, :-1].argmax(-1) == targets) | ~scored).all(dim=1) & scored.any(dim=1)
            totals += torch.stack([correct.sum(), scored.any(dim=1).sum()]).float()
    model.train()
    correct, answers = sum_over_ranks(totals).tolist()
    return {"answer_accuracy": correct / answers, "eval_answers": int(answers)} if answers else {}

