"""Reward functions a test names by import path (`--reward_funcs rewards_for_tests:flaky`)."""

import math
import re
import sys
import time

calls = {"flaky": 0}


def flaky(prompts, completions, completion_ids, **columns):
    """Raises on every other call; otherwise NaN for the first completion, None for the second, 1.0 for the rest."""
    calls["flaky"] += 1
    if calls["flaky"] % 2 == 0:
        raise RuntimeError("the judge is down")
    return [math.nan, None] + [1.0] * (len(completions) - 2)


def length_or_nan(prompts, completions, completion_ids, **columns):
    """The completion's length in tokens, NaN where it is 3 or 7: deterministic, spread out, and failing some
    completions (never all of a group cut at a length of 6 or 8), wherever they are scored."""
    return [math.nan if len(ids) in (3, 7) else float(len(ids)) for ids in completion_ids]


# TRL 1.16's documented reward functions (docs/source/grpo_trainer.md, "Using a custom reward function"), copied
# verbatim but for the names of Examples 1 and 3, which TRL names both `reward_func`
def trl_example_1(completions_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completions_ids]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def trl_example_3(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


# Rewards that misbehave as users' rewards do
def exits(completions, **kwargs):
    """Ends the process, with the code the first completion's length gives (0 or 3)."""
    sys.exit(0 if len(completions) % 2 else 3)


def huge(completions, **kwargs):
    """+/-1e308: finite, and beyond what a group's statistics can square."""
    return [1e308 if index % 2 else -1e308 for index in range(len(completions))]


def words(completions, **kwargs):
    return ["high"] * len(completions)


def always_fails(completions, answer, **kwargs):
    """Reads a column the data does not have."""
    return [1.0] * len(completions)


def sleeps(completions, **kwargs):
    time.sleep(30)
    return [1.0] * len(completions)


def retries(completions, **kwargs):
    """Retries forever on any Exception, as an HTTP-calling reward is written: it swallowed SIGALRM's TimeoutError."""
    while True:
        try:
            time.sleep(1)
        except Exception:  # noqa: BLE001 (the user's code)
            pass


def swallows_everything(completions, **kwargs):
    """Retries forever on anything at all (a bare except)."""
    while True:
        try:
            time.sleep(1)
        except BaseException:  # noqa: BLE001 (the user's code)
            pass


def fails_off_rank_0(completions, **kwargs):
    """1.0 on rank 0; raises on any other rank (of the process group, or of the RANK the launcher set)."""
    import os

    if int(os.environ.get("RANK", "0")):
        raise RuntimeError("the judge is down on this node")
    return [1.0] * len(completions)


def token_spread(completion_ids, **kwargs):
    """The completion's token ids summed, mod 7: a spread in every group, whatever the completions' lengths."""
    return [float(sum(ids) % 7) for ids in completion_ids]
