"""The dummy-modality step and token-loss normalisation, on two VLM families (Llava, Qwen2-VL),
in one process and on 2 gloo ranks under DDP without find_unused_parameters."""

import pytest
import torch
from accelerate.utils import set_seed
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from gloo import run_on_ranks
from mmrecipes.distributed import token_loss_scale
from mmrecipes.vlm.arguments import VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.losses import head_cross_entropy_sum, token_cross_entropy_sum
from mmrecipes.vlm.model.module_groups import apply_train_modules, module_groups
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, count_target_tokens
from recipe_without_dummy import SkipsTowerOnTextOnly

USER = 3  # any ordinary token id


def tiny_llava():
    """Every part trainable (the vision tower too), less what no path reaches (as the recipe does)."""
    model, _ = load_vlm(VLMModelArgs())
    groups = module_groups(model, dummy_image_inputs(model))
    assert groups.unreached == ["model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"]
    apply_train_modules(groups, "all")
    return model


def tiny_qwen2_vl():
    config = Qwen2VLConfig(
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3),
        text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63,
        bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return Qwen2VLForConditionalGeneration(config)


FAMILIES = {"llava": tiny_llava, "qwen2_vl": tiny_qwen2_vl}


def row(model, targets: int, image: bool, generator):
    """A collator row: a prompt (with the model's image tokens if `image`), then `targets` answer tokens."""
    config = model.config
    vocab = config.text_config.vocab_size
    words = lambda n: torch.randint(4, min(vocab, 60), (n,), generator=generator).tolist()  # noqa: E731
    image_tokens, media_inputs = [], {}
    if image:
        if hasattr(config.vision_config, "spatial_merge_size"):  # Qwen2-VL: a 4x4 patch grid = 4 tokens
            grid = torch.tensor([[1, 4, 4]])
            image_tokens = [config.vision_start_token_id] + [config.image_token_id] * 4 + [config.vision_end_token_id]
            media_inputs = {"pixel_values": torch.randn(16, 3 * 2 * 4 * 4, generator=generator), "image_grid_thw": grid}
        else:  # Llava: (32/8)^2 patch tokens
            image_tokens = [config.image_token_id] * 16
            media_inputs = {"pixel_values": torch.randn(1, 3, 32, 32, generator=generator)}
    prompt = [USER] + image_tokens + words(5)
    input_ids = torch.tensor(prompt + words(targets))
    if "image_grid_thw" in dummy_image_inputs(model):
        media_inputs["mm_token_type_ids"] = (input_ids == config.image_token_id).long()
    labels = torch.cat([torch.full((len(prompt),), IGNORE_INDEX), input_ids[len(prompt):]])
    return {"input_ids": input_ids, "labels": labels, "media_inputs": media_inputs}


def collate(model, rows, packing=False):
    return ChatCollator(0, dummy_image_inputs(model), packing=packing)(rows)


def inputs(batch):
    return {key: value for key, value in batch.items() if key != "data_counts"}


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_gives_exact_zero_vision_gradients_and_changes_nothing_else(family):
    set_seed(0)
    model = FAMILIES[family]()
    generator = torch.Generator().manual_seed(0)
    batch = collate(model, [row(model, 4, image=False, generator=generator) for _ in range(2)])
    assert batch["dummy_image"]
    summed = VLMForTraining(model)(inputs(batch), LossSum()).summed
    summed.backward()
    with_dummy = {name: p.grad.clone() if p.grad is not None else None for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    text_inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "mm_token_type_ids") if key in batch}
    # The wrapper's own loss (sliced, from the hidden states), without the vision step and the dummy.
    plain = head_cross_entropy_sum(model.base_model(**text_inputs, use_cache=False)[0], model.get_output_embeddings(),
                                   batch["labels"])
    plain.backward()
    assert torch.equal(summed, plain)  # the slice adds exactly nothing
    torch.testing.assert_close(plain, token_cross_entropy_sum(model(**text_inputs).logits, batch["labels"]))
    vision_step = 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:  # not reached by the LM: the vision step's parameters
            assert with_dummy[name] is not None and not with_dummy[name].any(), name
            vision_step += 1
        else:
            assert torch.equal(with_dummy[name], param.grad), name
    assert vision_step > 10  # the text-only forward alone leaves the tower and projector without gradients


def _ddp_mixed_steps(rank, world_size, family, wrapper_class):
    """Rank 0 trains on image batches, rank 1 on text-only ones: two steps under DDP."""
    set_seed(0)
    model = FAMILIES[family]()
    generator = torch.Generator().manual_seed(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(wrapper_class(model))  # find_unused_parameters=False
    for _ in range(2):
        ddp(inputs(collate(model, [row(model, 3, image=rank == 0, generator=generator)])), LossSum()).summed.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", FAMILIES)
def test_ddp_with_text_only_rank_runs_with_the_dummy_and_fails_without(family):
    grads = run_on_ranks(_ddp_mixed_steps, 2, family, VLMForTraining)
    for name, grad in grads[0].items():
        assert grad is not None and torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, grads[1][name], msg=name)  # DDP averaged every parameter
    with pytest.raises(Exception,
                       match="Expected to have finished reduction|Connection (closed|reset) by peer|doesn't match"):
        run_on_ranks(_ddp_mixed_steps, 2, family, SkipsTowerOnTextOnly)


# Token-loss normalisation: 2 ranks x 2 micro-batches with very different target-token counts.
WINDOW = {0: [(1, 2, True), (3, 30, False)], 1: [(2, 5, False), (1, 50, True)]}  # (rows, targets each, image)


def window_rows(model, rank):
    generator = torch.Generator().manual_seed(100 + rank)
    return [[row(model, targets, image, generator) for _ in range(rows)] for rows, targets, image in WINDOW[rank]]


def _accelerate_window(rank, world_size, normalisation):
    """One optimizer step's gradients, accumulated over this rank's 2 micro-batches by accelerate (DDP)."""
    from mmrecipes.distributed import make_accelerator, sum_over_ranks

    set_seed(0)
    model = tiny_llava()
    accelerator = make_accelerator(gradient_accumulation_steps=2)
    ddp = accelerator.prepare(VLMForTraining(model))
    # Packed: each micro-batch one sequence; the ranks' micro-batches hold 1 and 3, 2 and 1 rows.
    window = [collate(model, rows, packing=normalisation == "token_packed") for rows in window_rows(model, rank)]
    window_tokens = sum_over_ranks(torch.tensor(float(sum(count_target_tokens(b["labels"]) for b in window))))
    for batch in window:
        with accelerator.accumulate(ddp):
            summed = ddp(inputs(batch), LossSum()).summed
            if normalisation in ("token", "token_packed"):
                accelerator.backward(summed * token_loss_scale(window_tokens, 2, world_size))
            else:  # the per-micro-batch mean most loops compute
                accelerator.backward(summed / count_target_tokens(batch["labels"]))
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("normalisation", ["token", "token_packed", "per_micro_batch_mean"])
def test_window_gradient_is_the_token_mean_of_one_big_batch(normalisation):
    """The gradient must equal (1/N) grad(sum CE) over the concatenated window of both ranks, also
    with each micro-batch packed into one sequence (rows counts differ between ranks and steps); the
    per-micro-batch mean weights a 2-token micro-batch like a 90-token one, and must fail."""
    set_seed(0)
    model = tiny_llava()
    everything = [r for rank in WINDOW for rows in window_rows(model, rank) for r in rows]
    batch = collate(model, everything)
    (VLMForTraining(model)(inputs(batch), LossSum()).summed / count_target_tokens(batch["labels"])).backward()
    truth = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    grads = run_on_ranks(_accelerate_window, 2, normalisation)[0]
    assert set(grads) == set(truth)
    # Relative to the largest gradient anywhere: attention key biases have a true gradient of 0
    # (softmax ignores them), so their own relative error is rounding noise over noise.
    scale = max(truth[n].abs().max() for n in truth)
    worst = (max((grads[n] - truth[n]).abs().max() for n in truth) / scale).item()
    if normalisation != "per_micro_batch_mean":
        assert worst < 1e-5
    else:
        assert worst > 0.05
