"""Sampling a step's completions for GRPO and distillation, alike on any number of ranks
(docs/grpo.md, "Rollouts").

Each completion draws from its own generator (`prompt_seed`: the run's seed, the step, the prompt's
tokens and pixels, its index), so one process and W ranks sample the same completions however the
data is split. Where the model is whole on a rank (`model_for_sampling`: DDP, ZeRO-1/2, one process,
ZeRO-3 with `ds3_gather_for_generation`), `generate_group` uses transformers' `generate` with its KV
cache; where every forward gathers parameters (FSDP2, ZeRO-3 without the gather), `sample_group`
forwards whole sequences a token at a time until every rank's completions have stopped. Both draw
the same tokens (`RowSampler`). `Sampler.rollouts`: a step's completions on this rank, as token ids
and as micro-batches to train on; GRPO scores them (`rewards.RewardScorer.score`).
"""

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ...distributed import all_ranks_true, batches_in_step, max_over_ranks
from ...images import to_device
from ..arguments import SamplingArgs
from ..model.evaluation import with_token_appended
from ..model.outputs import Logits
from ..rows.collate import chat_rows
from .trajectory import first_turns


@torch.no_grad()
def sample_group(model, prompt: dict, collator, args: SamplingArgs, stop_ids, seed: int, device, suppressed=(),
                 indices=None, live=True, budget=None):
    """[(completion token ids, truncated)] of the completions `indices` (default: all
    --num_generations) of `prompt`'s group, each from its own generator (`seed` + its index),
    sampled at --temperature within --top_p (never a `suppressed` token: `placeholder_token_ids`),
    each up to its first stop token (included) or --max_completion_length tokens (truncated), with
    forwards until every rank's completions have stopped (`live` False: a filler whose completions
    count as stopped, forwarded only while another rank samples; `budget`: fewer tokens than
    --max_completion_length, the rest of a multi-turn completion's)."""
    indices = range(args.num_generations) if indices is None else indices
    inputs = to_device(collator(chat_rows(prompt, [[]] * len(indices), [False] * len(indices))), device)
    sampler = RowSampler(indices, seed, args, suppressed)
    completions, stopped, ended = [[] for _ in indices], [not live] * len(indices), [False] * len(indices)
    budget = args.max_completion_length if budget is None else budget
    for _ in range(args.max_completion_length):  # as often on every rank, whatever its budgets
        if not max_over_ranks(torch.tensor(float(not all(stopped)), device=device)).item():
            break  # every rank's completions have stopped
        tokens = torch.tensor(sampler.draw(model(inputs, Logits())[:, -1]))
        for index, token in enumerate(tokens.tolist()):
            if not stopped[index]:
                completions[index].append(token)
                ended[index] = token in stop_ids
                stopped[index] = ended[index] or len(completions[index]) >= budget
        inputs = with_token_appended(inputs, tokens.to(device))
    return [(completion, not done) for completion, done in zip(completions, ended)]


@torch.no_grad()
def generate_group(model, prompt: dict, collator, args: SamplingArgs, stop_ids, seed: int, device, suppressed=(),
                   indices=None, budget=None):
    """What `sample_group` samples, by `generate` with a KV cache, on a `VLMForTraining` whole on
    this rank (no collective in its forward: `model_for_sampling`): the prompt as the processor gave
    it (a text-only prompt without the dummy image, which only keeps sharded ranks in step), each
    completion's token drawn from its own generator (`RowSampler`, which leaves greedy search only
    that token)."""
    indices = range(args.num_generations) if indices is None else indices
    batch = to_device(collator(chat_rows(prompt, [[]] * len(indices), [False] * len(indices))), device)
    dummies = model.dummy_input_names(batch)
    inputs = {name: value for name, value in batch.items() if name in model.forward_input_names - dummies - {"labels"}}
    budget = args.max_completion_length if budget is None else budget
    config = GenerationConfig(max_new_tokens=budget, do_sample=False, eos_token_id=list(stop_ids),
                              pad_token_id=collator.pad_token_id)
    sampler = RowSampler(indices, seed, args, suppressed)
    generated = model.model.generate(**inputs, generation_config=config, synced_gpus=False,
                                     logits_processor=LogitsProcessorList([sampler]))
    completions = []
    for row in generated[:, inputs["input_ids"].shape[1]:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stop_ids), None)
        completions.append((row[:end], False) if end else (row[:budget], True))
    return completions


class RowSampler(LogitsProcessor):
    """Each row's next token (`draw`), the row of completion `indices[i]` from its own generator
    (`seed` + that index), at --temperature within --top_p, never a `suppressed` token. Both
    samplers draw with it; as `generate`'s last logits processor it leaves only the drawn token a
    finite score, for greedy search to take."""

    def __init__(self, indices, seed: int, args: SamplingArgs, suppressed=()):
        self.generators = [torch.Generator().manual_seed(seed + index) for index in indices]
        self.args, self.suppressed = args, list(suppressed)

    def draw(self, scores: torch.Tensor) -> list[int]:
        logits = scores.float().cpu()
        logits[:, self.suppressed] = -torch.inf
        return [_sampled(row, generator, self.args.temperature, self.args.top_p)
                for row, generator in zip(logits, self.generators)]

    def __call__(self, input_ids, scores):
        tokens = self.draw(scores)
        chosen = torch.full_like(scores, -torch.inf)
        chosen[torch.arange(len(tokens), device=scores.device), torch.tensor(tokens, device=scores.device)] = 0.0
        return chosen


def _sampled(logits: torch.Tensor, generator, temperature: float, top_p: float) -> int:
    probabilities = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:  # the smallest set of most likely tokens whose probability reaches top_p
        ordered, order = probabilities.sort(descending=True)
        keep = ordered.cumsum(0) - ordered < top_p
        probabilities = torch.zeros_like(probabilities).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probabilities, 1, generator=generator))


class Sampler:
    """What every step's sampling takes: the accelerator (the engine decides how:
    `model_for_sampling`), the collator, the sampling flags (`SamplingArgs`), the stop ids, the ids
    never sampled (`placeholder_token_ids`) and, for multi-turn rollouts, `tools` (`tools.Tools`:
    completions go on after their tool calls' results)."""

    def __init__(self, accelerator, collator, args: SamplingArgs, stop_ids, suppressed, tools=None):
        self.accelerator, self.collator, self.args = accelerator, collator, args
        # with tools, also where the template ends a calling turn (`tools.ToolFormat.extra_stops`)
        self.stop_ids = list(stop_ids) + (tools.format.extra_stops if tools is not None else [])
        self.suppressed, self.tools = list(suppressed), tools

    def describe(self) -> str:
        line = generation_line(self.accelerator, self.args.ds3_gather_for_generation)
        return f"{line}\n{self.tools.describe()}" if self.tools is not None else line

    def rollouts(self, model, prompts, layout, seed: int, gather: bool | None = None,
                 mask_truncated: bool = False) -> "Rollouts":
        """This rank's completions of the team's `prompts` (`GroupLayout.pieces`), sampled as the
        engine allows (`model_for_sampling`; `gather` None: --ds3_gather_for_generation),
        `sample`'s."""
        gather = self.args.ds3_gather_for_generation if gather is None else gather
        with model_for_sampling(self.accelerator, model, gather) as (sampling, whole):
            return self.sample(sampling, whole, prompts, layout, seed, mask_truncated)

    def sample(self, model, whole: bool, prompts, layout, seed: int, mask_truncated: bool = False) -> "Rollouts":
        """Each completion a `Trajectory`: its group's first turn from `prompt_seed(seed, prompt)`
        (`seed`: the run's + the step), and with tools its further turns (`tools.Tools.rollout`); in
        micro-batches of `layout.micro_batch` whose targets are the model's tokens (none for a
        truncated completion where `mask_truncated`: GRPO's --mask_truncated_completions)."""
        started = time.perf_counter()
        draw = self.drawing(model, whole, prompts[0])
        if self.tools is None:
            trajectories, multi_turn = first_turns(draw, prompts, layout, seed), {}
        else:  # multi-turn: environments, tool turns, the calls' counts
            trajectories, multi_turn = self.tools.rollout(draw, prompts, layout, seed, self.accelerator)
        rows = [trajectory.row(not (trajectory.truncated and mask_truncated)) for trajectory in trajectories]
        return Rollouts(completions=[(trajectory.prompt, trajectory.ids) for trajectory in trajectories],
                        micro_batches=[self.collator(rows[start:start + layout.micro_batch])
                                       for start in range(0, len(rows), layout.micro_batch)],
                        lengths=[sum(trajectory.own) for trajectory in trajectories],
                        truncated=[trajectory.truncated for trajectory in trajectories],
                        seconds=time.perf_counter() - started, **multi_turn)

    def drawing(self, model, whole: bool, filler: dict) -> "Drawing":
        """The sampling call bound to `model` (`whole` on this rank or not) and a `filler`
        prompt."""
        return Drawing(self, model, whole, filler)


class Drawing:
    """`draw(requests)`: a group of [(completion ids, truncated)] for each of this rank's requests
    ((prompt, seed, completion indices, budget or None)), by `generate_group` on a `whole` model,
    else by `sample_group` as many times on every rank (the `filler` prompt where a rank has fewer);
    `on_every_rank(flag)`: whether `flag` holds on every rank (each rank's own where the model is
    whole: no rank waits for another)."""

    def __init__(self, sampler: Sampler, model, whole: bool, filler: dict):
        self.sampler, self.model, self.whole, self.filler = sampler, model, whole, filler
        self.device = sampler.accelerator.device

    def __call__(self, requests: list) -> list:
        sampler, groups = self.sampler, []
        for (prompt, seed, indices, budget), real in in_step(requests, self.whole, (self.filler, 0, [0], None),
                                                             self.device):
            sample = generate_group if self.whole else partial(sample_group, live=real)
            group = sample(self.model, prompt, sampler.collator, sampler.args, sampler.stop_ids, seed, self.device,
                           sampler.suppressed, indices, budget=budget)
            if real:
                groups.append(group)
        return groups

    def on_every_rank(self, flag: bool) -> bool:
        return flag if self.whole else all_ranks_true(flag, self.device)


def in_step(items, whole: bool, filler, device):
    """(item, real) for this rank's `items`: all of them where the model is whole on the rank; else,
    as `batches_in_step`, then (`filler`, False) until every rank has run out (each forward is a
    collective)."""
    return [(item, True) for item in items] if whole else batches_in_step(items, filler, device)


@dataclass
class Rollouts:
    """A batch of completions on this rank, built once from its trajectories (`Sampler.sample`):
    each with its prompt (`completions`: (prompt, token ids)), the micro-batches to train on
    (`ChatCollator` batches), each completion's length (the model's tokens) and truncation, the
    seconds sampling took, and (GRPO's) its rewards per function (NaN where one failed)."""

    completions: list = field(default_factory=list)
    # multi-turn: each completion as reward functions get it (messages)
    conversations: list | None = None
    environments: list | None = None  # and its environment (`--environment_factory`), or None
    micro_batches: list = field(default_factory=list)
    scores: torch.Tensor | None = None
    lengths: list = field(default_factory=list)
    truncated: list = field(default_factory=list)
    seconds: float = 0.0
    trained: int = 0  # optimizer steps trained on them so far (--num_iterations)
    # multi-turn: tool calls and failed calls (`Tools.take_counts`)
    tool_counts: dict = field(default_factory=dict)
    # where the template writes reasoning: each completion cut inside it (`rewards.RewardScorer.score`)
    in_reasoning: list | None = None

    def sums(self, rewards, zero_std, failures, names, counted: bool = True) -> dict:
        """This rank's sums for the log (summed over ranks and steps by `Report`): the rewards, the
        completions and the seconds they took; zeros where not `counted` (a sequence-parallel peer
        sampled the same)."""
        scores, valid = self.scores, ~rewards.isnan()
        sums = {"completions": len(rewards), "scored": valid.sum(), "reward": rewards[valid].sum(),
                "reward_square": (rewards[valid] ** 2).sum(), "zero_std": zero_std.sum(), "length": sum(self.lengths),
                "truncated": sum(self.truncated), "generation_seconds": self.seconds} | self.tool_counts | (
                    {"truncated_in_reasoning": sum(self.in_reasoning)} if self.in_reasoning is not None else {})
        for index, name in enumerate(names):
            sums |= {f"reward_{name}": scores[:, index].nan_to_num(0).sum(), f"failed_{name}": failures[name],
                     f"scored_{name}": (~scores[:, index].isnan()).sum()}
        return {key: torch.as_tensor(value, dtype=torch.float32) * counted for key, value in sums.items()}



def _zero3(accelerator: Accelerator) -> bool:
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


def generation_line(accelerator: Accelerator, gather: bool) -> str:
    """How `model_for_sampling` samples, for the log."""
    if _zero3(accelerator):
        return ("sampling: generate, the whole model gathered on every rank once a step (--ds3_gather_for_generation)"
                if gather else "sampling: each layer gathered in each forward, every rank forwarding until all are "
                               "done (--ds3_gather_for_generation true: the whole model, once a step, and generate)")
    if accelerator.distributed_type == DistributedType.FSDP:
        return "sampling: each block gathered in each forward, every rank forwarding until all are done" + (
            " (--ds3_gather_for_generation does nothing under FSDP2: it gathers for ZeRO-3 only)" if gather else "")
    return "sampling: generate, the whole model on every rank" + (
        " (--ds3_gather_for_generation does nothing without ZeRO-3)" if gather else "")


@contextmanager
def model_for_sampling(accelerator: Accelerator, model, gather: bool):
    """(the module to sample with, whether it is whole on this rank). Whole: no collective in its
    forward, so each rank may `generate` on its own (DDP, ZeRO-1/2, one process; and ZeRO-3 with
    `gather`, TRL's `ds3_gather_for_generation`: every parameter gathered on every rank once, the
    engine's fetch and release hooks off for the while, at a whole model's memory per rank; they
    come back as TRL 1.16 puts them back). Not whole (FSDP, ZeRO-3 without `gather`): the prepared
    model, whose every forward gathers parameters on every rank."""
    if accelerator.distributed_type == DistributedType.FSDP:
        yield model, False
    elif not _zero3(accelerator):
        # the prepared forward's mixed precision, which unwrapping leaves behind
        with accelerator.autocast():
            yield accelerator.unwrap_model(model), True
    else:
        with _gathered(accelerator, model) if gather else nullcontext((model, False)) as sampling:
            yield sampling


@contextmanager
def _gathered(accelerator: Accelerator, model):
    import deepspeed

    offload = getattr(model.optimizer, "parameter_offload", model.optimizer)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        # (name, parameter) pairs
        external = getattr(offload.module, "ds_external_parameters", dict)()
        for parameter in [*offload.module.parameters(), *(parameter for _, parameter in external)]:
            parameter.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield accelerator.unwrap_model(model), True
        finally:
            # its trace of the training forward's order is stale now
            coordinator = offload.param_coordinator
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)
