"""GRPO and its variants (TRL 1.16's loss types grpo, bnpo, dr_grpo, dapo) for image-text-to-text models.

- Prompts (`PromptPreprocessor`): TRL's rows (`prompt`: a string or a conversation, `images`, `solution`) or chat rows
  in any layout `chat_data` reads whose last assistant turn is the solution, rendered with the processor's generation
  prompt; unreadable rows are skipped and counted as in SFT.
- Rollouts (`Rollouts`, by `mmrecipes.vlm.sampling`): this rank's completions sampled, decoded and scored.
- Where completions sit (`GroupLayout`): a step's completions are whole groups; a group's may sit on several
  micro-batches and ranks, which sample and score their own and share the rewards (one all-reduce) for the statistics.
- Advantages (`group_advantages`): each reward minus its group's mean, divided by the group's (or the whole step's)
  unbiased std + 1e-4, or not; a completion a reward function failed on gets 0 and is left out of the statistics.
- Loss (`token_losses`, `LossNormaliser`): the clipped surrogate with the k3 KL, per token, then normalised over the
  optimizer step on every rank: grpo, each completion's token mean averaged over completions; dr_grpo, the token sum
  over completions x max_completion_length; dapo and bnpo, the token sum over tokens (TRL's bnpo divides per rank and
  micro-batch, so here bnpo is dapo).
"""

import json
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from ..distributed import batches_in_step, sum_over_ranks
from ..skips import Skip
from ..sources import OTHER_COLUMNS
from .arguments import GRPOArgs
from .chat_data import (
    CHAT_COLUMNS,
    CHAT_COUNTED,
    BadRow,
    ChatPreprocessor,
    _media,
    _turn,
    has_video,
    media_folder,
    prompt_row,
    row_images,
    string_prompt,
    to_chat,
)
from .sampling import chat_rows, generate_group, prompt_seed, sample_group

PROMPT_COLUMNS = [*CHAT_COLUMNS, "prompt", "solution", OTHER_COLUMNS]
CLIP_COUNTS = ("low", "high", "region")  # TRL's clip_ratio/low_mean, high_mean, region_mean


def check_settings(args: GRPOArgs, max_length: int):
    """Refuse, before anything loads, what the recipe cannot run as asked."""
    if args.max_completion_length >= max_length:
        raise ValueError(f"--max_completion_length {args.max_completion_length} leaves no room for a prompt within "
                         f"--max_length {max_length}: raise --max_length")


def prompt_chat(row) -> tuple[list, list, str | list, dict]:
    """(prompt messages, raw images, the prompt as reward functions get it, the columns they get as keywords) of a
    TRL prompt row or of a chat row. As TRL passes them: a string prompt as it is, a conversation as messages; every
    column but the prompt and the media (`OTHER_COLUMNS`), `id` and `solution` (a chat row's: its last answer,
    unless it has a `solution` column)."""
    columns = json.loads(row.get(OTHER_COLUMNS) or "{}")
    columns |= {name: row[name] for name in ("id", "solution") if row.get(name) is not None}
    if row.get("prompt") is not None:
        images, prompt = _media(row, "images", "image"), row["prompt"]
        if isinstance(prompt, str):
            return [string_prompt(prompt, images)], images, prompt, columns
        if not isinstance(prompt, list) or not prompt:
            raise BadRow("prompt is neither a string nor a conversation")
        messages = [_turn(turn) for turn in prompt]
        return messages, images, messages, columns
    messages, images, _ = to_chat(row)
    answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not answers:
        raise BadRow("no prompt column and no assistant turn to take the solution from")
    solution = " ".join(part["text"] for part in messages[answers[-1]]["content"] if part["type"] == "text")
    return messages[:answers[-1]], images, messages[:answers[-1]], {"solution": solution.strip()} | columns


class PromptPreprocessor(ChatPreprocessor):
    """Batched `datasets.map` function: prompt rows in; {input_ids, media_inputs, reward_prompt, reward_columns (both
    JSON: `prompt_chat`)} out, each rendered with the generation prompt; bad rows dropped and counted
    (`ChatPreprocessor`'s counts). Its `max_length` is the prompt's: the recipe gives --max_length less
    --max_completion_length."""

    COLUMNS = PROMPT_COLUMNS
    OUTPUTS = ("input_ids", "media_inputs", "reward_prompt", "reward_columns")

    def example(self, row):
        try:
            messages, raw_images, reward_prompt, columns = prompt_chat(row)
            if has_video(row, messages):
                return Skip("video", "GRPO samples image and text prompts")
            loaded = row_images(self.args, media_folder(row, self.args.image_folder), messages, raw_images)
            if isinstance(loaded, str):
                return loaded
            images, note = loaded
            prompt = prompt_row(self.labeller.processor, messages, images)
        except BadRow as error:
            return Skip("bad_row", str(error))
        except Exception as error:  # a template that refuses the prompt, say: counted, never a crash
            return Skip("bad_row", f"{type(error).__name__}: {error}")
        if len(prompt["input_ids"]) > self.max_length:
            return Skip("too_long", f"{len(prompt['input_ids'])} prompt tokens, over {self.max_length}")
        return (prompt["input_ids"], prompt["media_inputs"], json.dumps(reward_prompt), json.dumps(columns)), note

    @staticmethod
    def check_columns(name, available):
        if not {"prompt", "messages", "conversations"} & set(available):
            raise ValueError(f"{name} has none of the columns prompt, messages or conversations (it has "
                             f"{', '.join(sorted(available))})")


@dataclass(frozen=True)
class GroupLayout:
    """Where a step's completions sit. A step holds W data ranks x k micro-batches x b completions (TRL's generation
    batch), whole groups of G. Ranks form teams of S, the fewest consecutive ranks whose completions are whole
    groups (S = 1 where b x k is a multiple of G): a team reads its share of the prompts, `prompts_per_step` = S x b
    x k / G of them a step, as one batch, and its member m samples and trains the team's completions m x b x k to
    (m + 1) x b x k in group order, b to a micro-batch. So a group's completions may sit on several micro-batches
    and ranks; `advantages` shares every rank's rewards for the groups' statistics."""

    group_size: int
    micro_batch: int
    accumulation: int
    data_rank: int
    data_world: int

    def __post_init__(self):
        if self.data_world * self.per_rank % self.group_size:
            raise ValueError(f"a step's {self.data_world * self.per_rank} completions ({self.data_world} data ranks x "
                             f"--gradient_accumulation_steps {self.accumulation} x --per_device_train_batch_size "
                             f"{self.micro_batch}) are not whole groups of --num_generations {self.group_size}: "
                             f"make their product a multiple of it")

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accumulation

    @property
    def team_size(self) -> int:
        return next(size for size in range(1, self.data_world + 1)
                    if self.data_world % size == 0 and size * self.per_rank % self.group_size == 0)

    @property
    def teams(self) -> int:
        return self.data_world // self.team_size

    @property
    def team(self) -> int:
        return self.data_rank // self.team_size

    @property
    def member(self) -> int:
        return self.data_rank % self.team_size

    @property
    def prompts_per_step(self) -> int:
        return self.team_size * self.per_rank // self.group_size

    def pieces(self) -> list[tuple[int, list[int]]]:
        """[(a prompt's index in the team's batch, the indices in its group)] of this rank's completions, in order."""
        pieces = {}
        for slot in range(self.member * self.per_rank, (self.member + 1) * self.per_rank):
            pieces.setdefault(slot // self.group_size, []).append(slot % self.group_size)
        return list(pieces.items())

    def advantages(self, rewards: torch.Tensor, scale: str, device) -> tuple[torch.Tensor, torch.Tensor]:
        """`group_advantages` of this rank's completions (`rewards`, NaN where a function failed), from the step's
        rewards on every rank (one all-reduce of W x b x k values: each rank adds its own at its place)."""
        mine = slice(self.data_rank * self.per_rank, (self.data_rank + 1) * self.per_rank)
        every = torch.zeros(self.data_world * self.per_rank, dtype=torch.float64)
        every[mine] = rewards
        advantages, zero_std = group_advantages(sum_over_ranks(every.to(device)).cpu(), self.group_size, scale)
        return advantages[mine], zero_std[mine]


class PromptCollator:
    """A batch of prompts as they are (each is sampled on its own): {prompts, num_samples, data_counts, chat: the
    prompts through `chat_collator` (no target), what a rank with no held-out prompt left decodes}. `counted` False:
    a team member other than the first, which reads the same prompts, counts none of them."""

    def __init__(self, chat_collator, counted: bool = True):
        self.chat_collator, self.counted = chat_collator, counted

    def __call__(self, rows):
        prompts = [{"input_ids": torch.as_tensor(row["input_ids"]), "media_inputs": row["media_inputs"],
                    "prompt": json.loads(row["reward_prompt"]), "columns": json.loads(row["reward_columns"])}
                   for row in rows]
        return {"prompts": prompts, "num_samples": len(rows) * self.counted,
                "data_counts": torch.tensor([sum(row[name] for row in rows) * self.counted for name in CHAT_COUNTED]),
                "chat": self.chat_collator([row for prompt in prompts for row in chat_rows(prompt, [[]], [False])])}


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, zero-std flags) of a step's `rewards` (`[groups x group_size]` in group order, NaN where a reward
    function failed): each reward minus its group's mean, divided by the group's unbiased std (`scale` group) or by
    all of `rewards`' (batch), + 1e-4, or not divided (none); 0 for a failed completion, which the statistics leave
    out. The flags mark completions whose group's std is 0 (TRL's frac_reward_zero_std)."""
    grouped = rewards.view(-1, group_size)
    valid = ~grouped.isnan()
    count = valid.sum(1, keepdim=True)
    values = grouped.nan_to_num(0.0)
    mean = values.sum(1, keepdim=True) / count.clamp_min(1)
    squares = ((values - mean) ** 2 * valid).sum(1, keepdim=True)
    std = (squares / (count - 1).clamp_min(1)).sqrt() * (count > 1)
    advantages = values - mean
    if scale == "group":
        advantages = advantages / (std + 1e-4)
    elif scale == "batch":
        advantages = advantages / (grouped[valid].std().nan_to_num(0) + 1e-4)  # unbiased; 0 for one reward
    zero_std = torch.isclose(std, torch.zeros_like(std)).expand_as(grouped)
    return (advantages * valid).flatten(), zero_std.flatten()


def token_losses(logps, old_logps, ref_logps, advantages, mask, args: GRPOArgs) -> dict:
    """Per-token terms of the clipped surrogate (PPO's, with DAPO's asymmetric clip): `loss` = -min(r A, clip(r, 1 -
    epsilon, 1 + epsilon_high) A) + beta KL, r = exp(logp - old logp), KL the k3 estimator exp(ref - logp) - (ref -
    logp) - 1, times r with --use_bias_correction_kl (TRL 1.16's default: the KL of the sampling policy's tokens);
    and the clip flags TRL logs. Every tensor `[rows, tokens]`, zero where `mask` is False."""
    ratio = torch.exp(logps - old_logps)
    advantages = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    terms = {}
    if args.beta:
        delta = ref_logps - logps
        terms["kl"] = (torch.exp(delta) - delta - 1) * (ratio if args.use_bias_correction_kl else 1) * mask
        loss = loss + args.beta * terms["kl"]
    low = (ratio < 1 - args.epsilon) & (advantages < 0) & mask
    high = (ratio > 1 + args.epsilon_high) & (advantages > 0) & mask
    return terms | {"loss": loss * mask, "low": low, "high": high, "region": low | high}


class LossSums(dict):
    """A step's sums for the log line, added micro-batch after micro-batch (detached): the weighted loss, the KL, the
    trained tokens and the clip flags TRL counts (`CLIP_COUNTS`)."""

    def __init__(self):
        super().__init__(dict.fromkeys(["loss", "kl", "tokens_trained", *[f"clip_{name}" for name in CLIP_COUNTS]], 0))

    def add(self, weighted: torch.Tensor, terms: dict, mask: torch.Tensor):
        for name, value in [("loss", weighted), ("kl", terms.get("kl", weighted.new_zeros(()))),
                            ("tokens_trained", mask)] + [(f"clip_{name}", terms[name]) for name in CLIP_COUNTS]:
            self[name] = self[name] + value.detach().sum().float()


class LossNormaliser:
    """The weight of each token and the step's normaliser N for `loss_type`: the step's gradient is that of
    sum(weight x token loss) / N over every rank's window; `count` is this rank's share of N."""

    def __init__(self, args: GRPOArgs):
        self.loss_type, self.max_completion_length = args.loss_type, args.max_completion_length

    def weights(self, mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        mask = mask.to(dtype)
        if self.loss_type == "grpo":  # each completion's token mean
            return mask / mask.sum(1, keepdim=True).clamp_min(1)
        return mask

    def count(self, masks: list[torch.Tensor]) -> float:
        completions = sum(len(mask) for mask in masks)
        if self.loss_type == "grpo":
            return float(completions)
        if self.loss_type == "dr_grpo":
            return float(completions * self.max_completion_length)
        return float(sum(int(mask.sum()) for mask in masks))  # dapo, bnpo: tokens


def reward_inputs(prompts: list[dict], texts: list[str]) -> tuple[list, list, dict]:
    """(prompts, completions, columns) as TRL hands them to reward functions: a conversational prompt's completion as
    `[{"role": "assistant", "content": text}]`, a string prompt's as its text; each column one value per completion
    (None where a prompt lacks it)."""
    completions = [[{"role": "assistant", "content": text}] if isinstance(prompt["prompt"], list) else text
                   for prompt, text in zip(prompts, texts)]
    names = sorted({name for prompt in prompts for name in prompt["columns"]})
    return ([prompt["prompt"] for prompt in prompts], completions,
            {name: [prompt["columns"].get(name) for prompt in prompts] for name in names})


@dataclass
class Rollouts:
    """A step's completions on this rank (`GroupLayout`): the micro-batches to train on (`ChatCollator` batches),
    each completion's rewards per function (NaN where one failed), length and truncation."""

    micro_batches: list = field(default_factory=list)
    scores: torch.Tensor | None = None
    lengths: list = field(default_factory=list)
    truncated: list = field(default_factory=list)
    seconds: float = 0.0  # sampling and scoring (the step's generation_share)

    @classmethod
    def sample(cls, model, whole: bool, prompts, layout: GroupLayout, collator, scorer, processor, args: GRPOArgs,
               stop_ids, suppressed, seed, device) -> "Rollouts":
        """Sample this rank's completions of the team's `prompts`, each group from `prompt_seed(seed, prompt)` (`seed`:
        the run's + the step), by `generate_group` on a `whole` model, else by `sample_group` (as many times on every
        rank: a filler where a rank has fewer pieces), never drawing a `suppressed` token (`placeholder_token_ids`);
        decode them and score them (`RewardScorer`, once)."""
        started, rollouts, rows, scored = time.perf_counter(), cls(), [], []
        pieces = [(piece, True) for piece in layout.pieces()] if whole else batches_in_step(layout.pieces(), (0, [0]),
                                                                                          device)
        for (index, indices), real in pieces:
            prompt = prompts[index]
            sample = generate_group if whole else partial(sample_group, live=real)
            group = sample(model, prompt, collator, args, stop_ids, prompt_seed(seed, prompt), device, suppressed,
                           indices)
            if not real:
                continue
            completions = [ids for ids, _ in group]
            scored += [(prompt, ids, processor.tokenizer.decode([t for t in ids if t not in stop_ids],
                                                               skip_special_tokens=True)) for ids in completions]
            rollouts.lengths += [len(ids) for ids in completions]
            rollouts.truncated += [cut for _, cut in group]
            rows += chat_rows(prompt, completions, [not (cut and args.mask_truncated_completions) for _, cut in group])
        prompts_of, ids, texts = zip(*scored)
        reward_prompts, completions, columns = reward_inputs(prompts_of, texts)
        rollouts.scores = scorer(reward_prompts, completions, list(ids), columns)
        rollouts.micro_batches = [collator(rows[start:start + layout.micro_batch])
                                  for start in range(0, len(rows), layout.micro_batch)]
        rollouts.seconds = time.perf_counter() - started
        return rollouts

    def step_sums(self, rewards, zero_std, failures, names, batch_flops, device) -> dict:
        """This rank's sums for the step's log line (summed over ranks and steps by `Report`): the rewards, the
        completions, the seconds they took, and the trained micro-batches' tokens and FLOPs (`batch_flops`: MFU counts
        training only)."""
        scores, valid = self.scores, ~rewards.isnan()
        sums = {"tokens": sum(batch["num_tokens"] for batch in self.micro_batches),
                "flops": sum(map(batch_flops, self.micro_batches)),
                "completions": len(rewards), "scored": valid.sum(), "reward": rewards[valid].sum(),
                "reward_square": (rewards[valid] ** 2).sum(), "zero_std": zero_std.sum(), "length": sum(self.lengths),
                "truncated": sum(self.truncated), "generation_seconds": self.seconds}
        for index, name in enumerate(names):
            sums |= {f"reward_{name}": scores[:, index].nan_to_num(0).sum(), f"failed_{name}": failures[name],
                     f"scored_{name}": (~scores[:, index].isnan()).sum()}
        return {key: torch.as_tensor(value, dtype=torch.float32, device=device) for key, value in sums.items()}


def grpo_metrics(sums: dict, names, beta: float) -> dict:
    """TRL's GRPO metric names from a logging window's sums over ranks."""
    def ratio(part, whole):
        return part / whole if whole else float("nan")

    reward = ratio(sums["reward"], sums["scored"])
    metrics = {"loss": ratio(sums["loss"], sums["normaliser"]), "reward": reward,
               "reward_std": max(ratio(sums["reward_square"], sums["scored"]) - reward ** 2, 0) ** 0.5,
               "frac_reward_zero_std": ratio(sums["zero_std"], sums["completions"]),
               "completions/mean_length": ratio(sums["length"], sums["completions"]),
               "completions/clipped_ratio": ratio(sums["truncated"], sums["completions"])}
    for name in names:
        metrics |= {f"rewards/{name}/mean": ratio(sums[f"reward_{name}"], sums[f"scored_{name}"]),
                    f"rewards/{name}/failed": int(sums[f"failed_{name}"])}
    metrics |= {f"clip_ratio/{name}_mean": ratio(sums[f"clip_{name}"], sums["tokens_trained"]) for name in CLIP_COUNTS}
    if beta:
        metrics["kl"] = ratio(sums["kl"], sums["tokens_trained"])
    return metrics
