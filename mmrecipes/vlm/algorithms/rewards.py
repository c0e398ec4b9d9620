"""Verifiable rewards for GRPO, TRL's way: `func(prompts, completions, completion_ids, **columns) ->
list[float]`.

As TRL 1.16 calls them: a conversational prompt's completions are `[{"role": "assistant", "content":
text}]`, a string prompt's are strings; every other column of the rows comes as a keyword
(`solution`, `answer`, ...). Built in: `accuracy` (the completion against the row's `solution`) and
`format` (a regex over the whole completion, `--format_pattern`). A user's function comes by import
path, `mypkg.rewards:my_reward`.

A function that raises (`sys.exit` included), runs past --reward_timeout, or gives something that is
not a finite number of at most `MAX_REWARD` (None, NaN, a string, 1e308) fails that completion:
`RewardScorer` counts it per function and says each kind of failure once, with the ranks it happened
on, in the main log; the recipe gives the completion no advantage and leaves it out of its group's
statistics (TRL sums the other functions instead). A function that fails every completion of a
logging window stops the run with its first error (`check_window`).

The timeout is a `RewardTimeout`, which is no `Exception`: a function that retries on every
Exception (as HTTP clients are written) cannot swallow it; one that swallows even that is timed out
again every second, and `STUCK_S` seconds later the process ends, naming it. A reward module whose
import blocks is timed out the same way, naming the module (`user_code`, which tools share). What no
function in the process can be stopped from is ending the process itself (`os._exit`, a crash): run
such code in a process of its own inside the reward (docs/grpo.md).
"""

import inspect
import math
import re
from collections import Counter

import torch
from accelerate.utils import gather_object

from .user_code import RewardTimeout, Unscored, awaited, imported, time_limit

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Larger rewards are refused: squared in a group's std (and the log's float32 sums) they would overflow, leaving every
# advantage 0 or NaN (1e308 did)
MAX_REWARD = 1e9


def completion_text(completion) -> str:
    """A completion as text: a string, or a conversational completion's (`[{"role": "assistant",
    ...}]`)."""
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"]
    return content if isinstance(content, str) else " ".join(part.get("text") or "" for part in content)


def normalised(text: str) -> str:
    """Lower case, the `<answer>` tag's text if there is one, no surrounding punctuation, spaces
    collapsed."""
    tagged = ANSWER_TAG.search(text)
    text = tagged.group(1) if tagged else text
    return " ".join(text.lower().strip().strip(".!?,;:").split())


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def accuracy(prompts, completions, completion_ids=None, *, solution=None, **columns) -> list[float]:
    """1.0 where the completion matches the solution after `normalised` (numbers as numbers: "3.0"
    is "3"), else 0."""
    if solution is None:
        raise ValueError("no row has a solution column (chat rows: an assistant answer) to compare with")
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
    """A reward function: 1.0 where the model's whole turn matches `pattern` (re.DOTALL), else 0. The
    turn is the completion as text (`completion_texts`: its reasoning too, where the answer alone is
    `content`), after what the template's `generation_prompt` already wrote of it: a
    completion of Qwen3.5's think templates starts inside the `<think>` block their prompt opened
    (TRL's `think_format_reward` scores it 0, TRL #6966), so the completion matches if some end of
    the generation prompt put before it does."""
    regex = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, completion_ids=None, generation_prompt="", completion_texts=None,  # noqa: A001
               **columns):
        written = [generation_prompt[start:] for start in range(len(generation_prompt), -1, -1)]
        texts = completion_texts or [completion_text(completion) for completion in completions]
        return [float(any(regex.fullmatch((before + text).strip()) for before in written)) for text in texts]

    return format


def load_reward_funcs(names: list[str], format_pattern: str, timeout: float | None = None) -> dict:
    """{name: function} for `--reward_funcs`: the built-ins by name, others by `module:function`
    import path, each import within `timeout` seconds (--reward_timeout)."""
    funcs = {}
    for name in names:
        if name == "accuracy":
            funcs[name] = accuracy
        elif name == "format":
            funcs[name] = format_reward(format_pattern)
        elif ":" in name:
            funcs[name] = imported(name, "--reward_funcs", timeout, "--reward_timeout")
        else:
            raise ValueError(f"--reward_funcs {name}: accuracy, format, or a function's import path module:function")
    return funcs


def reward_inputs(prompts: list[dict], texts: list[str], messages: list | None = None) -> tuple[list, list, dict]:
    """(prompts, completions, columns) as TRL hands them to reward functions: a conversational
    prompt's completion as `[message]`, the turn read into its reasoning, answer and calls
    (`messages`: `responses.ResponseFormat.parse`; without, `{"role": "assistant", "content":
    text}`), a string prompt's as its text; each column one value per completion (None where a
    prompt lacks it)."""
    messages = messages or [{"role": "assistant", "content": text} for text in texts]
    completions = [[message] if isinstance(prompt["prompt"], list) else text
                   for prompt, text, message in zip(prompts, texts, messages)]
    names = sorted({name for prompt in prompts for name in prompt["columns"]})
    return ([prompt["prompt"] for prompt in prompts], completions,
            {name: [prompt["columns"].get(name) for prompt in prompts] for name in names})


def _parameters(func) -> set[str]:
    try:
        return set(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return set()


def _reward(value) -> tuple[float, str | None, str | None]:
    """(the reward, None, None) of a value a function gave, or (NaN, the kind of failure, why it is
    not a reward)."""
    if value is None:
        return math.nan, "None", "gave None (TRL's way to leave a completion unscored)"
    if isinstance(value, Unscored):
        return math.nan, "unscored", value.why
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan, "type", f"gave a {type(value).__name__}, not a number: {value!r:.40}"
    if math.isnan(number):
        return math.nan, "NaN", "gave NaN"
    if not abs(number) <= MAX_REWARD:
        return math.nan, "huge", (f"gave {number:g}, beyond +/-{MAX_REWARD:g} (its group's statistics would "
                                  "overflow): scale the reward down")
    return number, None, None


class RewardScorer:
    """`scorer(prompts, completions, completion_ids, columns)` -> [completions, functions] rewards,
    NaN where a function failed (`_reward`; or it raised, or ran past `timeout` seconds); `failures`
    counts them per function since the last `take_failures`, which says each function's first
    failure of each kind once; `first_errors` keeps each function's first failure in the run for
    `check_window`."""

    def __init__(self, funcs: dict, weights: list[float], timeout: float | None = None, generation_prompt: str = "",
                 responses=None):
        self.funcs, self.weights = funcs, torch.tensor(weights, dtype=torch.float64)
        self.timeout, self.generation_prompt = timeout, generation_prompt
        self.responses = responses  # how a turn reads (`responses.ResponseFormat`): TRL's parsed completions
        # TRL's docs name the token ids `completions_ids` in their first example, where its trainer passes
        # `completion_ids`: a function that asks for the documented name gets them under it too
        self.ids_as_documented = {name for name, func in funcs.items() if "completions_ids" in _parameters(func)}
        self.given_environments = {name for name, func in funcs.items() if "environments" in _parameters(func)}
        # what the template wrote of the turn before the model, and the turns as text (`format`), to a function
        # that asks for them
        self.given_prompt = {name for name, func in funcs.items() if "generation_prompt" in _parameters(func)}
        self.given_texts = {name for name, func in funcs.items() if "completion_texts" in _parameters(func)}
        self.failures, self.errors, self.said, self.first_errors = Counter(), [], set(), {}

    def __call__(self, prompts, completions, completion_ids, columns: dict, environments=None,
                 texts=None) -> torch.Tensor:
        scores = torch.full((len(completions), len(self.funcs)), math.nan, dtype=torch.float64)
        for column, (name, func) in enumerate(self.funcs.items()):
            ids = {"completion_ids": completion_ids} | (
                {"completions_ids": completion_ids} if name in self.ids_as_documented else {}) | (
                {"environments": environments} if environments and name in self.given_environments else {}) | (
                {"generation_prompt": self.generation_prompt} if name in self.given_prompt else {}) | (
                {"completion_texts": texts} if texts is not None and name in self.given_texts else {})
            try:
                with time_limit(self.timeout, f"reward function {name}", "--reward_timeout", RewardTimeout):
                    values = list(awaited(func(prompts=prompts, completions=completions, **ids, **columns)))
                if len(values) != len(completions):
                    raise ValueError(f"gave {len(values)} rewards for {len(completions)} completions")
            # a user's function must not end the run
            except (Exception, SystemExit, RewardTimeout) as error:
                why = (f"it called sys.exit({error.code!r}), which would end the run" if isinstance(error, SystemExit)
                       else f"{type(error).__name__}: {error}")
                self._failed(name, type(error).__name__, why, len(completions))
                continue
            for row, value in enumerate(values):
                scores[row, column], kind, why = _reward(value)
                if kind:
                    self._failed(name, kind, why)
        return scores

    def score(self, rollouts, tokenizer, stop_ids) -> torch.Tensor:
        """The completions of `rollouts` (`sampling.Rollouts`: (prompt, token ids) each) decoded
        (without their stop tokens), read into reasoning, answer and calls (`responses`), and scored
        as TRL hands them to reward functions (`reward_inputs`); multi-turn ones as their
        conversations (the assistant's and the tools' messages, TRL's way), with their environments
        to a function that asks for them (an environment's `get_reward`: `tools.Tools.reward`).
        Where the template writes reasoning, the completions cut inside it are marked
        (`rollouts.in_reasoning`)."""
        prompts, ids = zip(*rollouts.completions)
        texts = [tokenizer.decode([token for token in row if token not in stop_ids], skip_special_tokens=True)
                 for row in ids]
        messages = None
        # a template that writes neither reasoning nor calls: the decoded text, as TRL gives it without a template
        if self.responses is not None and self.responses.structured:
            # multi-turn: each turn was read as it was sampled (`tools.Tools.read`); the last one is the completion's
            messages = ([conversation[-1] for conversation in rollouts.conversations] if rollouts.conversations else
                        [self.responses.parse(row, prompt["input_ids"].tolist()) for prompt, row in zip(prompts, ids)])
            if "reasoning_content" in self.responses.template.get("fields", {}):
                rollouts.in_reasoning = [cut and self.responses.cut_in_reasoning(message, row)
                                         for cut, message, row in zip(rollouts.truncated, messages, ids)]
        reward_prompts, values, columns = reward_inputs(prompts, texts, messages)
        return self(reward_prompts, rollouts.conversations or values, list(ids), columns, rollouts.environments,
                    texts)

    def _failed(self, name: str, kind: str, why: str, completions: int = 1):
        """Count a failure; the first of each `kind` per function is said (`take_failures`)."""
        self.failures[name] += completions
        self.first_errors.setdefault(name, why)
        if (name, kind) not in self.said:
            self.said.add((name, kind))
            self.errors.append((name, why))

    def total(self, scores: torch.Tensor) -> torch.Tensor:
        """The weighted sum per completion; NaN where any function failed."""
        return (scores * self.weights).sum(dim=1)

    def take_failures(self, accelerator=None, say=print) -> Counter:
        """Failed completions per function on this rank since the last call, then reset. Each
        failure not yet said, on any rank, is said once with the ranks it happened on: by
        `accelerator.print` in the main log, gathered from every rank (a collective: every rank
        calls this at the same step), or by `say` in one process."""
        rank = 0 if accelerator is None else accelerator.process_index
        errors = [(name, why, rank) for name, why in self.errors]
        if accelerator is not None:
            errors, say = gather_object(errors), accelerator.print
        ranks = {}
        for name, why, where in errors:
            ranks.setdefault((name, why), []).append(where)
        for (name, why), where in ranks.items():
            say(f"reward function {name} failed on rank{'s' * (len(where) > 1)} {', '.join(map(str, where))}: {why}")
        taken, self.failures, self.errors = self.failures, Counter(), []
        return taken

    def check_window(self, sums: dict, step: int):
        """Stop the run (every rank alike: `sums` are a logging window's, over all ranks) where a
        function failed on every completion of the window: it would keep every advantage at 0, and
        the run would learn nothing."""
        for name in self.funcs:
            if sums[f"failed_{name}"] and not sums[f"scored_{name}"]:
                raise RuntimeError(
                    f"step {step}: reward function {name} failed on all {int(sums[f'failed_{name}'])} completions "
                    f"of the last logging window, so nothing was learned; its first error: "
                    f"{self.first_errors.get(name, 'on another rank')}")
