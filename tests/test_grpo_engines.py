"""vlm_grpo.py on 2 CPU processes under every engine gives what one process holding the whole window gives: the same
completions (each prompt sampled from its own seed), rewards, failed-reward counts, gradient norms and weights, with
text-only and image prompts on different ranks, completions of different lengths, a reward function that fails some
of them, and gradient accumulation 2; and a resume repeats the straight run.

Scenario data (one parquet shard per data rank, read in order), 2 micro-batches a step on each rank; the single
process holds the step's completions in one micro-batch and reads the same prompts in the same order. Where a group's
completions sit (`GroupLayout`) and the features vary across engines (tests/README.md):
- DDP: groups of 4 in micro-batches of 2 (a group over both of a rank's micro-batches), --scale_rewards batch (a std
  over every rank) and --num_iterations 2 (two optimizer steps on each batch of completions, against their old
  log-probabilities: steps 1 and 3 sample);
- FSDP2: groups of 4 in micro-batches of 4, LoRA and --beta 0.04 (the reference: the adapters disabled);
- ZeRO-2: groups of 8 in micro-batches of 2 (a group over both ranks, both reading every shard as one team), --beta
  0.04 (a frozen reference copy);
- ZeRO-3: as FSDP2, --loss_type grpo and --mask_truncated_completions, resumed.
"""


import pytest
from PIL import Image
from transformers import LlavaForConditionalGeneration

from helpers import chat_row, write_chat_parquet
from launch import REPO, assert_adam_weights_close, assert_engine, assert_resume_repeats, metric, run_engine, run_recipe

pytestmark = pytest.mark.launch

GRPO_RECIPE = REPO / "recipes" / "vlm_grpo.py"
STEPS = 4
COMMON = ["--max_steps", STEPS, "--logging_steps", 1, "--eval_steps", 100, "--max_completion_length", 6,
          "--learning_rate", 1e-3, "--warmup_steps", 0, "--dataset_name", "parquet", "--dataset_weights", "",
          "--shuffle_buffer_size", 1, "--eval_dataset_name", "", "--ddp_timeout", 60,
          # a spread in every group, and completions a reward function fails (NaN: no advantage, out of the statistics)
          "--reward_funcs", "accuracy,rewards_for_tests:length_or_nan", "--reward_weights", "1,0.1"]
LORA = ["--use_peft", "true", "--lora_r", 4, "--lora_alpha", 8, "--lora_dropout", 0.0]


def layout(group, micro_batch):
    """(the ranks' flags, the single process's) for groups of `group` and ranks' micro-batches of `micro_batch`."""
    return (["--num_generations", group, "--per_device_train_batch_size", micro_batch, "--gradient_accumulation_steps",
             2], ["--num_generations", group, "--per_device_train_batch_size", 4 * micro_batch,
                  "--gradient_accumulation_steps", 1])


RUNS = {  # engine -> (where completions sit, the feature's flags, the same for its one-process ground truth)
    "ddp.yaml": (layout(4, 2), ["--scale_rewards", "batch", "--num_iterations", 2]),
    "fsdp2.yaml": (layout(4, 4), [*LORA, "--beta", 0.04]),  # the reference: the policy with its adapters disabled
    "zero2.yaml": (layout(8, 2), ["--beta", 0.04]),
    "zero3.yaml": (layout(4, 4), ["--loss_type", "grpo", "--mask_truncated_completions", "true", "--save_steps", 2,
                                  "--ds3_gather_for_generation", "true"]),  # the resume samples without it
}
SINGLE_DATA = {  # what one process reads to hold each step's prompts in the ranks' order
    "ddp.yaml": "single/interleaved.parquet", "zero2.yaml": "rank*.parquet"}
FAILED = "rewards/rewards_for_tests:length_or_nan/failed"
SAMPLED = ("completions/mean_length", "reward", "frac_reward_zero_std")  # nan on a step that samples nothing
def image(colour):
    return Image.new("RGB", (32, 32), colour)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """rank{0,1}.parquet, single/all.parquet and single/interleaved.parquet. Two prompts a step a rank: rank 0 holds
    two image prompts and rank 1 two text-only ones, then the reverse; all.parquet gives one process the four. One a
    step a rank: rank 0 holds an image prompt and rank 1 a text-only one, then the reverse; interleaved.parquet
    gives one process the two."""
    data = tmp_path_factory.mktemp("grpo_scenario")
    pictures = [chat_row("What colour is the shape?", name, image(rgb)) for name, rgb in
                (("red", (220, 40, 40)), ("blue", (40, 40, 220)), ("green", (40, 200, 40)), ("yellow", (230, 220, 40)))]
    texts = [chat_row(question, answer) for question, answer in
             (("What colour is the sky?", "blue"), ("What number comes after one?", "two"),
              ("What colour is snow?", "white"), ("What is the opposite of below?", "above"))]
    rank0 = [pictures[0], pictures[1], texts[2], texts[3]] * 2
    rank1 = [texts[0], texts[1], pictures[2], pictures[3]] * 2
    write_chat_parquet(data / "rank0.parquet", rank0)
    write_chat_parquet(data / "rank1.parquet", rank1)
    (data / "single").mkdir()
    single = [row for step in range(4) for row in rank0[2 * step:2 * step + 2] + rank1[2 * step:2 * step + 2]]
    write_chat_parquet(data / "single" / "all.parquet", single)
    write_chat_parquet(data / "single" / "interleaved.parquet", [row for pair in zip(rank0, rank1) for row in pair])
    return data


@pytest.fixture(scope="module")
def runs(scenario, tmp_path_factory):
    """{engine: (2-process result, its output, one-process result, its output)}."""
    results = {}
    for config, ((ranks_layout, single_layout), flags) in RUNS.items():
        single_dir, ranks_dir = tmp_path_factory.mktemp(f"grpo_single_{config[:-5]}"), tmp_path_factory.mktemp(
            f"grpo_{config[:-5]}")
        single = run_recipe(*COMMON, *single_layout, *flags, "--data_files",
                            scenario / SINGLE_DATA.get(config, "single/all.parquet"), "--output_dir", single_dir,
                            recipe=GRPO_RECIPE)
        assert single.returncode == 0, single.log[-3000:]
        ranks = run_engine(config, *COMMON, *ranks_layout, *flags, "--data_files", scenario / "rank*.parquet",
                           "--output_dir", ranks_dir, recipe=GRPO_RECIPE)
        results[config] = ranks, ranks_dir, single, single_dir
    return results


@pytest.mark.parametrize("config", list(RUNS), ids=[config[:-5] for config in RUNS])
def test_two_ranks_sample_score_and_step_as_one_process(runs, config):
    ranks, ranks_dir, single, single_dir = runs[config]
    assert ranks.returncode == 0, ranks.log[-3000:]
    assert_engine(ranks.log, config, wrapped="VLMForTraining")
    assert ("sampling: generate" in ranks.log) == (config in ("ddp.yaml", "zero2.yaml", "zero3.yaml"))
    assert "sampling: generate, the whole model on every rank" in single.log
    # The same completions (lengths and rewards), the same advantages' effect (gradient norms), every step; with
    # --num_iterations 2 a batch of completions trains two steps, and only its first samples (the others log nan)
    sampling_steps = list(range(1, STEPS + 1, 2 if "--num_iterations" in RUNS[config][1] else 1))
    for name in ("completions/mean_length", "reward", "frac_reward_zero_std", "grad_norm", "loss", FAILED):
        got, expected = metric(ranks.log, name), metric(single.log, name)
        steps = sampling_steps if name in SAMPLED else list(range(1, STEPS + 1))
        assert sorted(got) == steps, (name, ranks.log[-2000:])
        for step in got:
            assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-6), (name, step)
    assert len(set(metric(ranks.log, "completions/mean_length").values())) > 1  # lengths differ from step to step
    assert max(metric(ranks.log, "grad_norm").values()) > 0
    assert sum(metric(ranks.log, FAILED).values()) > 0  # failed completions, counted alike
    flags = RUNS[config][1]
    if "--use_peft" not in flags:
        assert_adam_weights_close(LlavaForConditionalGeneration.from_pretrained(ranks_dir).state_dict(),
                                  LlavaForConditionalGeneration.from_pretrained(single_dir).state_dict(),
                                  learning_rate=1e-3, steps=STEPS)
    if "--beta" in flags:
        assert ("reference: the policy with its LoRA adapters disabled" if "--use_peft" in flags else
                "reference: a frozen copy of the starting model") in ranks.log
        assert min(metric(ranks.log, "kl").values()) >= 0 and max(metric(ranks.log, "kl").values()) > 0


def test_a_resume_repeats_the_straight_run(runs, scenario, tmp_path):
    """From ZeRO-3's checkpoint-2: the same completions (the sampling seeds come from the prompts), rewards, losses and
    gradient norms at steps 3 and 4, every number as printed."""
    straight, output_dir, _, _ = runs["zero3.yaml"]
    (ranks_layout, _), flags = RUNS["zero3.yaml"]
    flags = [*flags[:-2], "--ds3_gather_for_generation", "false"]  # each layer gathered in each forward
    resumed = run_engine("zero3.yaml", *COMMON, *ranks_layout, *flags, "--data_files",
                         scenario / "rank*.parquet", "--output_dir", tmp_path, "--resume_from_checkpoint",
                         output_dir / "checkpoints" / "checkpoint-2", recipe=GRPO_RECIPE)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert "sampling: each layer gathered in each forward, every rank forwarding until all are done" in resumed.log
    assert "sampling: generate, the whole model gathered on every rank once a step" in straight.log
    assert_resume_repeats(resumed.log, straight.log, [3, 4])
