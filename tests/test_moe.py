"""Mixture-of-experts VLMs (data_prep/tiny_vlm_2026.py: Qwen3-VL-MoE, Qwen3.5-MoE; 4 experts, 2 per token), in process:
the load-balancing loss equals the model's own on the same micro-batch, counts real tokens only under packing, and
over 2 gloo ranks x 2 micro-batches (and split over a sequence-parallel group of 2) gives one process's loss and
gradients in both scopes; the sparse blocks are found from the model."""

from contextlib import nullcontext

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from gloo import run_on_ranks
from mmrecipes.distributed import Ranks, token_loss_scale
from mmrecipes.images import to_device
from mmrecipes.vlm.arguments import MoEArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.moe import LoadBalance, Routing, balance_loss, sparse_block_classes
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.segments import apply_segment_aware_mixers
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from test_family_conformance import collator_row

MOE_FAMILIES = ["qwen3_vl_moe", "qwen3_5_moe"]
COEF = 0.5  # large, so that the balance term moves the gradients visibly


def conversation(question, answer, image=False):
    content = [{"type": "image"}] * image + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def rows(processor, model):
    """Four rows: two with an image of its own colour, two text-only, of different lengths."""
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    specs = [("What colour is it?", "red", (220, 30, 30)), ("Name a colour.", "blue", None),
             ("Which colour comes after red in a rainbow?", "orange, then yellow", None),
             ("And this one?", "green", (30, 200, 30))]
    return [collator_row(labeller, conversation(question, answer, colour is not None),
                         [Image.new("RGB", (32, 32), colour)] if colour else []) for question, answer, colour in specs]


def load(directory):
    """The model (linear attention's mixers made segment-aware, as `vlm_parts` makes them) and its processor."""
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(directory)
    apply_segment_aware_mixers(model)
    return model, AutoProcessor.from_pretrained(directory)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_aux_loss_is_the_models_own_on_the_same_micro_batch_over_real_tokens(tiny_vlms, family):
    """The micro-batch scope's aux = `forward(..., output_router_logits=True).aux_loss` on a padded batch of an image
    row and a text row; the routers are found from the model (its sparse blocks hold them); on a packed batch (pad at
    the end of the second sequence, and no mask given to the model) the aux counts the real tokens only: the padded
    batch's. A checkpoint whose config gives a coefficient says so, and the loss is off until asked for."""
    model, processor = load(tiny_vlms[family])
    assert {cls.__name__ for cls in sparse_block_classes(model)} == {
        "qwen3_vl_moe": {"Qwen3VLMoeTextSparseMoeBlock"}, "qwen3_5_moe": {"Qwen3_5MoeSparseMoeBlock"}}[family]
    model.eval()
    dummy = dummy_image_inputs(model, processor)
    step = VLMForTraining(model)
    batch_rows = rows(processor, model)[:2]
    padded = to_device(ChatCollator(processor.tokenizer.pad_token_id, dummy)(batch_rows), "cpu")
    routed = step(padded, Routing(2))
    own = model(**{name: value for name, value in padded.items() if name in step.forward_input_names - {"labels"}},
                output_router_logits=True)
    torch.testing.assert_close(balance_loss(*routed), own.aux_loss, rtol=1e-5, atol=1e-6)
    line = LoadBalance.of(model, MoEArgs(), 1, Ranks()).line
    assert "4 experts, 2 per token; load-balancing loss off" in line and "--router_aux_loss_coef 0.001" in line
    packed = to_device(ChatCollator(0, dummy, packing=True, pack_length=len(batch_rows[0]["input_ids"]) + 1)(
        batch_rows), "cpu")
    assert not packed["attention_mask"].all()  # the second sequence is padded
    packed_routed = step(packed, Routing(2))
    torch.testing.assert_close(balance_loss(*packed_routed), balance_loss(*routed), rtol=1e-5, atol=1e-6)


def test_a_model_without_experts_or_without_a_balancing_loss_refuses_the_coefficient(tiny_vlms):
    """Qwen3.5 has no experts; Gemma 4 26B-A4B's config defines no load-balancing loss (its router's recorded output
    is already a probability, and it has no router_aux_loss_coef): both refuse a coefficient, and the MoE says it
    adds none. Its sparse block, the decoder layer holding router and experts, is still found."""
    model, _ = load(tiny_vlms["qwen3_5"])
    off = LoadBalance.of(model, MoEArgs(), 1, Ranks())
    assert not off.on and off.line == "" and off.window_sums() == {} and off.metrics({}) == {}
    with pytest.raises(ValueError, match="--router_aux_loss_coef 0.01: Qwen3_5ForConditionalGeneration has no experts"):
        LoadBalance.of(model, MoEArgs(router_aux_loss_coef=0.01), 1, Ranks())
    gemma, _ = load(tiny_vlms["gemma4_moe"])
    assert {cls.__name__ for cls in sparse_block_classes(gemma)} == {"Gemma4TextDecoderLayer"}
    assert LoadBalance.of(gemma, MoEArgs(), 1, Ranks()).line.endswith("defines no load-balancing loss; none is added")
    with pytest.raises(ValueError, match="Gemma4ForConditionalGeneration's config defines no load-balancing loss"):
        LoadBalance.of(gemma, MoEArgs(router_aux_loss_coef=0.01), 1, Ranks())


def _window(model, processor, batches, balance, world, ddp=None):
    """One optimizer step's gradients as the recipe makes them: each micro-batch's summed CE times
    `token_loss_scale` plus the balance term, divided by the accumulation steps (accelerate's backward), DDP
    averaging over ranks on the last micro-batch. Returns (gradients, [the logged aux's sum over the window, what it
    is divided by])."""
    step = ddp or VLMForTraining(model)
    local_tokens = torch.tensor(float(sum(batch["target_tokens"] for batch in batches)))
    tokens = local_tokens.clone()
    if world > 1:
        torch.distributed.all_reduce(tokens)
    scale = token_loss_scale(tokens, len(batches), world)
    balance = balance or LoadBalance()  # off: the plain CE
    balance.start_window(step, batches, "cpu")
    output = LossSum(balance)
    for index, batch in enumerate(batches):
        syncing = ddp.no_sync() if ddp is not None and index < len(batches) - 1 else nullcontext()
        with syncing:
            summed, extra = step(to_device(batch, "cpu"), output)
            ((summed * scale + extra) / len(batches)).backward()
    sums = balance.window_sums()
    logged = torch.tensor([float(sums["aux"]), sums["aux_batches"]]) if balance.on else torch.zeros(2)
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}, logged


def _two_ranks(rank, world_size, directory, scope):
    from torch.nn.parallel import DistributedDataParallel

    model, processor = load(directory)
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    mine = rows(processor, model)[2 * rank:2 * rank + 2]
    balance = LoadBalance(num_experts=4, top_k=2, coef=COEF, scope=scope, accumulation=2,
                          ranks=Ranks(data_world=world_size))
    grads, logged = _window(model, processor, [collator([row]) for row in mine], balance, world_size,
                            ddp=DistributedDataParallel(VLMForTraining(model)))
    torch.distributed.all_reduce(logged)
    return grads, float(logged[0] / logged[1])


def _one_group_of_two(rank, world_size, directory, scope):
    """The window's four micro-batches on both ranks, each sequence split over the two (sequence parallelism)."""
    from torch.nn.parallel import DistributedDataParallel

    from mmrecipes.vlm.parallel.sequence_parallel import SequenceParallel

    model, processor = load(directory)
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    split = SequenceParallel(model, world_size)
    balance = LoadBalance(num_experts=4, top_k=2, coef=COEF, scope=scope, accumulation=4,
                          ranks=Ranks(data_world=1, split=split, replicas=world_size))
    grads, logged = _window(model, processor, [collator([row]) for row in rows(processor, model)], balance, 1,
                            ddp=DistributedDataParallel(VLMForTraining(model, split)))
    torch.distributed.all_reduce(logged)
    return grads, float(logged[0] / logged[1])


@pytest.mark.parametrize("scope", ["global_batch", "micro_batch"])
def test_two_ranks_of_two_micro_batches_give_one_process_holding_the_window(tiny_vlms, scope):
    """The window's four micro-batches on 2 gloo ranks x 2 accumulation steps, CE and balance term together, give the
    gradients of one process computing the window's loss at once: the token-mean CE plus COEF x the aux over all
    four (global_batch: one f and P over every real token; micro_batch: the mean of the four micro-batches' own). The
    logged aux is that process's. So do the four micro-batches split over a sequence-parallel group of 2 ranks (each
    rank routes its shard; the parts summed over the group). Without the term the gradients differ (the old run: no
    balance at all)."""
    directory = tiny_vlms["qwen3_vl_moe"]
    model, processor = load(directory)
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    batches = [collator([row]) for row in rows(processor, model)]
    step = VLMForTraining(model)
    tokens = sum(batch["target_tokens"] for batch in batches)
    parts = [(step(to_device(batch, "cpu"), LossSum()).summed, step(to_device(batch, "cpu"), Routing(2)))
             for batch in batches]
    if scope == "global_batch":
        aux = balance_loss(*(sum(part[1][i] for part in parts) for i in range(3)))
    else:
        aux = sum(balance_loss(*part[1]) for part in parts) / len(parts)
    (sum(part[0] for part in parts) / tokens + COEF * aux).backward()
    expected = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}

    ranks = run_on_ranks(_two_ranks, 2, directory, scope) + run_on_ranks(_one_group_of_two, 2, directory, scope)
    for grads, logged in ranks:
        assert logged == pytest.approx(float(aux.detach()), rel=1e-5)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    model, processor = load(directory)
    without, _ = _window(model, processor, batches, None, 1)
    router = next(name for name in expected if name.endswith("mlp.gate.weight"))
    assert not torch.allclose(without[router], expected[router], rtol=1e-3, atol=1e-6)
