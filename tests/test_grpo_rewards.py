"""GRPO's reward functions get what TRL 1.16 gives them, and a reward that misbehaves is said and counted, never a
silent or a dead run. In process: TRL's documented reward functions (copied verbatim into rewards_for_tests.py) and the
functions `trl.rewards` ships, scored on prompt rows read as the recipe reads them (TRL's conversational and string
prompts, a chat row, with extra columns)."""

import json
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from PIL import Image
from transformers import AutoProcessor

from mmrecipes.paths import EMBEDDED
from mmrecipes.sources import OTHER_COLUMNS
from mmrecipes.vlm.algorithms.grpo import group_advantages
from mmrecipes.vlm.algorithms.rewards import RewardScorer, load_reward_funcs, reward_inputs
from mmrecipes.vlm.algorithms.sampling import generation_line
from mmrecipes.vlm.arguments import PromptDataArgs
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.prompts import PromptCollator, PromptPreprocessor

RED = Image.new("RGB", (32, 32), (220, 40, 40))
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
ROWS = [  # TRL's conversational prompt, its string prompt with an <image> placeholder, a chat row; extra columns
    {"prompt": QUESTION, "images": [RED], "solution": "red", OTHER_COLUMNS: json.dumps({"ground_truth": "2"})},
    {"prompt": "<image>What colour is it?", "images": [RED], OTHER_COLUMNS: json.dumps({"ground_truth": "6"})},
    {"messages": QUESTION + [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": [RED],
     OTHER_COLUMNS: json.dumps({"ground_truth": "5", "category": "colour"})},
]


@pytest.fixture(scope="module")
def prompts():
    """The rows as `Sampler.rollouts` gets them: read by `PromptPreprocessor`, batched by `PromptCollator`."""
    processor = AutoProcessor.from_pretrained(EMBEDDED / "tiny_sft_vlm")
    preprocess = PromptPreprocessor(PromptDataArgs(), AnswerLabeller(processor, [processor.tokenizer.eos_token_id]),
                                    max_length=64)
    columns = {key for row in ROWS for key in row}
    out = preprocess({key: [row.get(key) for row in ROWS] for key in columns})
    assert not preprocess.drops.totals  # the <image> placeholder of a string prompt is its image (was bad_row)
    rows = [dict(zip(out, values)) for values in zip(*out.values())]
    return PromptCollator(lambda rows: {})(rows)["prompts"]


def scored(funcs: str, prompts, texts, ids=None, timeout=None):
    scorer = RewardScorer(load_reward_funcs(funcs.split(","), ""), [1.0] * len(funcs.split(",")), timeout)
    reward_prompts, completions, columns = reward_inputs(prompts, texts)
    scores = scorer(reward_prompts, completions, ids or [[1] * len(text) for text in texts], columns)
    said = []
    return scores, scorer.take_failures(say=said.append), said


def test_rewards_get_what_trl_gives_them_conversational_or_not_with_every_column(prompts):
    """TRL's documented functions: the conversational format reward reads `completion[0]["content"]` (it raised on
    every completion here before), the standard one reads a `ground_truth` column (only `solution` came before), the
    first reads `completions_ids`, as TRL's docs spell it."""
    reward_prompts, completions, columns = reward_inputs(prompts, ["a", "b", "c"])
    assert reward_prompts == [QUESTION, "<image>What colour is it?", QUESTION]
    assert completions == [[{"role": "assistant", "content": "a"}], "b", [{"role": "assistant", "content": "c"}]]
    assert columns == {"category": [None, None, "colour"], "ground_truth": ["2", "6", "5"],
                       "solution": ["red", None, "red"]}
    texts = ["<think>red</think><answer>red</answer>", r" The solution is \boxed{6}.", "red"]
    scores, failures, said = scored("rewards_for_tests:format_reward_func", prompts[::2], texts[::2])
    assert scores[:, 0].tolist() == [1.0, 0.0] and not failures and not said
    scores, failures, _ = scored("rewards_for_tests:trl_example_3", prompts[1:2], texts[1:2])
    assert scores[:, 0].tolist() == [1.0] and not failures
    scores, failures, _ = scored("rewards_for_tests:trl_example_1", prompts, texts, ids=[[5, 2], [7], [1, 2, 3]])
    assert scores[:, 0].tolist() == [2.0, 1.0, 3.0] and not failures
    scores, failures, _ = scored("accuracy", prompts[::2], ["Red.", "blue"])  # ours takes either form
    assert scores[:, 0].tolist() == [1.0, 0.0] and not failures


def test_the_reward_functions_trl_ships_score_our_completions(prompts):
    """`trl.rewards`: think_format_reward and accuracy_reward (math-verify) on conversational completions, the soft
    overlong punishment on `completion_ids`."""
    import trl.rewards

    funcs = {"think": trl.rewards.think_format_reward, "math": trl.rewards.accuracy_reward,
             "overlong": trl.rewards.get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)}
    scorer = RewardScorer(funcs, [1.0] * 3)
    conversational = [prompts[0], prompts[2]]
    for prompt, solution in zip(conversational, (r"\frac{1}{3}", "4")):
        prompt["columns"]["solution"] = solution
    reward_prompts, completions, columns = reward_inputs(conversational, [
        r"<think>Divide.</think>My answer is \boxed{\frac{1}{3}}", r"\boxed{5}"])
    scores = scorer(reward_prompts, completions, [[1] * 3, [1] * 7], columns)
    assert scores.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, -0.75]] and not scorer.take_failures()


def test_a_reward_that_ends_the_process_or_gives_no_number_is_said_once_and_counted(prompts):
    scores, failures, said = scored("rewards_for_tests:exits", prompts[:2], ["a", "b"])
    assert torch.isnan(scores).all() and failures == {"rewards_for_tests:exits": 2}
    assert said == ["reward function rewards_for_tests:exits failed on rank 0: it called sys.exit(3), which would "
                    "end the run"]
    scores, failures, said = scored("rewards_for_tests:words", prompts, ["a", "b", "c"])
    assert failures == {"rewards_for_tests:words": 3} and len(said) == 1
    assert said[0].endswith("gave a str, not a number: 'high'")
    scores, _, said = scored("rewards_for_tests:sleeps", prompts[:1], ["a"], timeout=0.5)
    assert torch.isnan(scores).all() and said[0].endswith(
        "RewardTimeout: reward function rewards_for_tests:sleeps ran past --reward_timeout 0.5 s")


def test_huge_rewards_are_refused_with_a_reason_not_turned_into_zero_advantages(prompts):
    """1e308 overflowed the group's std: every advantage 0, and the log said `reward nan` with `failed 0`."""
    let_through = torch.tensor([1e308, -1e308, 1e308, -1e308], dtype=torch.float64)  # as the old scorer did
    assert not group_advantages(let_through, 4, "group")[0].any()  # no advantage: nothing learned
    scores, failures, said = scored("rewards_for_tests:huge", prompts, ["a", "b", "c"])
    assert torch.isnan(scores).all() and failures == {"rewards_for_tests:huge": 3} and len(said) == 1
    assert "beyond +/-1e+09" in said[0] and "scale the reward down" in said[0]


def test_a_function_failing_every_completion_of_a_window_stops_the_run_with_its_first_error(prompts):
    """A reward reading a column the data lacks failed every completion, and the run went on learning nothing."""
    scorer = RewardScorer(load_reward_funcs(["accuracy", "rewards_for_tests:always_fails"], ""), [1.0, 1.0])
    scorer(*reward_inputs(prompts, ["red"] * 3)[:2], [[1]] * 3, reward_inputs(prompts, ["red"] * 3)[2])
    scorer.check_window({"failed_accuracy": 1, "scored_accuracy": 2, "failed_rewards_for_tests:always_fails": 0,
                         "scored_rewards_for_tests:always_fails": 3}, 20)  # some scored: goes on
    with pytest.raises(RuntimeError, match=r"step 20: reward function rewards_for_tests:always_fails failed on all 6 "
                                           r"completions .* its first error: TypeError: .*'answer'"):
        scorer.check_window({"failed_accuracy": 0, "scored_accuracy": 6, "failed_rewards_for_tests:always_fails": 6,
                             "scored_rewards_for_tests:always_fails": 0}, 20)


def test_ds3_gather_for_generation_under_fsdp2_is_said_to_do_nothing():
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(deepspeed_plugin=None))
    assert "--ds3_gather_for_generation does nothing under FSDP2" in generation_line(fsdp, True)
    assert "ds3_gather" not in generation_line(fsdp, False)
