"""Reward functions a test names by import path (`--reward_funcs rewards_for_tests:flaky`)."""

import math

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
