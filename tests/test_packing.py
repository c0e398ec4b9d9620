"""Token-budget micro-batches and packed sequences (mmrecipes.vlm.rows.packing): a packed micro-batch equals its
samples run one by one on every family that packs, the ways of getting it wrong fail, budgets group
whole rows and resume exactly, and launched under every engine packing gives the losses of the same
token-budget batches padded. (The 2-rank gradient of packed windows: test_dummy_modality.py.)"""

import inspect
import re

import pytest
import torch
from accelerate.utils import set_seed
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from launch import VLM_RECIPE, assert_engine, assert_same_curves, run_engine
from mmrecipes.distributed import Ranks
from mmrecipes.images import to_device
from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.losses import token_cross_entropy_sum
from mmrecipes.vlm.model.outputs import Logits, LossSum
from mmrecipes.vlm.model.parts import check_packing, load_vlm
from mmrecipes.vlm.model.segments import apply_segment_aware_mixers
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import CHAT_COUNTED, build_chat_dataloader, encode_row
from mmrecipes.vlm.rows.collate import ChatCollator, probe_rows
from mmrecipes.vlm.rows.labels import AnswerLabeller

PACKING_FAMILIES = [None, "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl3", "idefics2", "idefics3",
                    "llava_onevision", "mistral3", "qwen3_vl_moe", "gemma4", "qwen3_5", "qwen3_5_moe"]  # None: Llava
# transformers' torch paths, under its kernel routing and any segment-aware dispatch
TORCH_RULE, TORCH_CONV = (inspect.unwrap(function) for function in (qwen3_5.torch_chunk_gated_delta_rule,
                                                                     qwen3_5.causal_conv1d_fn))


def load(tiny_vlms, family):
    """The model and its processor, linear attention's mixers made segment-aware as `vlm_parts` makes them."""
    set_seed(0)
    if family is None:
        return load_vlm(VLMModelArgs())
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])
    apply_segment_aware_mixers(model)
    return model, AutoProcessor.from_pretrained(tiny_vlms[family])


def rows_of(labeller):
    """Two images of different sizes and a text-only conversation, as collator rows."""
    rows = []
    for images, question, answer in (([Image.new("RGB", (32, 32), (200, 30, 30))], "What colour is it?", "red"),
                                     ([], "What comes after one?", "two"),
                                     ([Image.new("RGB", (64, 24), (30, 30, 200))], "What shape is it?", "circle")):
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        input_ids, labels, media_inputs = encode_row(labeller, messages, images)
        rows.append({"input_ids": input_ids, "labels": labels,
                     "media_inputs": media_inputs})
    return rows


@pytest.mark.parametrize("family", PACKING_FAMILIES)
@torch.no_grad()
def test_a_packed_micro_batch_equals_its_samples_one_by_one(tiny_vlms, family):
    """Logits and summed loss (float32), with images of two sizes and a text row, in one sequence and
    in two (the second padded); without restarted positions and separate attention the same rows
    give other logits."""
    model, processor = load(tiny_vlms, family)
    model.eval()
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    dummy_inputs = dummy_image_inputs(model, processor)
    rows = rows_of(labeller)
    step = VLMForTraining(model)
    alone = [step(to_device(ChatCollator(0, dummy_inputs)([row]), "cpu"), Logits()) for row in rows]
    alone_losses = [step(to_device(ChatCollator(0, dummy_inputs)([row]), "cpu"), LossSum()).summed for row in rows]
    lengths = [len(row["input_ids"]) for row in rows]
    for pack_length, sequences in ((None, [[0, 1, 2]]), (lengths[0] + lengths[1], [[0, 1], [2]])):
        batch = to_device(ChatCollator(0, dummy_inputs, packing=True, pack_length=pack_length)(rows),
                                  "cpu")
        packed_logits = step(batch, Logits())
        assert packed_logits.shape[0] == len(sequences)
        for index, sequence in enumerate(sequences):
            expected = torch.cat([alone[i] for i in sequence], dim=1)[0]
            torch.testing.assert_close(packed_logits[index, :len(expected)], expected, rtol=1e-5, atol=1e-5)
        loss = token_cross_entropy_sum(packed_logits, batch["labels"])
        torch.testing.assert_close(loss, sum(alone_losses), rtol=1e-5, atol=1e-5)
        # the training loss, in slices
        torch.testing.assert_close(step(batch, LossSum()).summed, loss, rtol=1e-5, atol=1e-5)
    packed = to_device(ChatCollator(0, dummy_inputs, packing=True)(rows), "cpu")
    packed_logits = step(packed, Logits())
    check_packing(model, labeller, dummy_inputs)

    one_sequence = {k: v for k, v in packed.items() if k not in ("sample_lengths", "media_per_sample")}
    # positions go on, attention crosses
    assert not torch.allclose(step(one_sequence, Logits()), packed_logits, atol=1e-3)
    crossing = model(input_ids=packed["input_ids"], attention_mask=packed["attention_mask"], use_cache=False,
                          position_ids=torch.cat([torch.arange(len(row["input_ids"])) for row in rows])[None],
                          **{k: v for k, v in packed.items() if k in ("mm_token_type_ids", "pixel_values",
                                                                      "image_grid_thw", "pixel_attention_mask",
                                                                      "image_sizes", "batch_num_images",
                                                                      "image_position_ids")}).logits
    assert not torch.allclose(crossing, packed_logits, atol=1e-3)  # positions restart, attention crosses


@pytest.mark.parametrize("family, reason", [
    ("gemma3", r"Gemma3ForConditionalGeneration does not keep packed samples apart \(its logits differ by [\d.]+ "
               r"from the samples run alone\)"),
    ("gemma4_moe", r"Gemma4ForConditionalGeneration does not keep packed samples apart"),
    ("qwen3_5", r"Qwen3_5ForConditionalGeneration does not keep packed samples apart \(its logits differ by [\d.]+ "
                r"from the samples run alone; its linear_attention layers \(Qwen3_5GatedDeltaNet\) carry their state "
                r"from one sample into the next: they do not pass each token's segment \(seq_idx\) on")])
def test_a_family_that_does_not_keep_packed_samples_apart_is_rejected(tiny_vlms, family, reason, monkeypatch):
    """Gemma 3 and Gemma 4 26B-A4B (image tokens attend bidirectionally, through token_type_ids or
    mm_token_type_ids) mix packed samples; so would a linear-attention layer that does not pass the tokens' segments
    on to its recurrence and convolution (a Qwen3.5 whose Gated DeltaNet drops them, as Kimi Linear's forwards no
    boundaries). `--packing` stops before the first step, names the layers where it can, and says what to do instead."""
    if family == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        forward = Qwen3_5GatedDeltaNet.forward
        monkeypatch.setattr(Qwen3_5GatedDeltaNet, "forward",
                            lambda self, *args, seq_idx=None, **kwargs: forward(self, *args, **kwargs))
    model, processor = load(tiny_vlms, family)
    with pytest.raises(ValueError, match="--packing: " + reason):
        check_packing(model, AnswerLabeller(processor, stop_token_ids(model, processor)),
                      dummy_image_inputs(model, processor))


@torch.no_grad()
def test_linear_attention_not_made_segment_aware_refuses_a_packed_batch_and_the_patch_is_listed(tiny_vlms,
                                                                                               monkeypatch):
    """Segment-aware packing is applied in one place (`vlm_parts`, which logs what it patched): a step built on a
    Qwen3.5 whose mixers were not made segment-aware refuses a packed batch, naming what to call, where it would
    otherwise hand `seq_idx` to transformers' own functions; once applied, the same batch runs."""
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):  # as before any run applied it
        monkeypatch.setattr(qwen3_5, name, transformers_routing(getattr(qwen3_5, name)))
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen3_5"]).eval()
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen3_5"])
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    batch = to_device(ChatCollator(0, dummy_image_inputs(model, processor), packing=True)(rows_of(labeller)), "cpu")
    step = VLMForTraining(model)
    with pytest.raises(ValueError, match=r"a packed batch through Qwen3_5GatedDeltaNet, whose "
                                         r"torch_chunk_gated_delta_rule and causal_conv1d_fn keep no sample "
                                         r"boundaries: call mmrecipes.vlm.model.segments.apply_segment_aware_mixers"):
        step(batch, Logits())
    applied = apply_segment_aware_mixers(model)
    module = "transformers.models.qwen3_5.modeling_qwen3_5"
    assert applied.wrapped == (f"{module}.torch_chunk_gated_delta_rule", f"{module}.causal_conv1d_fn")
    assert applied.describe() == (f"segment-aware packing: patched torch_chunk_gated_delta_rule, causal_conv1d_fn in "
                                  f"{module} (given each token's segment, they keep packed samples apart)")
    assert apply_segment_aware_mixers(model) == applied  # once: a second call wraps nothing again
    assert step(batch, Logits()).isfinite().all()
    assert apply_segment_aware_mixers(load_vlm(VLMModelArgs())[0]) is None  # no linear attention, nothing patched


def test_token_budget_batches_hold_whole_rows_and_resume_exactly():
    model, processor = load_vlm(VLMModelArgs())
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model))

    def loader(budget):
        args = ChatDataArgs(max_tokens_per_batch=budget, dataloader_num_workers=0, shuffle_buffer_size=64)
        return build_chat_dataloader(args, labeller, collator, batch_size=16, ranks=Ranks(), shuffle_seed=0)

    straight_loader, straight, states = loader(300), [], []
    for _, batch in zip(range(8), straight_loader):
        straight.append(batch)
        states.append(straight_loader.state_dict())
    assert len({batch["num_samples"] for batch in straight}) > 1  # the budget, not a row count, sets the micro-batch
    assert all(batch["attention_mask"].sum() <= 300 for batch in straight)
    small = [batch for _, batch in zip(range(4), loader(40))]
    assert all(batch["attention_mask"].sum() <= 40 for batch in small)
    assert sum(batch["data_counts"] for batch in small)[CHAT_COUNTED.index("too_long")] > 0  # rows over 40 tokens
    resumed_loader = loader(300)
    resumed_loader.load_state_dict(states[3])
    for expected, batch in zip(straight[4:], resumed_loader):
        assert torch.equal(batch["input_ids"], expected["input_ids"])


BUDGET = ["--max_steps", 6, "--logging_steps", 1, "--max_tokens_per_batch", 64, "--gradient_accumulation_steps", 2,
          "--eval_dataset_name", "", "--save_steps", 3, "--dataloader_num_workers", 1]
PACKED = ["fsdp2.yaml", "zero3.yaml"]  # DDP and ZeRO-2 pack the same way: tests/README.md


@pytest.fixture(scope="module")
def budget_runs(tmp_path_factory):
    """The default mixture at a 64-token budget (one or two rows a pack: some packs text-only): padded under DDP,
    packed under a sharded engine of each kind."""
    runs = {"padded": run_engine("ddp.yaml", *BUDGET, "--output_dir", tmp_path_factory.mktemp("padded"),
                                        recipe=VLM_RECIPE)}
    for config in PACKED:
        output_dir = tmp_path_factory.mktemp(f"packed_{config[:-5]}")
        runs[config] = run_engine(config, *BUDGET, "--packing", "true", "--output_dir", output_dir,
                                         recipe=VLM_RECIPE), output_dir
    return runs


@pytest.mark.launch
@pytest.mark.parametrize("config", PACKED)
def test_packing_under_every_engine_gives_the_losses_of_the_same_rows_padded(budget_runs, config):
    padded = budget_runs["padded"]
    assert padded.returncode == 0, padded.log[-3000:]
    result, _ = budget_runs[config]
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, config, wrapped="VLMForTraining")
    assert_same_curves(result.log, padded.log, range(1, 7), grad_norm=True)
    # Packs without any image ran the dummy, on some rank, in some step.
    assert sum(map(int, re.findall(r"\| dummy_image_batches (\d+)", result.log))) > 0


@pytest.mark.launch
def test_a_packed_token_budget_run_resumes_exactly(budget_runs, tmp_path):
    straight, output_dir = budget_runs["fsdp2.yaml"]
    resumed = run_engine("fsdp2.yaml", *BUDGET, "--packing", "true", "--output_dir", tmp_path,
                                "--resume_from_checkpoint", output_dir / "checkpoints" / "checkpoint-3",
                                recipe=VLM_RECIPE)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert "the data at its saved position in epoch 0" in resumed.log  # the last row of the last pack
    assert_same_curves(resumed.log, straight.log, [4, 5, 6], abs=1e-5)


def test_the_segment_aware_mixers_equal_each_sample_alone_in_values_and_gradients():
    """The chunked gated delta rule and the causal convolution on one packed row of six samples (1 token, over two
    chunks, exactly one chunk, ...) against transformers' own torch path run on each sample alone: outputs and the
    inputs' gradients to float32's rounding; the same row through transformers' path whole mixes the samples."""
    from mmrecipes.vlm.model.segments import segment_causal_conv1d, segment_chunk_gated_delta_rule, segment_ids

    rule, conv = TORCH_RULE, TORCH_CONV
    lengths = torch.tensor([1, 70, 5, 32, 3, 17])
    length, generator = int(lengths.sum()), torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, length, *shape, generator=generator, requires_grad=True)
              for shape in ((2, 8), (2, 8), (4, 6))]
    gates = [(-torch.rand(1, length, 4, generator=generator)).requires_grad_(),
             torch.rand(1, length, 4, generator=generator).requires_grad_()]
    signal = torch.randn(1, 12, length, generator=generator, requires_grad=True)
    weight = torch.randn(12, 4, generator=generator)
    segments = segment_ids(lengths, (1, length))
    packed = [segment_chunk_gated_delta_rule(*inputs, *gates, segments, chunk_size=32, use_qk_l2norm_in_kernel=True),
              segment_causal_conv1d(signal, weight, None, segments)]
    starts = [0, *lengths.cumsum(0).tolist()]
    parts = [slice(start, end) for start, end in zip(starts, starts[1:])]
    alone = [torch.cat([rule(*(x[:, part] for x in inputs), g=gates[0][:, part], beta=gates[1][:, part],
                             chunk_size=32, use_qk_l2norm_in_kernel=True)[0] for part in parts], dim=1),
             torch.cat([conv(signal[..., part], weight, None) for part in parts], dim=-1)]
    for got, expected in zip(packed, alone):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    leaves = [*inputs, *gates, signal]
    directions = [torch.randn(x.shape, generator=generator) for x in packed]
    grads = [torch.autograd.grad(sum((x * d).sum() for x, d in zip(outputs, directions)), leaves)
             for outputs in (packed, alone)]
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    leaky = rule(*inputs, g=gates[0], beta=gates[1], chunk_size=32, use_qk_l2norm_in_kernel=True)[0]
    assert not torch.allclose(leaky, alone[0], atol=1e-2)


def varlen_rule(query, key, value, g, beta, cu_seqlens=None, **kwargs):
    """flash-linear-attention's contract for `chunk_gated_delta_rule(..., cu_seqlens=)`, on CPU: one row, each span
    of `cu_seqlens` a sequence of its own (run here through transformers' torch path, span by span)."""
    if cu_seqlens is None:  # each row one sequence
        return TORCH_RULE(query, key, value, g=g, beta=beta, **kwargs)
    assert query.shape[0] == 1 and cu_seqlens[-1] == query.shape[1]
    KERNEL_CALLS.append(cu_seqlens.tolist())
    spans = [slice(start, end) for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    return torch.cat([TORCH_RULE(*(x[:, span] for x in (query, key, value)), g=g[:, span], beta=beta[:, span],
                           **kwargs)[0] for span in spans], dim=1), None


def seq_idx_conv(x, weight, bias=None, seq_idx=None, activation=None, **kwargs):
    """causal-conv1d's contract for `causal_conv1d_fn(..., seq_idx=)`, on CPU: int32 `[rows, length]` segments, a
    tap only within a token's segment (transformers' torch path, run by run)."""
    if seq_idx is None:
        return TORCH_CONV(x, weight, bias, activation=activation)
    assert seq_idx.dtype == torch.int32 and seq_idx.shape == (x.shape[0], x.shape[-1])
    KERNEL_CALLS.append("conv")
    rows = []
    for row, segments in zip(x, seq_idx):
        _, counts = torch.unique_consecutive(segments, return_counts=True)
        rows.append(torch.cat([TORCH_CONV(run[None], weight, bias, activation=activation)[0]
                               for run in row.split(counts.tolist(), dim=-1)], dim=-1))
    return torch.stack(rows)


KERNEL_CALLS = []


def transformers_routing(function):
    """transformers' kernel routing of a mixer function, under the segment-aware dispatch where a test wrapped it."""
    while getattr(function, "segment_aware", False):
        function = function.__wrapped__
    return function


@pytest.mark.parametrize("kernels", ["keep apart", "leak", "raise"])
def test_packed_qwen3_5_through_the_kernels_equals_its_samples_or_keeps_the_torch_path(tiny_vlms, kernels,
                                                                                      monkeypatch, caplog):
    """Where flash-linear-attention and causal-conv1d are installed (CUDA: here, CPU stands in for it), a packed
    batch gives them the segments their way (`cu_seqlens` over the rows laid end to end, int32 `seq_idx`): with
    kernels that honour them, packed logits equal the samples alone through the kernels. A kernel that leaks across
    a boundary (transformers' torch path ignoring them) or fails to run (transformers' own routing without the
    package: it raises) is found by a probe once per device and not used: the torch path keeps the samples apart,
    and the log says why."""
    from mmrecipes.vlm.model import segments

    if kernels != "raise":  # what transformers routes the layer's call to where the package is installed
        monkeypatch.setattr(qwen3_5, "torch_chunk_gated_delta_rule",
                            varlen_rule if kernels == "keep apart" else
                            lambda *args, cu_seqlens=None, **kwargs: TORCH_RULE(*args, **kwargs) if cu_seqlens is None
                            else (KERNEL_CALLS.append(cu_seqlens.tolist()), TORCH_RULE(*args, **kwargs))[1])
        monkeypatch.setattr(qwen3_5, "causal_conv1d_fn", seq_idx_conv)
    else:
        for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            monkeypatch.setattr(qwen3_5, name, transformers_routing(getattr(qwen3_5, name)))
    monkeypatch.setattr(segments, "kernel_installed", lambda package: True)
    monkeypatch.setattr(segments, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(segments, "_VERDICTS", {})
    KERNEL_CALLS.clear()
    model, processor = load(tiny_vlms, "qwen3_5")
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    with caplog.at_level("WARNING", logger="mmrecipes.vlm.model.segments"):
        check_packing(model, labeller, dummy_image_inputs(model, processor))  # packed logits = alone, or raises
    rule_calls = [call for call in KERNEL_CALLS if call != "conv"]
    conv_calls = len(KERNEL_CALLS) - len(rule_calls)
    layers = sum(layer == "linear_attention" for layer in model.config.text_config.layer_types)
    # the probe's call of each kernel, then one a layer of the packed forward where the probe found it keeps apart
    assert (len(rule_calls), conv_calls) == {"keep apart": (1 + layers, 1 + layers), "leak": (1, 1 + layers),
                                             "raise": (0, 0)}[kernels]
    if kernels == "keep apart":
        lengths = [len(row["input_ids"]) for row in probe_rows(labeller)]
        assert rule_calls[-1] == [0, *torch.tensor(lengths).cumsum(0).tolist()]
        assert not caplog.records
    else:
        why = "differs by" if kernels == "leak" else "raised ValueError"
        assert [record.getMessage() for record in caplog.records if why in record.getMessage()], caplog.text
        assert "the torch path keeps the samples apart instead" in caplog.text


def test_a_bfloat16_call_is_probed_in_bfloat16_so_a_kernel_without_float32_runs(monkeypatch):
    """fla's chunked rule takes no float32 queries (it asserts so): the probe takes the dtypes of the layer's call
    (bfloat16 queries, keys, values and write strengths, float32 decays, as Qwen3.5's layer gives them), so a
    bfloat16 run uses the kernel, within bfloat16's rounding of the samples kept apart in float32."""
    from mmrecipes.vlm.model import segments

    def fla_like(query, key, value, g, beta, cu_seqlens=None, **kwargs):
        assert query.dtype != torch.float32, "ChunkGatedDeltaRuleFunction does not support float32"
        return varlen_rule(query, key, value, g, beta, cu_seqlens=cu_seqlens, **kwargs)

    monkeypatch.setattr(segments, "kernel_installed", lambda package: True)
    monkeypatch.setattr(segments, "KERNEL_DEVICES", ("cpu",))
    monkeypatch.setattr(segments, "_VERDICTS", {})
    KERNEL_CALLS.clear()
    rule = segments.MIXERS["torch_chunk_gated_delta_rule"]
    dispatch = segments._dispatching("torch_chunk_gated_delta_rule", fla_like, rule)
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, 96, 2, 8, generator=generator).bfloat16() for _ in range(3))
    g, beta = -0.1 * torch.rand(2, 96, 2, generator=generator), torch.rand(2, 96, 2, generator=generator).bfloat16()
    segments_of = segments.segment_ids(torch.tensor([40, 56, 5, 91]), (2, 96))
    out, _ = dispatch(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=None, seq_idx=segments_of)
    assert [call[:3] for call in KERNEL_CALLS] == [[0, 1, 71], [0, 40, 96]]  # the probe's call, then this one
    expected = rule.torch_path(*(x.float() for x in (query, key, value, g, beta)), segments=segments_of,
                               use_qk_l2norm_in_kernel=True)[0]
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max() <= 2e-2 * expected.abs().max()
