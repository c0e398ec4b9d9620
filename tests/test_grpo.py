"""GRPO (recipes/vlm_grpo.py, mmrecipes.vlm.algorithms.grpo and .rewards), in process: the loss of each TRL 1.16 loss
type equals the papers' formulas written out here, for fixed completions, rewards and old log-probabilities (clipping
active, with and without the KL), whatever the micro-batches; the group statistics; rewards that raise or give NaN
counted, never a crash; and the recipe from the embedded SFT'd model, its output loading with the Auto classes."""

import json
import math
import statistics
from types import SimpleNamespace

import datasets
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from gloo import run_on_ranks
from helpers import FAMILIES, chat_row
from launch import REPO, load_recipe
from mmrecipes.images import to_device
from mmrecipes.paths import EMBEDDED
from mmrecipes.vlm.algorithms.grpo import GroupLayout, LossNormaliser, group_advantages, token_losses
from mmrecipes.vlm.algorithms.rewards import RewardScorer, accuracy, format_reward, load_reward_funcs
from mmrecipes.vlm.algorithms.sampling import Sampler, generate_group, sample_group
from mmrecipes.vlm.algorithms.trajectory import prompt_seed
from mmrecipes.vlm.arguments import GRPOArgs, PromptDataArgs
from mmrecipes.vlm.model.evaluation import greedy_tokens
from mmrecipes.vlm.model.families import dummy_image_inputs, placeholder_token_ids
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.outputs import TokenLogps
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.collate import ChatCollator, chat_rows
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller
from mmrecipes.vlm.rows.prompts import PromptPreprocessor

GRPO_RECIPE = REPO / "recipes" / "vlm_grpo.py"
TINY_SFT_VLM = EMBEDDED / "tiny_sft_vlm"
LENGTHS = [3, 7, 1, 5, 4, 6]  # two groups of three completions, of different lengths
MAX_LENGTH = 8


def reference_loss(logps, old, ref, advantages, loss_type, beta, epsilon_low, epsilon_high, corrected,
                   level="token"):
    """The papers' objectives, negated, one completion and token at a time: GRPO (DeepSeekMath, eq. 3: each
    completion's token mean, averaged over completions), DAPO (eq. 8: the token sum over all tokens; TRL's bnpo is
    the same over the whole step), Dr. GRPO (the token sum over completions x the maximum length), LUSPO (each
    completion's token sum, averaged), CISPO (MiniMax-M1, eq. 4: the log-probability weighted by the ratio clipped
    above at epsilon_high, over all tokens), SAPO (a sigmoid gate 4/tau sigmoid(tau (r - 1)), tau 1 where the
    advantage is positive, else 1.05, normalised as GRPO), VESPO (the log-probability weighted by e^lambda w^k
    e^(-lambda w) of the completion's ratio w, normalised as DAPO); GSPO's ratio (`level` sequence: exp of a
    completion's mean log-ratio); the KL (k3) weighted by the ratio where `corrected` (TRL 1.16's
    use_bias_correction_kl)."""
    per_completion, tokens = [], 0
    for i, length in enumerate(LENGTHS):
        sequence_ratio = math.exp(sum(logps[i][t] - old[i][t] for t in range(length)) / length)
        terms = []
        for t in range(length):
            ratio = sequence_ratio if level == "sequence" else math.exp(logps[i][t] - old[i][t])
            if loss_type == "cispo":
                term = -min(ratio, epsilon_high) * advantages[i] * logps[i][t]
            elif loss_type == "sapo":
                tau = 1.0 if advantages[i] > 0 else 1.05
                term = -4 / tau / (1 + math.exp(-tau * (ratio - 1))) * advantages[i]
            elif loss_type == "vespo":  # a gamma weight of the completion's whole ratio (its log-ratios' sum)
                log_w = sum(logps[i][u] - old[i][u] for u in range(length))
                k, lam = (2.0, 3.0) if advantages[i] >= 0 else (3.0, 2.0)
                term = -math.exp(lam + k * log_w - lam * math.exp(log_w)) * advantages[i] * logps[i][t]
            else:
                clipped = min(max(ratio, 1 - epsilon_low), 1 + epsilon_high)
                term = -min(ratio * advantages[i], clipped * advantages[i])
            kl = (math.exp(ref[i][t] - logps[i][t]) - (ref[i][t] - logps[i][t]) - 1) * (ratio if corrected else 1)
            terms.append(term + beta * kl)
        per_completion.append(terms)
        tokens += length
    if loss_type in ("grpo", "sapo"):
        return sum(sum(terms) / len(terms) for terms in per_completion) / len(LENGTHS)
    if loss_type == "luspo":
        return sum(map(sum, per_completion)) / len(LENGTHS)
    if loss_type == "dr_grpo":
        return sum(map(sum, per_completion)) / (len(LENGTHS) * MAX_LENGTH)
    return sum(map(sum, per_completion)) / tokens  # dapo, bnpo, cispo, vespo


@pytest.mark.parametrize("beta, corrected", [(0.0, True), (0.04, True), (0.04, False)])
@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("bnpo", "token"), ("dr_grpo", "token"),
                                              ("dapo", "token"), ("cispo", "token"), ("sapo", "token"),
                                              ("luspo", "sequence"), ("grpo", "sequence"), ("vespo", "token")])
def test_each_loss_type_equals_the_papers_formula_whatever_the_micro_batches(loss_type, level, beta, corrected):
    generator = torch.Generator().manual_seed(2 if level == "sequence" else 0)  # ratios clipped on both sides
    width = max(LENGTHS)
    mask = torch.tensor([[t < length for t in range(width)] for length in LENGTHS])
    logps = -torch.rand(len(LENGTHS), width, generator=generator, dtype=torch.float64) * 3
    spread = 1.0 if level == "sequence" else 0.5  # a completion's mean log-ratio varies less than a token's
    old = logps + torch.randn(logps.shape, generator=generator, dtype=torch.float64) * spread  # num_iterations 2
    ref = logps + torch.randn(logps.shape, generator=generator, dtype=torch.float64) * 0.3
    advantages = torch.tensor([1.2, -0.4, -0.8, 0.9, 0.1, -1.0], dtype=torch.float64)
    epsilon_high = 1.3 if loss_type == "cispo" else 0.28  # CISPO clips the ratio itself: some lie above 1.3
    args = GRPOArgs(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=epsilon_high,
                    max_completion_length=MAX_LENGTH, use_bias_correction_kl=corrected, importance_sampling_level=level)
    expected = reference_loss(logps.tolist(), old.tolist(), ref.tolist(), advantages.tolist(), loss_type, beta,
                              0.2, epsilon_high, corrected, level)
    normaliser = LossNormaliser(args)
    for split in ([6], [2, 4], [1, 1, 1, 3]):  # micro-batches (or ranks) of the step: one normaliser N for all
        parts = list(zip(*(tensor.split(split) for tensor in (logps, old, ref, advantages, mask))))
        total = normaliser.count([part[4] for part in parts])
        loss = 0.0
        for part_logps, part_old, part_ref, part_advantages, part_mask in parts:
            terms = token_losses(part_logps, part_old, part_ref, part_advantages, part_mask, args)
            loss += float((terms["loss"] * normaliser.weights(part_mask, torch.float64)).sum()) / total
        assert loss == pytest.approx(expected, rel=1e-12)
    terms = token_losses(logps, old, ref, advantages, mask, args)
    if loss_type == "cispo":
        assert terms["high"].any() and not terms["low"].any()  # CISPO's clip: above only
    elif loss_type not in ("sapo", "vespo"):  # SAPO gates, VESPO weighs, instead of clipping
        assert terms["low"].any() and terms["high"].any()  # the clipping is active on both sides
    if loss_type in ("bnpo", "dapo"):  # TRL's bnpo, a token mean per micro-batch (or rank), averaged: not the step's
        means = [float(token_losses(*(t[:2] for t in (logps, old, ref, advantages)), mask[:2], args)["loss"].sum()
                       / mask[:2].sum()),
                 float(token_losses(*(t[2:] for t in (logps, old, ref, advantages)), mask[2:], args)["loss"].sum()
                       / mask[2:].sum())]
        assert statistics.mean(means) != pytest.approx(expected, rel=1e-3)


def test_group_advantages_leave_failed_completions_out_of_their_groups_statistics():
    rewards = torch.tensor([1.0, 0.0, math.nan, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    advantages, zero_std = group_advantages(rewards, 4, "group")
    valid = [1.0, 0.0, 1.0]
    mean, std = statistics.mean(valid), statistics.stdev(valid)  # unbiased, as TRL's nanstd
    assert advantages[:4].tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in [1.0, 0.0]] + [0.0]
                                                    + [(1.0 - mean) / (std + 1e-4)])
    assert advantages[4:].tolist() == [0.0] * 4 and zero_std.tolist() == [False] * 4 + [True] * 4
    unscaled, _ = group_advantages(rewards, 4, "none")
    assert unscaled[:2].tolist() == pytest.approx([1.0 - mean, -mean])
    batch, _ = group_advantages(rewards, 4, "batch")
    everything = [1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert batch[0].item() == pytest.approx((1.0 - mean) / (statistics.stdev(everything) + 1e-4))


def test_the_built_in_rewards():
    completions = ["Red.", "<answer>blue</answer>", "3.0", "two", [{"role": "assistant", "content": "circle"}]]
    solutions = ["red", "Blue", "3", "2", "circle"]
    assert accuracy(None, completions, solution=solutions) == [1.0, 1.0, 1.0, 0.0, 1.0]
    form = format_reward(GRPOArgs().format_pattern)
    assert form(None, ["<think>x</think> <answer>3</answer>", "3"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="module:function"):
        load_reward_funcs(["nonsense"], "")
    with pytest.raises(ValueError, match="a prompt without a solution"):  # RewardScorer counts it as failed
        accuracy(None, ["red"], solution=[None])


def test_a_reward_function_that_raises_or_gives_nan_fails_only_what_it_scored():
    scorer = RewardScorer(load_reward_funcs(["accuracy", "rewards_for_tests:flaky"], ""), [1.0, 0.5])
    columns = {"solution": ["red"] * 4}
    scores = scorer(None, ["red", "red", "blue", "red"], None, columns)
    assert scores[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert torch.isnan(scores[:2, 1]).all() and scores[2:, 1].tolist() == [1.0, 1.0]
    assert torch.isnan(scorer.total(scores)[:2]).all() and scorer.total(scores)[2:].tolist() == [0.5, 1.5]
    scores = scorer(None, ["red"] * 4, None, columns)  # the second call raises: every completion failed
    assert torch.isnan(scores[:, 1]).all()
    said = []
    assert scorer.take_failures(say=said.append) == {"rewards_for_tests:flaky": 6}
    assert said == [f"reward function rewards_for_tests:flaky failed on rank 0: {why}" for why in (
        "gave NaN", "gave None (TRL's way to leave a completion unscored)", "RuntimeError: the judge is down")]
    assert scorer.take_failures(say=said.append) == {} and len(said) == 3


# a benchmark at the end of the run (docs/benchmarks.md), 3 embedded documents
BENCHMARK = ["--benchmarks", "docvqa_val", "--benchmark_data_dir", "embedded:benchmarks", "--benchmark_limit", "3",
             "--benchmark_max_new_tokens", "4"]


def test_the_recipe_samples_scores_and_trains_from_the_embedded_sft_model(tmp_path, capsys):
    """Two steps of 1 prompt x 8 completions, with a reward function that fails (all of step 2's completions, not all of
    the window's): counted in the log, not a crash; TRL's
    documented conversational reward scores every completion (the embedded chat rows are conversational); a reward
    that fails every completion of a window stops the run; the checkpoint refuses a resume with other groups; a
    benchmark scores the model at the end, in the log and the card."""
    load_recipe(GRPO_RECIPE).main(["--max_steps", "2", "--logging_steps", "2", "--eval_steps", "2", "--save_steps", "1",
                                   "--per_device_train_batch_size", "8", "--reward_funcs",
                                   "accuracy,rewards_for_tests:flaky,rewards_for_tests:format_reward_func",
                                   "--eval_generation_rows", "4", "--report_to", "none", "--output_dir", str(tmp_path),
                                   *BENCHMARK])
    log = capsys.readouterr().out
    assert "step 2/2 | loss" in log and "rewards/rewards_for_tests:flaky/failed" in log
    assert "eval step 2 | bench/docvqa_val/anls " in log and "## Benchmarks" in (tmp_path / "README.md").read_text()
    assert "rewards/rewards_for_tests:format_reward_func/failed 0" in log
    assert "reward function rewards_for_tests:flaky failed on rank 0: RuntimeError: the judge is down" in log
    assert "eval step 2 | generated_accuracy" in log
    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path)).__name__ == "LlavaForConditionalGeneration"
    with pytest.raises(RuntimeError, match="step 1: reward function rewards_for_tests:always_fails failed on all 8 "
                                           "completions"):
        load_recipe(GRPO_RECIPE).main(["--max_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size",
                                       "8", "--reward_funcs", "rewards_for_tests:always_fails", "--eval_steps", "9",
                                       "--report_to", "none", "--output_dir", str(tmp_path / "fails")])
    # Its checkpoint resumes only with the same groups: other groups would read other prompts a step
    with pytest.raises(ValueError, match="saved with num_generations=8, loader_batch_size=1; this run has "
                                         "num_generations=4, loader_batch_size=2"):
        load_recipe(GRPO_RECIPE).main(["--max_steps", "3", "--per_device_train_batch_size", "8", "--num_generations",
                                       "4", "--report_to", "none", "--output_dir", str(tmp_path / "resumed"),
                                       "--resume_from_checkpoint", str(tmp_path / "checkpoints" / "checkpoint-1")])


@pytest.mark.parametrize("flags, message", [
    (["--per_device_train_batch_size", "6"], r"1 data ranks x .* are not whole groups of --num_generations 8"),
    (["--max_completion_length", "256"], "leaves no room for a prompt"),
    (["--reward_funcs", "accuracy,nope"], "accuracy, format, or a function's import path"),
    (["--reward_funcs", "no_such_module:f"], "cannot import it"),
    (["--loss_type", "ppo"], "--loss_type 'ppo': must be one of grpo, bnpo, dr_grpo, dapo"),
    (["--scale_rewards", "std"], "--scale_rewards 'std': must be one of group, batch, none"),
    (["--num_iterations", "2", "--save_steps", "3"], "--save_steps 3: a multiple of --num_iterations 2"),
    (["--reward_weights", "1,2"], "one finite weight per --reward_funcs"),
    (["--num_generations", "1"], "a group of one completion has no spread"),
])
def test_bad_settings_are_refused_before_the_first_step(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        load_recipe(GRPO_RECIPE).main([*flags, "--report_to", "none", "--output_dir", str(tmp_path)])


def test_prompt_rows_in_trl_and_chat_layouts_become_generation_prompts():
    """TRL's `prompt` (a string or a conversation) with `images` and `solution`, and a chat row whose last answer is
    the solution, rendered with the checkpoint's generation prompt; a row with nothing to answer is counted."""
    processor = AutoProcessor.from_pretrained(TINY_SFT_VLM)
    preprocess = PromptPreprocessor(PromptDataArgs(), AnswerLabeller(processor, [processor.tokenizer.eos_token_id]),
                                    max_length=64)
    red = Image.new("RGB", (32, 32), (220, 40, 40))
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    rows = [{"prompt": "What colour is it?", "images": [red], "solution": "red"},
            {"prompt": question, "images": [red], "solution": "red"},
            chat_row("What colour is it?", "red", red),
            {"messages": question, "images": [red]},  # no answer: no solution
            {"prompt": "What colour is it? " * 40, "solution": "red"}]  # over max_length
    out = preprocess({key: [row.get(key) for row in rows] for key in {key for row in rows for key in row}})
    expected = processor(text=processor.apply_chat_template(question, add_generation_prompt=True), images=[red])
    assert [list(ids) for ids in out["input_ids"]] == [list(expected["input_ids"][0])] * 3
    # as TRL hands them to reward functions: a string prompt as it is, the conversations as messages
    assert [json.loads(m) for m in out["reward_prompt"]] == ["What colour is it?", question, question]
    assert [json.loads(c) for c in out["reward_columns"]] == [{"solution": "red"}] * 3
    assert preprocess.drops.totals == {"bad_row": 1, "too_long": 1}


def sft_model_and_prompt(rgb=(220, 40, 40)):
    """(the embedded SFT'd Llava, its processor, its stop ids, a question about a `rgb` square as the recipe's loader
    hands it to `sample_group`: `PromptCollator`'s prompt)."""
    model = AutoModelForImageTextToText.from_pretrained(TINY_SFT_VLM)
    processor = AutoProcessor.from_pretrained(TINY_SFT_VLM)
    stops = stop_token_ids(model, processor)
    return model, processor, stops, loaded_prompt(processor, stops, chat_row(
        "What colour is the shape?", "red", Image.new("RGB", (32, 32), rgb)))


def loaded_prompt(processor, stops, row, max_length=64) -> dict:
    preprocess = PromptPreprocessor(PromptDataArgs(), AnswerLabeller(processor, stops), max_length=max_length)
    (input_ids, media_inputs, prompt, columns, _), _ = preprocess.example(row)
    return {"input_ids": torch.as_tensor(input_ids), "media_inputs": media_inputs, "prompt": json.loads(prompt),
            "columns": json.loads(columns)}


def _rollouts(rank, world, micro_batch, accumulation, whole):
    """This rank's share of a step of two prompts (an image and a text-only one) x 3 completions, sampled by
    `generate` (`whole`) or the synced loop: its micro-batches' token ids, advantages (rewards by `length_or_nan`),
    zero-std flags, and how many forwards it ran."""
    model, processor, stops, image_prompt = sft_model_and_prompt()
    prompts = [image_prompt, loaded_prompt(processor, stops, chat_row("What colour is the sky?", "blue"))]
    layout = GroupLayout(3, micro_batch, accumulation, rank, world)
    assert layout.prompts_per_step == 2  # the team (every rank) reads both prompts
    args = GRPOArgs(num_generations=3, max_completion_length=8, temperature=1.5)
    scorer = RewardScorer(load_reward_funcs(["rewards_for_tests:length_or_nan"], ""), [1.0])
    step = VLMForTraining(model).eval()
    forwards = []
    step.register_forward_hook(lambda *_: forwards.append(1))
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    sampler = Sampler(SimpleNamespace(device=torch.device("cpu")), collator, args, stops,
                      placeholder_token_ids(model, processor))
    rollouts = sampler.sample(step, whole, prompts, layout, 0)
    rollouts.scores = scorer.score(rollouts, processor.tokenizer, stops)
    advantages, zero_std = layout.advantages(scorer.total(rollouts.scores), "group", torch.device("cpu"))
    return ([[ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
             for batch in rollouts.micro_batches], advantages, zero_std,
            scorer.total(rollouts.scores), len(forwards))


def test_a_groups_completions_on_several_ranks_and_micro_batches_get_one_process_statistics():
    """3 ranks x 2 micro-batches of 1 completion hold two groups of 3: rank 0 the image prompt's completions 0 and 1,
    rank 1 its completion 2 and the text prompt's 0 (two pieces: the others forward a filler meanwhile), rank 2 the
    text prompt's 1 and 2. Each rank samples what one process holding the step samples, and the advantages (each
    group's mean and std over ranks, failed completions left out) are one process's."""
    assert [GroupLayout(3, 1, 2, rank, 3).pieces() for rank in range(3)] == [
        [(0, [0, 1])], [(0, [2]), (1, [0])], [(1, [1, 2])]]
    (ids, advantages, zero_std, rewards, _), = [_rollouts(0, 1, 6, 1, True)]  # one process, generate
    ranks = run_on_ranks(_rollouts, 3, 1, 2, False)  # as under FSDP2 or ZeRO-3: every rank forwards until all are done
    assert [row for rank in ranks for batch in rank[0] for row in batch] == [row for batch in ids for row in batch]
    assert all(len(batch) == 1 for rank in ranks for batch in rank[0])  # b = 1: each completion its own micro-batch
    torch.testing.assert_close(torch.cat([rank[1] for rank in ranks]), advantages)
    assert torch.cat([rank[2] for rank in ranks]).tolist() == zero_std.tolist()
    assert len({rank[4] for rank in ranks}) == 1  # every rank forwarded as often, rank 1's two pieces included
    grouped = rewards.view(2, 3)
    assert grouped.isnan().any() and (~grouped.isnan()).sum(1).min() >= 2  # a failure, and a spread left to learn
    # What rank 2 would take from the two completions of the text prompt's group it holds is not the group's
    alone = rewards[4:]
    assert not alone.isnan().any() and not torch.allclose(advantages[4:], (alone - alone.mean()) / (alone.std() + 1e-4))


def _sample_on_ranks(rank, world):
    """Rank 0 samples nearly greedily (its completions stop after an answer), rank 1 at temperature 50 (its
    completions run to the length limit): each rank's completions, and how many forwards it ran."""
    model, processor, stops, prompt = sft_model_and_prompt()
    step = VLMForTraining(model).eval()
    forwards = []
    step.register_forward_hook(lambda *_: forwards.append(1))
    args = GRPOArgs(num_generations=4, max_completion_length=10, temperature=0.05 if rank == 0 else 50.0)
    group = sample_group(step, prompt, ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(
        model, processor)), args, stops, prompt_seed(0, prompt), torch.device("cpu"),
                         suppressed=placeholder_token_ids(model, processor))
    return group, len(forwards)


def test_ranks_whose_completions_end_at_different_lengths_forward_together():
    """The ranks agree after every token whether any completion anywhere still runs: the rank whose completions
    stopped after two tokens forwards as often as the one whose completions run to the limit (under FSDP2 and
    ZeRO-3 every forward gathers parameters, a collective), and neither waits forever."""
    (short, forwards0), (long, forwards1) = run_on_ranks(_sample_on_ranks, 2)
    assert forwards0 == forwards1 == 10
    assert max(len(ids) for ids, _ in short) <= 3 and not any(cut for _, cut in short)
    assert any(cut for _, cut in long) and max(len(ids) for ids, _ in long) == 10


def test_generate_with_a_cache_samples_what_the_synced_loop_samples():
    """Where the model is whole on a rank, `generate_group` samples with transformers' `generate` (a KV cache, a text
    prompt without the dummy image); where every forward gathers, `sample_group` forwards whole sequences: both give
    every completion, image or text-only prompt, stopped or truncated, alike (which is what lets the engine tests
    compare FSDP2's loop with one process's generate)."""
    model, processor, stops, image_prompt = sft_model_and_prompt()
    prompts = [image_prompt, loaded_prompt(processor, stops, chat_row("What colour is the sky?", "blue"))]
    step = VLMForTraining(model).eval()
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    lengths = set()
    for temperature in (1.0, 3.0):
        args = GRPOArgs(num_generations=6, max_completion_length=8, temperature=temperature, top_p=0.95)
        for prompt in prompts:
            sampled = [sample(step, prompt, collator, args, stops, prompt_seed(0, prompt), "cpu",
                              placeholder_token_ids(model, processor), [1, 3, 4, 5])
                       for sample in (sample_group, generate_group)]
            assert sampled[0] == sampled[1]
            lengths |= {(len(ids), cut) for ids, cut in sampled[0]}
    assert (8, True) in lengths and len(lengths) > 3  # truncated and stopped completions of several lengths


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_samples_alike_by_generate_and_by_the_synced_loop(tiny_vlms, family):
    """Each tiny family (its processor's image inputs: Qwen's grids and mRoPE, Gemma 3's token types, Idefics' pixel
    masks, ...): `generate` given the prompt as the processor gave it draws the tokens the synced loop draws, for an
    image prompt and a text-only one (which the loop gives the dummy image); neither, nor evaluation's greedy
    decoding, ever draws an image or video placeholder, even where they are the likeliest tokens."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])
    processor = AutoProcessor.from_pretrained(tiny_vlms[family])
    stops = stop_token_ids(model, processor)
    step = VLMForTraining(model).eval()
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    args = GRPOArgs(num_generations=3, max_completion_length=5, temperature=2.0)
    image_prompt, text_prompt = [loaded_prompt(processor, stops, row, max_length=2048) for row in (
        chat_row("What colour is the shape?", "red", Image.new("RGB", (32, 32), (220, 40, 40))),
        chat_row("What colour is the sky?", "blue"))]
    for prompt in (image_prompt, text_prompt):
        sampled = [sample(step, prompt, collator, args, stops, prompt_seed(0, prompt), "cpu",
                          placeholder_token_ids(model, processor)) for sample in (sample_group, generate_group)]
        assert sampled[0] == sampled[1], family
    # The placeholders made the likeliest tokens: never sampled, so no forward finds more of them than images
    media = placeholder_token_ids(model, processor)
    head = model.get_output_embeddings()
    bias = torch.zeros(head.weight.shape[0])
    bias[media] = 50.0
    head.register_forward_hook(lambda module, inputs, output: output + bias)
    for sample in (sample_group, generate_group):
        group = sample(step, image_prompt, collator, args, stops, 0, "cpu", media)
        assert not {token for ids, _ in group for token in ids} & set(media), family
    # nor decoded by evaluation's greedy decoding
    greedy = greedy_tokens(step, to_device(collator(chat_rows(image_prompt, [[]], [False])), "cpu"), 4, media)
    assert not set(greedy) & set(media), family
    if family == "gemma3":  # its processor's `image_token` is <start_of_image>: suppressing only that one fails
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            sample_group(step, image_prompt, collator, args, stops, 0, "cpu",
                         [processor.tokenizer.convert_tokens_to_ids(processor.image_token)])


@pytest.mark.parametrize("loss_type, beta, level", [("grpo", 0.0, "token"), ("dapo", 0.04, "token"),
                                                    ("dr_grpo", 0.0, "token"), ("bnpo", 0.04, "token"),
                                                    ("cispo", 0.04, "token"), ("sapo", 0.0, "token"),
                                                    ("luspo", 0.0, "sequence"), ("grpo", 0.04, "sequence"),
                                                    ("vespo", 0.04, "token")])
def test_one_micro_batch_equals_trl_grpo_trainer(loss_type, beta, level, tmp_path):
    """TRL 1.16's `GRPOTrainer._compute_loss` on the same model, image prompt, fixed completions of different lengths,
    advantages, old log-probabilities (clipping active) and reference log-probabilities gives our loss, at a
    sampling temperature of 0.7 (both score the tempered distribution), for every loss type and GSPO's sequence-level
    ratio. One micro-batch on one process, where TRL's per-micro-batch normalisations are the step's."""
    import trl  # a dev dependency: imported here, its import costs seconds
    from accelerate.state import AcceleratorState

    model, processor, stops, prompt = sft_model_and_prompt()
    red, messages = Image.new("RGB", (32, 32), (220, 40, 40)), prompt["prompt"]
    tokenizer, eos = processor.tokenizer, stops[0]
    completions = [tokenizer("red")["input_ids"] + [eos], tokenizer("a blue circle")["input_ids"] + [eos],
                   tokenizer("green")["input_ids"], tokenizer("two")["input_ids"] + [eos]]
    completions = [[t for t in ids if t != tokenizer.bos_token_id] for ids in completions]
    width = max(map(len, completions))
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(4, width, generator=generator) * 4
    ref = -torch.rand(4, width, generator=generator) * 4
    advantages = torch.tensor([1.1, -0.3, -0.9, 0.2])
    epsilon_high = 1.3 if loss_type == "cispo" else 0.28  # CISPO clips the ratio itself
    args = GRPOArgs(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=epsilon_high, temperature=0.7,
                    max_completion_length=width, num_generations=4, importance_sampling_level=level)

    # Ours: the recipe's rows and per-token log-probabilities, the old and reference ones put at the same positions
    batch = ChatCollator(tokenizer.pad_token_id, dummy_image_inputs(model, processor))(
        chat_rows(prompt, completions, [True] * 4))
    inputs = to_device(batch, "cpu")
    mask = inputs["labels"][:, 1:] != IGNORE_INDEX
    start = len(prompt["input_ids"]) - 1
    placed = [torch.zeros(mask.shape) for _ in range(2)]
    for row, ids in enumerate(completions):
        for tensor, source in zip(placed, (old, ref)):
            tensor[row, start:start + len(ids)] = source[row, :len(ids)]
    with torch.no_grad():
        logps = VLMForTraining(model)(inputs, TokenLogps(0.7))
        terms = token_losses(logps, placed[0], placed[1], advantages, mask, args)
        normaliser = LossNormaliser(args)
        ours = float((terms["loss"] * normaliser.weights(mask)).sum() / normaliser.count([mask]))
    assert terms["region"].any() or loss_type in ("sapo", "vespo")  # the clip is active (where there is one)

    config = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], num_generations=4,
                            per_device_train_batch_size=4, loss_type=loss_type, beta=beta, epsilon=0.2,
                            epsilon_high=epsilon_high, temperature=0.7, max_completion_length=width,
                            importance_sampling_level=level)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                              args=config, processing_class=processor,
                              train_dataset=datasets.Dataset.from_list([{"prompt": messages, "images": [red]}]))
    padded = torch.full((4, width), tokenizer.pad_token_id)
    completion_mask = torch.zeros(4, width, dtype=torch.long)
    for row, ids in enumerate(completions):
        padded[row, :len(ids)], completion_mask[row, :len(ids)] = torch.tensor(ids), 1
    trl_inputs = {"prompt_ids": prompt["input_ids"].repeat(4, 1),
                  "prompt_mask": torch.ones(4, len(prompt["input_ids"]), dtype=torch.long),
                  "completion_ids": padded, "completion_mask": completion_mask, "advantages": advantages,
                  "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": completion_mask.sum(),
                  "pixel_values": batch["pixel_values"], "num_images": [1] * 4}
    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        trl_loss = float(trainer._compute_loss(trainer.model, trl_inputs))
    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer's accelerator: gone for the next runs
    assert ours == pytest.approx(trl_loss, rel=1e-4, abs=1e-6)


def test_top_p_keeps_the_smallest_set_of_likeliest_tokens():
    """--top_p close to 0 keeps only the likeliest token, whatever the temperature: every completion is the greedy
    one (what evaluation's greedy decoding gives); at top_p 1 and a high temperature the group spreads out."""
    model, processor, stops, prompt = sft_model_and_prompt((40, 40, 220))
    step, collator = VLMForTraining(model).eval(), ChatCollator(processor.tokenizer.pad_token_id,
                                                                dummy_image_inputs(model, processor))
    greedy = greedy_tokens(step, to_device(collator(chat_rows(prompt, [[]], [False])), "cpu"), 6)
    greedy = greedy[:next((i + 1 for i, token in enumerate(greedy) if token in stops), len(greedy))]

    def group(**sampling):
        args = GRPOArgs(num_generations=8, max_completion_length=6, **sampling)
        return [ids for ids, _ in sample_group(step, prompt, collator, args, stops, 0, "cpu",
                                               suppressed=placeholder_token_ids(model, processor))]

    assert group(top_p=1e-6, temperature=3.0) == [greedy] * 8
    assert len({tuple(ids) for ids in group(top_p=1.0, temperature=3.0)}) > 1
