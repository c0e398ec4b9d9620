"""Feature-cache accumulation: k micro-batches on each of W ranks give the gradient of ONE batch
of all their rows (float64, tiny CLIP under DDP), the logit scale included."""

import pytest
import torch
import torch.nn.functional as F

from gloo import run_on_ranks
from mmrecipes.contrastive.arguments import ModelArgs
from mmrecipes.contrastive.grad_cache import grad_cache_backward
from mmrecipes.contrastive.losses import clip_loss
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.distributed import make_accelerator

MICRO_SIZES = {0: [3, 5], 1: [2, 4]}  # rows per micro-batch on each rank: uneven everywhere


def tiny_clip(dropout=0.0):
    torch.manual_seed(0)
    model, tokenizer, _ = build_contrastive(ModelArgs())
    model.config.vision_config.attention_dropout = model.config.text_config.attention_dropout = dropout
    for module in model.modules():
        if hasattr(module, "dropout") and isinstance(module.dropout, float):
            module.dropout = dropout
    return model.double(), tokenizer


def micro_batch(rank, index, rows, tokenizer):
    generator = torch.Generator().manual_seed(100 * rank + index)
    words = torch.randint(3, len(tokenizer), (rows, 6), generator=generator)
    input_ids = torch.cat([torch.full((rows, 1), tokenizer.bos_token_id), words,
                           torch.full((rows, 1), tokenizer.eos_token_id)], dim=1)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "pixel_values": torch.randn(rows, 3, 32, 32, generator=generator, dtype=torch.float64)}


def _feature_cache_grads(rank, world_size):
    model, tokenizer = tiny_clip()
    batches = [micro_batch(rank, i, n, tokenizer) for i, n in enumerate(MICRO_SIZES[rank])]
    accelerator = make_accelerator(gradient_accumulation_steps=len(batches))
    prepared = accelerator.prepare(model)
    loss = grad_cache_backward(accelerator, prepared, batches, clip_loss)
    return loss, {name: p.grad.clone() for name, p in accelerator.unwrap_model(prepared).named_parameters()}


def big_batch_loss_and_grads(world_size):
    model, tokenizer = tiny_clip()
    parts = [micro_batch(rank, i, n, tokenizer) for rank in range(world_size) for i, n in enumerate(MICRO_SIZES[rank])]
    batch = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    images, texts, scale = model(**batch)
    logits = scale * images @ texts.T
    labels = torch.arange(len(logits))
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [1, 2])
def test_feature_cache_gives_the_big_batch_gradient(world_size):
    per_rank = run_on_ranks(_feature_cache_grads, world_size)
    ref_loss, ref_grads = big_batch_loss_and_grads(world_size)
    torch.testing.assert_close(torch.stack([loss for loss, _ in per_rank]).mean(), ref_loss, rtol=1e-10, atol=0)
    for loss, grads in per_rank:  # after DDP's averaging every rank holds the same gradient
        assert grads["logit_scale"].abs().item() > 1e-3  # the test exercises the scale's gradient
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name].reshape(ref.shape), ref, rtol=1e-7, atol=1e-12, msg=name)


def _dropout_replay_grads(rank, world_size, cached):
    """With dropout, the re-forward must reuse the cached forward's masks: compare against the
    same computation done with grad in one pass under the same RNG states."""
    model, tokenizer = tiny_clip(dropout=0.3)
    model.train()
    batches = [micro_batch(0, i, n, tokenizer) for i, n in enumerate(MICRO_SIZES[0])]
    accelerator = make_accelerator(gradient_accumulation_steps=len(batches))
    torch.manual_seed(1)
    if cached:
        grad_cache_backward(accelerator, model, batches, clip_loss)
    else:
        outputs = [model(**batch) for batch in batches]
        images, texts = torch.cat([o[0] for o in outputs]), torch.cat([o[1] for o in outputs])
        clip_loss(images, texts, outputs[-1][2]).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_feature_cache_replays_dropout_masks():
    cached = run_on_ranks(_dropout_replay_grads, 1, True)[0]
    direct = run_on_ranks(_dropout_replay_grads, 1, False)[0]
    for name, ref in direct.items():
        torch.testing.assert_close(cached[name], ref, rtol=1e-7, atol=1e-12, msg=name)
