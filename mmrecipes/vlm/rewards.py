"""Verifiable rewards for GRPO, TRL's way: `func(prompts, completions, completion_ids, **columns) -> list[float]`.

Built in: `accuracy` (the completion against the row's `solution`) and `format` (a regex over the whole completion,
`--format_pattern`). A user's function comes by import path, `mypkg.rewards:my_reward`. A function that raises, or
gives None or NaN for a completion, fails that completion: `RewardScorer` counts it per function, and the recipe gives
the completion no advantage and leaves it out of its group's statistics (TRL sums the other functions instead).
"""

import importlib
import math
import re
from collections import Counter

import torch

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def completion_text(completion) -> str:
    """A completion as text: a string, or a conversational completion's (`[{"role": "assistant", ...}]`)."""
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"]
    return content if isinstance(content, str) else " ".join(part.get("text") or "" for part in content)


def normalised(text: str) -> str:
    """Lower case, the `<answer>` tag's text if there is one, no surrounding punctuation, spaces collapsed."""
    tagged = ANSWER_TAG.search(text)
    text = tagged.group(1) if tagged else text
    return " ".join(text.lower().strip().strip(".!?,;:").split())


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def accuracy(prompts, completions, completion_ids=None, *, solution, **columns) -> list[float]:
    """1.0 where the completion matches the solution after `normalised` (numbers as numbers: "3.0" is "3"), else 0."""
    rewards = []
    for completion, answer in zip(completions, solution):
        if answer is None:  # failed and counted, never scored against the text "None"
            raise ValueError("a prompt without a solution")
        given, expected = normalised(completion_text(completion)), normalised(str(answer))
        numbers = _number(given), _number(expected)
        same = numbers[0] == numbers[1] if None not in numbers else given == expected
        rewards.append(float(same))
    return rewards


def format_reward(pattern: str):
    """A reward function: 1.0 where the whole completion matches `pattern` (re.DOTALL), else 0."""
    regex = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, completion_ids=None, **columns) -> list[float]:  # noqa: A001 (TRL's name)
        return [float(regex.fullmatch(completion_text(completion).strip()) is not None) for completion in completions]

    return format


def load_reward_funcs(names: list[str], format_pattern: str) -> dict:
    """{name: function} for `--reward_funcs`: the built-ins by name, others by `module:function` import path."""
    funcs = {}
    for name in names:
        if name == "accuracy":
            funcs[name] = accuracy
        elif name == "format":
            funcs[name] = format_reward(format_pattern)
        elif ":" in name:
            module, _, attribute = name.partition(":")
            try:
                funcs[name] = getattr(importlib.import_module(module), attribute)
            except (ImportError, AttributeError) as error:
                raise ValueError(f"--reward_funcs {name}: cannot import it ({error})") from error
        else:
            raise ValueError(f"--reward_funcs {name}: accuracy, format, or a function's import path module:function")
    return funcs


def _finite(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):  # None, or not a number
        return None
    return number if math.isfinite(number) else None


class RewardScorer:
    """`scorer(prompts, completions, completion_ids, columns)` -> [completions, functions] rewards, NaN where a
    function failed (raised, or gave None or NaN); `failures` counts them per function since the last `take`, and
    `errors` holds the first error each function raised in the run (once)."""

    def __init__(self, funcs: dict, weights: list[float]):
        self.funcs, self.weights = funcs, torch.tensor(weights, dtype=torch.float64)
        self.failures, self.errors, self.reported = Counter(), {}, set()

    def __call__(self, prompts, completions, completion_ids, columns: dict) -> torch.Tensor:
        scores = torch.full((len(completions), len(self.funcs)), math.nan, dtype=torch.float64)
        for column, (name, func) in enumerate(self.funcs.items()):
            try:
                values = list(func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
                if len(values) != len(completions):
                    raise ValueError(f"gave {len(values)} rewards for {len(completions)} completions")
            except Exception as error:  # a user's function must not end the run: counted, the reason said once
                if name not in self.reported:
                    self.reported.add(name)
                    self.errors[name] = f"{type(error).__name__}: {error}"
                values = [None] * len(completions)
            for row, value in enumerate(values):
                number = _finite(value)
                if number is None:
                    self.failures[name] += 1
                else:
                    scores[row, column] = number
        return scores

    def total(self, scores: torch.Tensor) -> torch.Tensor:
        """The weighted sum per completion; NaN where any function failed."""
        return (scores * self.weights).sum(dim=1)

    def take_failures(self, say=print, rank: int = 0) -> Counter:
        """Failed completions per function since the last call, then reset; each error not yet said goes to `say`."""
        for name, error in self.errors.items():
            say(f"reward function {name} failed on rank {rank}: {error}")
        taken, self.failures, self.errors = self.failures, Counter(), {}
        return taken
