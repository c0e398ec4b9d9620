"""Retrieval R@1 on the eval split that every rank agrees on: each rank embeds its share, the
embeddings are gathered, and every rank forwards equally often (`distributed.batches_in_step`)."""

import torch
import torch.distributed as dist

from ..distributed import batches_in_step
from ..images import to_device
from .losses import all_gather_with_grad, gather_sizes


def retrieval_recall_at_1(image_embeds: torch.Tensor, text_embeds: torch.Tensor, media: str = "image") -> dict:
    """Image->text and text->image R@1 (`media` "audio": audio->text, text->audio) where row i of
    each is a pair (features L2-normalised)."""
    similarity = image_embeds @ text_embeds.T
    targets = torch.arange(len(similarity), device=similarity.device)
    return {
        f"{media}_to_text_R@1": (similarity.argmax(dim=1) == targets).float().mean().item(),
        f"text_to_{media}_R@1": (similarity.argmax(dim=0) == targets).float().mean().item(),
        "eval_pairs": len(similarity),
    }


@torch.no_grad()
def evaluate_retrieval(model, eval_loader, filler_batch, device, media: str = "image") -> dict:
    """Embed this rank's share of the eval set, gather every rank's, score R@1 ({} if no rows).
    Every rank forwards equally often (`batches_in_step`)."""
    model.eval()
    image_parts, text_parts, width = [], [], None
    for batch, real in batches_in_step(eval_loader, filler_batch, device):
        image_embeds, text_embeds = model(**to_device(batch, device))[:2]
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
    return retrieval_recall_at_1(images, texts, media)
