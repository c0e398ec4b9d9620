"""Feature-cache gradient accumulation (GradCache): k micro-batches act as ONE contrastive batch.

Plain accumulation sums k micro-batch losses, each with b negatives per row: it optimises a
b-negative objective, not the k*b-negative one (docs/losses.md). Here:
1. forward every micro-batch without a graph and cache its features (and the RNG state it used);
2. compute the loss on all cached features at once (k*b rows per rank, gathered across ranks)
   and its gradient with respect to those features and the logit scale;
3. re-forward each micro-batch with the same RNG state (same dropout masks) and back-propagate
   the cached feature gradients through it, inside `accelerator.accumulate`, so gradients are
   synchronised only after the last one.
The logit scale's (and SigLIP's bias') gradient is applied once in total (split over the k
re-forwards), not k times (open_clip's `--accum-freq` applies it k times). Costs one extra forward
per micro-batch.
"""

import torch

from ..images import to_device


def grad_cache_backward(accelerator, model, micro_batches, loss_fn) -> torch.Tensor:
    """Backward of `loss_fn(image_embeds, text_embeds, *scalars)` over all `micro_batches` at once.

    The model returns (image_embeds, text_embeds, *scalars) as `CLIPForContrastiveTraining`
    (scalars: the logit scale) and `SiglipForContrastiveTraining` (scale and bias) do; the
    Accelerator's gradient_accumulation_steps must equal len(micro_batches). The caller steps the
    optimizer afterwards. Returns the (detached) loss.
    """
    device = accelerator.device
    rng_states, image_parts, text_parts = [], [], []
    with torch.no_grad():
        for batch in micro_batches:
            rng_states.append(_rng_state(device))
            image_embeds, text_embeds, *scalars = model(**to_device(batch, device))
            image_parts.append(image_embeds)
            text_parts.append(text_embeds)
    images = torch.cat(image_parts).requires_grad_()
    texts = torch.cat(text_parts).requires_grad_()
    cached_scalars = [scalar.detach().requires_grad_() for scalar in scalars]
    loss = loss_fn(images, texts, *cached_scalars)
    loss.backward()  # gradients w.r.t. the cached features only: no parameter is in this graph

    steps = len(micro_batches)
    offset = 0
    for batch, rng_state in zip(micro_batches, rng_states):
        rows = slice(offset, offset + len(batch["input_ids"]))
        offset = rows.stop
        _set_rng_state(rng_state, device)
        with accelerator.accumulate(model):
            image_embeds, text_embeds, *scalars = model(**to_device(batch, device))
            feature_terms = (image_embeds * images.grad[rows]).sum() + (text_embeds * texts.grad[rows]).sum()
            scalar_terms = sum((scalar * cached.grad).sum() for scalar, cached in zip(scalars, cached_scalars))
            # accelerate and DeepSpeed divide each backward by the window length k: the feature
            # terms are multiplied back by k, the scalar terms are not, so their k passes add up to
            # one gradient.
            accelerator.backward(steps * feature_terms + scalar_terms)
    return loss.detach()


def _rng_state(device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state, device):
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)
