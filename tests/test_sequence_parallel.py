"""Ulysses sequence parallelism (`--sequence_parallel_size`, mmrecipes.vlm.parallel.sequence_parallel) against one
process holding the whole sequence.

- In process, on 2 gloo ranks: for each family that splits, a batch of an image row and a shorter text row (padding
  inside it) gives, summed over the 2 shards, the whole sequence's loss and gradients; the old failures (Gemma 3's and
  4's masks dropped, a Gated DeltaNet run on each shard) really differ, and the rule says why it refuses. On 4 ranks:
  Qwen2.5-VL's 2 key/value heads replicated, Qwen3.5's Gated DeltaNet with 4 key heads, Gemma 4 26B-A4B's layout.
- Launched: vlm_finetune.py at sp=2 on 2 ranks equals one process (loss, gradient norm, weights after 2 steps) for
  the tiny Llava under ZeRO-3, for Qwen2.5-VL (mRoPE) with image, text-only and video rows under FSDP2, for
  Qwen3.5-MoE (Gated DeltaNet head-parallel, its balance loss) and Gemma 4 with those rows under ZeRO-3, Gemma 3
  under DDP (each family once, each engine at least once: features across engines, not a matrix; DPO, GRPO and
  distillation split under DDP too); DPO and GRPO on Qwen3.5 (its dense Gated DeltaNet layers) and Gemma 4; dp=2 x
  sp=2 on 4 ranks (ZeRO-2) equals
  one process holding both replicas' window.
"""

import re
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from gloo import averaged_difference, run_on_ranks, taken_gradients
from helpers import chat_row, tiny, write_chat_parquet
from launch import (
    HELD_OUT_64,
    VLM_RECIPE,
    assert_adam_weights_close,
    assert_engine,
    assert_same_curves,
    losses,
    metric,
    run_engine,
    run_recipe,
)
from mmrecipes.arguments import TrainingArgs
from mmrecipes.config import parse_args
from mmrecipes.images import to_device
from mmrecipes.paths import VLM_SHAPES
from mmrecipes.saved_models import trained_class
from mmrecipes.vlm.arguments import ChatDataArgs, MoEArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.module_groups import apply_train_modules
from mmrecipes.vlm.model.outputs import Logits, LossSum, SequenceLogps, TokenLogps
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.parallel import sequence_parallel
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from test_family_conformance import collator_row, colour_conversation, square

# every family the rule lets split (Qwen3-VL: deepstack features; Qwen3-VL-MoE: experts, no balancing loss; Qwen3.5:
# Gated DeltaNet layers, head-parallel; Gemma 3 and 4: sliding windows and image tokens attending both ways, through
# the whole sequence's masks; Gemma 4: per-layer embeddings, KV shared between layers)
SPLITS = ["llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "idefics2",
          "idefics3", "internvl3", "mistral3", "qwen3_5", "qwen3_5_think", "qwen3_5_moe", "gemma3", "gemma4",
          "gemma4_moe", "qwen2_5_omni", "qwen3_omni_moe"]
MASKED = ["gemma3", "gemma4", "gemma4_moe"]  # whose layers need their masks


def _shards_against_whole(rank, world_size, directories, forced):
    """{family: (whole loss, the split loss, the largest gradient difference relative to the largest gradient, the
    largest differences of the token and row log-probabilities)}: the same batch through the model whole, then split
    over the 2 ranks."""
    results = {}
    text = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "blue"}]}]
    if forced:
        sequence_parallel.refusal = lambda model, size: None
    if forced == "on shards":  # linear attention as before: the recurrence and its convolution on each shard
        sequence_parallel.mixer_layers = lambda model: []
    if forced == "causal":  # as before: every layer causal over the gathered sequence, the model's masks dropped
        sequence_parallel.needs_masks = lambda model: False
    for family, directory in directories.items():
        torch.manual_seed(0)
        model, processor, groups = tiny(directory)
        apply_train_modules(groups, "all")
        labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
        collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
        batch = to_device(collator([collator_row(labeller, colour_conversation("red"), [square("red")]),
                                    collator_row(labeller, text, [])]), "cpu")
        step = VLMForTraining(model)
        whole_logps = [step(batch, TokenLogps(0.7)), step(batch, SequenceLogps())]
        whole = VLMForTraining(model)(batch, LossSum()).summed
        whole.backward()
        truth = taken_gradients(model)
        split = sequence_parallel.SequenceParallel(model, 2)
        step = VLMForTraining(model, split)
        logps = [step(batch, TokenLogps(0.7)), step(batch, SequenceLogps())]
        summed = step(batch, LossSum()).summed  # the whole sequence's, on both ranks
        summed.backward()
        worst = averaged_difference(model, truth, 2)  # each shard got its gradient twice: once from each rank's loss
        results[family] = (whole.item(), summed.item(), worst,
                           *[(one - other).abs().max().item() for one, other in zip(whole_logps, logps)])
    return results


def _four_ways(rank, world_size, directory):
    """(loss difference, gradient difference relative to the largest gradient, whole-sequence logits difference after
    the split) of a batch split over 4 ranks of a model whose attention has 2 key/value heads: DeepSpeed replicates
    them, and an unsplit forward afterwards still needs them as they were."""
    torch.manual_seed(0)
    model, processor, groups = tiny(directory)
    apply_train_modules(groups, "all")
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    batch = to_device(collator([collator_row(labeller, colour_conversation("red"), [square("red")])]), "cpu")
    step = VLMForTraining(model)
    logits = step.eval()(batch, Logits())
    whole = step.train()(batch, LossSum()).summed
    whole.backward()
    truth = taken_gradients(model)
    split = VLMForTraining(model, sequence_parallel.SequenceParallel(model, world_size))
    summed = split(batch, LossSum()).summed
    summed.backward()
    worst = averaged_difference(model, truth, world_size)
    after = split.eval()(batch, Logits())
    return abs(summed.item() - whole.item()), worst, (after - logits).abs().max().item()


def wider_linear_attention(directory, output_dir):
    """The tiny Qwen3.5 (or its MoE) with 4 key and 8 value heads in its Gated DeltaNet: what sp=4 needs."""
    config = AutoConfig.from_pretrained(directory)
    config.text_config.linear_num_key_heads, config.text_config.linear_num_value_heads = 4, 8
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(output_dir)
    AutoProcessor.from_pretrained(directory).save_pretrained(output_dir)
    return output_dir


def test_four_ranks_replicate_the_key_value_heads_and_leave_them_as_they_were(tiny_vlms, tmp_path):
    """Qwen2.5-VL (4 heads, 2 key/value heads), Qwen3.5 with 4 key heads in its Gated DeltaNet, and Gemma 4 26B-A4B's
    layout (sliding windows over a 70-token image whose tokens attend both ways) at sp=4."""
    qwen3_5 = wider_linear_attention(tiny_vlms["qwen3_5"], tmp_path / "qwen3_5")
    assert sequence_parallel.refusal(tiny(qwen3_5)[0], 4) is None
    for directory in [tiny_vlms["qwen2_5_vl"], qwen3_5, tiny_vlms["gemma4_moe"]]:
        loss, grads, logits = run_on_ranks(_four_ways, 4, directory)[0]
        assert loss < 1e-4 and grads < 1e-5 and logits < 1e-5, (directory.name, loss, grads, logits)


def test_the_rule_lets_exactly_the_tested_families_split(tiny_vlms):
    """Every tiny family: split where the shards are tested against the whole sequence, refused elsewhere."""
    refusals = {family: sequence_parallel.refusal((trained_class(AutoConfig.from_pretrained(directory)))
                                                  .from_pretrained(directory), 2)
                for family, directory in tiny_vlms.items()}
    assert {family for family, why in refusals.items() if why is None} == set(SPLITS)
    assert refusals["qwen2_audio"].startswith("it only hears") and refusals["voxtral"].startswith("it only hears")


@pytest.fixture(scope="module")
def directories(tiny_vlms):
    return {family: None if family == "llava" else tiny_vlms[family] for family in SPLITS}


def test_the_shards_sum_to_the_whole_sequence_for_each_family_that_splits(directories):
    results = run_on_ranks(_shards_against_whole, 2, {family: directories[family] for family in SPLITS}, False)[0]
    for family, (whole, summed, worst, tokens, rows) in results.items():
        assert summed == pytest.approx(whole, rel=1e-5), family
        assert worst < 1e-5, family
        assert tokens < 1e-5 and rows < 1e-4, family  # GRPO's and DPO's outputs, gathered over the group


def test_the_old_failures_differ_and_the_rule_says_why_it_refuses(directories, monkeypatch):
    """The old failures: Gemma 3's and 4's layers attending causally over the gathered sequence (their masks dropped,
    as before), and Qwen3.5's recurrence run on each shard (what head-parallel linear attention replaced), give other
    gradients split; the rule refuses a linear-attention layer that cannot run head-parallel, or whose heads do not
    split, a size that does not divide the heads, and eager attention (which is not causal without a mask)."""
    forced = run_on_ranks(_shards_against_whole, 2, {family: directories[family] for family in MASKED}, "causal")[0]
    forced |= run_on_ranks(_shards_against_whole, 2, {"qwen3_5": directories["qwen3_5"]}, "on shards")[0]
    for family, (whole, summed, worst, *_) in forced.items():
        # the gradients differ a thousand times beyond what the families that split pass (Gemma 3: 3e-2, its loss by
        # 5e-7 only; Gemma 4: 0.4; Gemma 4 MoE: 1.1; Qwen3.5: 7e-3)
        assert worst > 1e-3, (family, whole, summed, worst)
    assert all(sequence_parallel.needs_masks(tiny(directories[family])[0]) for family in MASKED)
    assert not sequence_parallel.needs_masks(tiny(directories["qwen3_5"])[0])
    qwen3_5 = tiny(directories["qwen3_5"])[0]  # 2 key heads, 4 value heads in its Gated DeltaNet
    assert "2 key heads and 4 value heads do not split over 4 ranks" in sequence_parallel.refusal(qwen3_5, 4)
    monkeypatch.setattr(sequence_parallel, "parallel_layer", lambda layer: False)
    assert "linear_attention layers (Qwen3_5GatedDeltaNet) carry a state" in sequence_parallel.refusal(qwen3_5, 2)
    llava = tiny()[0]
    assert "do not split over 8 ranks" in sequence_parallel.refusal(llava, 8)  # 4 heads
    llava.set_attn_implementation("eager")
    assert "eager attention is not causal without its mask" in sequence_parallel.refusal(llava, 2)


def test_the_whole_sequence_masks_pad_so_that_no_real_token_sees_the_padding():
    """A mask the model built for 3 tokens, extended to 4: the padding attends itself only (no NaN), no real token
    attends it, the rest as built; bool, additive and padding masks; a mask the split cannot extend is refused."""
    built = torch.tensor([[True, False, False], [True, True, True], [False, True, True]])[None, None]
    padded = sequence_parallel.whole_sequence_mask(built, 3, 4)
    assert padded[0, 0].tolist() == [[True, False, False, False], [True, True, True, False],
                                     [False, True, True, False], [False, False, False, True]]
    additive = sequence_parallel.whole_sequence_mask(torch.where(built, 0.0, -1e9), 3, 4)
    assert torch.equal(additive == 0, padded) and additive.min() == torch.finfo(torch.float32).min
    padding = sequence_parallel.whole_sequence_mask(torch.ones(2, 3, dtype=torch.long), 3, 4)
    assert padding.tolist() == [[1, 1, 1, 0]] * 2
    assert sequence_parallel.whole_sequence_mask(None, 3, 4) is None
    with pytest.raises(RuntimeError, match=r"a mask of shape \(1, 1, 1, 3\) for a sequence of 3 tokens"):
        sequence_parallel.whole_sequence_mask(built[:, :, :1], 3, 4)
    masks = sequence_parallel.whole_sequence_masks({"sliding_attention": built, "full_attention": None}, 3, 4)
    assert torch.equal(masks["sliding_attention"], padded) and masks["full_attention"] is None
    with pytest.raises(RuntimeError, match="need the whole sequence's masks by layer type, and it was given none"):
        sequence_parallel.whole_sequence_masks(torch.ones(1, 3), 3, 4)


STEPS = 2
COMMON = ["--max_steps", STEPS, "--logging_steps", 1, "--per_device_train_batch_size", 2,
          "--gradient_accumulation_steps", 2, "--eval_steps", STEPS, "--eval_generation_rows", 4, "--ddp_timeout", 120]
WITH_VIDEO = ["--dataset_name", ",".join(str(VLM_SHAPES / name) for name in ("image_chat", "text_chat", "video_chat")),
              "--dataset_weights", "0.5,0.25,0.25"]
# Gemma 4 E2B hears: a micro-batch of its 4 holds sounds, the others the dummy sound, in the split sequence (the audio
# tower runs whole on every rank, before the split). Its clips are counted, not trained (no video path here).
WITH_SOUNDS = ["--dataset_name", ",".join(str(VLM_SHAPES / name) for name in ("image_chat", "text_chat", "audio_chat")),
               "--dataset_weights", "0.5,0.25,0.25"]
SP = ["--sequence_parallel_size", 2]
BALANCED = ["--router_aux_loss_coef", 0.01, "--router_aux_loss_scope", "global_batch"]  # summed over the group


def assert_same_run(result, truth, output_dir, truth_dir, config, processes=2, logged=range(1, STEPS + 1),
                    learning_rate=1e-3, rel=1e-5):
    assert result.returncode == 0, result.log[-3000:]
    line = result.log.replace(f"num_processes={processes} backend=gloo world_size={processes}",
                              "num_processes=2 backend=gloo world_size=2")
    assert_engine(line, config, wrapped="VLMForTraining")
    assert "sequence parallel: each sequence split over 2 ranks" in result.log
    assert_same_curves(result.log, truth.log, logged, rel=rel, grad_norm=True)
    assert_adam_weights_close(load_file(output_dir / "model.safetensors"), load_file(truth_dir / "model.safetensors"),
                              learning_rate=learning_rate, steps=max(logged))


@pytest.mark.launch
@pytest.mark.parametrize("family, config, extra", [("llava", "zero3.yaml", []),
                                                   ("qwen2_5_vl", "fsdp2.yaml", WITH_VIDEO),
                                                   ("qwen3_5_moe", "zero3.yaml", [*WITH_VIDEO, *BALANCED]),
                                                   ("gemma3", "ddp.yaml", []),
                                                   ("gemma4", "zero3.yaml", WITH_SOUNDS)])
def test_sp2_on_two_ranks_equals_one_process(tiny_vlms, tmp_path, family, config, extra):
    model = ["--model_name_or_path", tiny_vlms[family]] if family != "llava" else []
    model += ["--eval_dataset_name", HELD_OUT_64]
    truth = run_recipe(*COMMON, *model, *extra, "--output_dir", tmp_path / "one", recipe=VLM_RECIPE)
    assert truth.returncode == 0, truth.log[-3000:]
    result = run_engine(config, *COMMON, *model, *extra, *SP, "--output_dir", tmp_path / config, recipe=VLM_RECIPE)
    assert_same_run(result, truth, tmp_path / config, tmp_path / "one", config)
    if BALANCED[0] in extra:  # the step's load-balancing loss, its parts summed over the group
        aux = [re.findall(r"\| aux_loss ([\d.]+)", run.log) for run in (result, truth)]
        got, expected = ([float(value) for value in values] for values in aux)
        assert len(expected) == STEPS and got == pytest.approx(expected, rel=1e-5)
    # evaluation runs whole sequences, each row once over the 4 ranks' own rows
    eval_line = next(line for line in truth.log.splitlines() if line.startswith("eval step"))
    assert eval_line in result.log
    if extra:  # the clips or sounds trained: none counted as skipped
        assert losses(result.log) and "| audio 0 | video 0 | no_frames 0 |" in result.log
        assert "| audio_undecodable 0 | audio_empty 0 | audio_too_long 0 | audio_mismatch 0" in result.log


def rank_files(folder):
    """rank0.parquet, rank1.parquet (image and text-only rows alternating; rank 0's third row too long, skipped, so
    the two data ranks' positions differ) and all.parquet: each window of one process at batch 1 x 4 micro-batches
    holds rank 0's two micro-batches, then rank 1's."""
    image = pq.read_table(sorted(VLM_SHAPES.glob("image_chat/train-*.parquet"))[0]).slice(0, 16)
    text = pq.read_table(sorted(VLM_SHAPES.glob("text_chat/train-*.parquet"))[0]).slice(0, 16).cast(image.schema)
    rows = [table.slice(index, 1) for index in range(16) for table in (image, text)]
    ranks = [[row for index, row in enumerate(rows) if index // 2 % 2 == rank] for rank in (0, 1)]
    long = text.slice(0, 1).to_pylist()[0]
    long["messages"][0]["content"][0]["text"] = "Tell me more. " * 400
    long = pa.Table.from_pylist([long], schema=image.schema)
    single = [row for window in range(8) for held in ranks for row in held[2 * window:2 * window + 2]]
    single.insert(4, long)  # read before rank 0's third row, as rank 0 reads it
    ranks[0].insert(2, long)
    for rank, held in enumerate(ranks):
        pq.write_table(pa.concat_tables(held), folder / f"rank{rank}.parquet")
    (folder / "single").mkdir()
    pq.write_table(pa.concat_tables(single), folder / "single" / "all.parquet")


@pytest.mark.launch
def test_dp2_by_sp2_on_four_ranks_equals_one_process_holding_the_window_and_resumes_exactly(tiny_vlms, tmp_path):
    """4 steps on 4 ranks (ZeRO-2) against one process; from checkpoint-2, steps 3 and 4 and the weights again: each
    group's ranks saved and resume the same data position (their data rank is the group's)."""
    rank_files(tmp_path)
    common = ["--max_steps", 4, "--logging_steps", 1, "--dataset_name", "parquet", "--dataset_weights", "",
              "--shuffle_buffer_size", 1, "--eval_dataset_name", "", "--ddp_timeout", 120,
              "--model_name_or_path", tiny_vlms["qwen2_5_vl"], "--per_device_train_batch_size", 1]
    truth = run_recipe(*common, "--gradient_accumulation_steps", 4, "--data_files", tmp_path / "single" / "all.parquet",
                       "--output_dir", tmp_path / "one", recipe=VLM_RECIPE)
    assert truth.returncode == 0, truth.log[-3000:]
    split = [*common, *SP, "--gradient_accumulation_steps", 2, "--data_files", tmp_path / "rank*.parquet",
             "--save_steps", 2]
    result = run_engine("zero2.yaml", *split, "--output_dir", tmp_path / "dp2sp2", num_processes=4, recipe=VLM_RECIPE)
    assert_same_run(result, truth, tmp_path / "dp2sp2", tmp_path / "one", "zero2.yaml", processes=4,
                    logged=range(1, 5))
    resumed = run_engine("zero2.yaml", *split, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint",
                         tmp_path / "dp2sp2" / "checkpoints" / "checkpoint-2", num_processes=4, recipe=VLM_RECIPE)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert_same_run(resumed, truth, tmp_path / "resumed", tmp_path / "one", "zero2.yaml", processes=4, logged=[3, 4])
    # Under DDP the same window resumes on 2 ranks without the split: each data rank's position is its own file
    # (a file per process gave data rank 1 its group peer's, data rank 0's, position)
    ddp = run_engine("ddp.yaml", *split, "--output_dir", tmp_path / "ddp", num_processes=4, recipe=VLM_RECIPE)
    assert_same_run(ddp, truth, tmp_path / "ddp", tmp_path / "one", "ddp.yaml", processes=4, logged=range(1, 5))
    unsplit = [*split[:split.index("--sequence_parallel_size")], *split[split.index("--sequence_parallel_size") + 2:]]
    resumed = run_engine("ddp.yaml", *unsplit, "--output_dir", tmp_path / "unsplit", "--resume_from_checkpoint",
                         tmp_path / "ddp" / "checkpoints" / "checkpoint-2", recipe=VLM_RECIPE)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert_same_curves(resumed.log, truth.log, [3, 4], rel=1e-5, grad_norm=True)


def test_what_cannot_split_exactly_is_refused_before_the_first_step(tiny_vlms):
    """Packing (Ulysses attention is causal over the whole gathered sequence) and --torch_compile, when the flags are
    parsed (the load-balancing loss is not refused: its parts are summed over the group); accelerate's own path (its
    sdpa replacement reaches the vision tower's attention) when the split is built."""
    arguments = (VLMModelArgs, MoEArgs, ChatDataArgs, TrainingArgs)
    parse_args(arguments, ["--sequence_parallel_size", "2", "--router_aux_loss_coef", "0.001"])
    for flags, message in ((["--packing", "true"], "packed samples would see each other; drop --packing"),
                           (["--torch_compile", "true"], "compiling the blocks around DeepSpeed's all-to-all")):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_args(arguments, ["--sequence_parallel_size", "2", *flags])
        parse_args(arguments, ["--sequence_parallel_size", "1", *flags])  # without the split: fine
    plain = SimpleNamespace(parallelism_config=None)
    model = tiny()[0]
    accelerate_sp = SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=2))
    with pytest.raises(ValueError, match="parallelism_config_sp_size wraps every sdpa attention, the vision tower"):
        sequence_parallel.SequenceParallel.of(accelerate_sp, model, 1)
    assert sequence_parallel.SequenceParallel.of(plain, model, 1) is None
    with pytest.raises(ValueError, match="needs a multiple of 2 processes \\(there are 1\\)"):
        sequence_parallel.SequenceParallel(model, 2)


DPO_RECIPE = VLM_RECIPE.parent / "vlm_dpo.py"


@pytest.mark.launch
@pytest.mark.parametrize("config, extra", [("zero3.yaml", []),  # the frozen reference sharded, run whole
                                           ("ddp.yaml", ["--use_peft", "true", "--lora_dropout", 0.0])])
def test_dpo_at_sp2_equals_one_process(tmp_path, config, extra):
    """Each row's log-probability summed over the group before the pair loss; the reference: a frozen copy (whole
    sequences) or the policy with its adapters off (split too). Dropout would draw other masks per shard: none."""
    common = [*COMMON[:-4], "--ddp_timeout", 120, "--eval_questions", HELD_OUT_64, *extra]
    truth = run_recipe(*common, "--output_dir", tmp_path / "one", recipe=DPO_RECIPE)
    assert truth.returncode == 0, truth.log[-3000:]
    result = run_engine(config, *common, *SP, "--output_dir", tmp_path / "sp", recipe=DPO_RECIPE)
    assert_same_run(result, truth, tmp_path / "sp", tmp_path / "one", config)
    eval_line = next(line for line in truth.log.splitlines() if line.startswith("eval step"))
    assert eval_line in result.log  # whole sequences, each held-out pair once



GRPO_RECIPE = VLM_RECIPE.parent / "vlm_grpo.py"


@pytest.mark.launch
def test_grpo_at_sp2_equals_one_process_under_zero3(tmp_path):
    """Sampling runs whole sequences (each layer gathered in each forward, every rank of a group sampling the same
    completions), the token log-probabilities of the policy and of the sharded frozen reference (the KL) are gathered
    over the group, a group's rewards count once in the advantages."""
    common = [*COMMON[:-4], "--ddp_timeout", 120, "--num_generations", 4, "--beta", 0.04, "--eval_dataset_name", ""]
    truth = run_recipe(*common, "--output_dir", tmp_path / "one", recipe=GRPO_RECIPE)
    assert truth.returncode == 0, truth.log[-3000:]
    result = run_engine("zero3.yaml", *common, *SP, "--output_dir", tmp_path / "sp", recipe=GRPO_RECIPE)
    assert_same_run(result, truth, tmp_path / "sp", tmp_path / "one", "zero3.yaml", learning_rate=3e-4)
    step = next(line for line in truth.log.splitlines() if line.startswith("step 1/"))
    assert step.split("| kl ")[0] in result.log  # rewards, lengths, clip ratios: counted once
    # the KL (0 at the first step: the reference is the policy) within float32 rounding of the group's gathered
    # log-probabilities (-6e-9 seen on one CPU)
    assert metric(result.log, "kl") == pytest.approx(metric(truth.log, "kl"), abs=1e-6)


@pytest.mark.launch
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_dpo_and_grpo_of_the_2026_families_at_sp2_equal_one_process(tiny_vlms, tmp_path, family):
    """Qwen3.5's Gated DeltaNet layers head-parallel, Gemma 4's sliding windows through their whole-sequence masks,
    in the preference and RL recipes: a DPO step under DDP (the frozen reference whole) and a GRPO step under ZeRO-3
    (sampling whole sequences, a reward with a spread), each equal to one process."""
    model = ["--model_name_or_path", tiny_vlms[family], "--max_steps", 1, "--logging_steps", 1,
             "--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2, "--ddp_timeout", 120,
             "--eval_dataset_name", ""]
    runs = {DPO_RECIPE: ("ddp.yaml", ["--eval_questions", ""]),
            GRPO_RECIPE: ("zero3.yaml", ["--num_generations", 4, "--reward_funcs", "rewards_for_tests:token_spread"])}
    for recipe, (config, flags) in runs.items():
        truth = run_recipe(*model, *flags, "--output_dir", tmp_path / recipe.stem / "one", recipe=recipe)
        assert truth.returncode == 0, truth.log[-3000:]
        result = run_engine(config, *model, *flags, *SP, "--output_dir", tmp_path / recipe.stem / "sp",
                            recipe=recipe, env={"PYTHONPATH": str(VLM_RECIPE.parents[1] / "tests")})
        assert_same_run(result, truth, tmp_path / recipe.stem / "sp", tmp_path / recipe.stem / "one", config,
                        logged=[1], learning_rate=1e-3 if recipe == DPO_RECIPE else 3e-4)


def long_clip_rows(path, rows=4, frames=64):
    """Conversations about 64-frame 64 px clips (the tiny Qwen2.5-VL: about 2.1k tokens each) as a parquet file."""
    from make_videos import encode_clip, moving_shape

    table = pa.Table.from_pylist([{
        "messages": [{"role": "user", "content": [{"type": "video", "text": None},
                                                  {"type": "text", "text": "Where does it move?"}]},
                     {"role": "assistant", "content": [{"type": "text", "text": direction}]}],
        "videos": [{"bytes": encode_clip([frame.resize((64, 64)) for frame in
                                          moving_shape(direction, "red", "circle", frames=frames)])}]}
        for direction in ["left", "right", "up", "down"][:rows]])
    pq.write_table(table, path)


@pytest.mark.launch
def test_a_long_clip_over_one_ranks_token_budget_trains_split_over_two(tiny_vlms, tmp_path):
    """--max_tokens_per_batch is what one rank holds: a 2.1k-token clip conversation is too long for a budget of 1200
    (every row skipped and counted: the run stops, saying so), and trains split over 2 ranks."""
    long_clip_rows(tmp_path / "clips.parquet")
    common = ["--max_steps", 2, "--logging_steps", 1, "--dataset_name", "parquet", "--dataset_weights", "",
              "--data_files", tmp_path / "clips.parquet", "--eval_dataset_name", "", "--ddp_timeout", 120,
              "--model_name_or_path", tiny_vlms["qwen2_5_vl"], "--per_device_train_batch_size", 1,
              "--video_fps", 100, "--video_max_frames", 64, "--max_length", 4096, "--max_tokens_per_batch", 1200]
    alone = run_recipe(*common, "--output_dir", tmp_path / "one", recipe=VLM_RECIPE)
    assert alone.returncode != 0 and "no training rows" in alone.log, alone.log[-3000:]
    assert "too_long: 4, e.g. a row of" in alone.log and "tokens, over 1200" in alone.log
    assert "--sequence_parallel_size N splits a row over N ranks, each holding the budget" in alone.log
    split = run_engine("zero3.yaml", *common, *SP, "--output_dir", tmp_path / "sp", recipe=VLM_RECIPE)
    assert split.returncode == 0, split.log[-3000:]
    assert re.search(r"^step 2/2 .*\| too_long 0 \| .*\| video 0 \| no_frames 0 \| video_too_long 0 ", split.log,
                     re.M), split.log[-3000:]
    assert re.search(r"^step 1/2 .*tokens/s", split.log, re.M)


DISTILL_RECIPE = VLM_RECIPE.parent / "vlm_distill.py"


@pytest.mark.launch
def test_distillation_at_sp2_equals_one_process_under_ddp_and_zero3(tmp_path):
    """Sequence parallelism reached distillation as one output: the student's divergence is computed on each rank's
    shard of a long row against the teacher's hidden states at the shard's positions (the teacher runs whole
    sequences, whole under DDP and partitioned under ZeRO-3), and summed over the group. On- and off-policy steps,
    against one process: every step's loss and gradient norm, and the weights."""
    preamble = "Look closely at the picture before you answer, and answer in one word. " * 6  # 300 tokens
    rows = [chat_row(preamble + "What colour is the shape?", colour, square(colour))
            for colour in ("red", "blue", "green", "red", "blue", "green", "red", "blue")]
    write_chat_parquet(tmp_path / "long.parquet", rows)
    common = ["--max_steps", 3, "--logging_steps", 1, "--per_device_train_batch_size", 2, "--seed", 2,
              "--max_length", 480, "--dataset_name", "parquet", "--data_files", tmp_path / "long.parquet",
              "--dataset_weights", "", "--eval_dataset_name", "", "--ddp_timeout", 120]
    truth = run_recipe(*common, "--output_dir", tmp_path / "one", recipe=DISTILL_RECIPE)
    assert truth.returncode == 0, truth.log[-3000:]
    assert "on_policy 1.000" in truth.log and "on_policy 0.000" in truth.log  # both kinds of step (--seed 2)
    for config in ("ddp.yaml", "zero3.yaml"):
        result = run_engine(config, *common, *SP, "--output_dir", tmp_path / config, recipe=DISTILL_RECIPE)
        # ZeRO-3's gradient norm is DeepSpeed's sum of 2.1M squares in its own order: 2e-5 apart, as without the split
        # (test_distill_recipe.py); DDP's every digit
        assert_same_run(result, truth, tmp_path / config, tmp_path / "one", config, logged=range(1, 4),
                        learning_rate=3e-4, rel=1e-4 if config == "zero3.yaml" else 1e-6)
