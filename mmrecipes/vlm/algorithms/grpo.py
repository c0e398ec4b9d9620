"""GRPO and its variants (TRL 1.16's loss types grpo, bnpo, dr_grpo, dapo): where a step's
completions sit, their advantages, the clipped per-token loss and its step-wide normaliser, and the
log's metrics.

- `GroupLayout`: a step's completions are whole groups; a group's may sit on several micro-batches
  and ranks, which share their rewards (one all-reduce) for the statistics.
- `group_advantages`: each reward minus its group's mean, divided by the group's (or the step's)
  unbiased std + 1e-4, or not; a completion a reward function failed on gets 0 and is left out of
  the statistics.
- `token_losses`, `LossNormaliser`: the clipped surrogate with the k3 KL, per token, normalised over
  the optimizer step on every rank (grpo: each completion's token mean, averaged; dr_grpo: the token
  sum over completions x max_completion_length; dapo and bnpo: the token sum over tokens; TRL's bnpo
  divides per rank and micro-batch).
"""

import math
from dataclasses import dataclass

import torch

from ...distributed import sum_over_ranks
from ...images import to_device
from ...reporting import ratio
from ..arguments import GRPOArgs
from ..model.outputs import TokenLogps
from ..rows.labels import IGNORE_INDEX

CLIP_COUNTS = ("low", "high", "region")  # TRL's clip_ratio/low_mean, high_mean, region_mean
FORMATS = {"generation_share": ".3f"}  # how the log line writes it (TRL's metrics: as they are)


@dataclass(frozen=True)
class GroupLayout:
    """Where a step's completions sit. A step holds W data ranks x k micro-batches x b completions
    (TRL's generation batch), whole groups of G. Ranks form teams of S, the fewest consecutive ranks
    whose completions are whole groups (S = 1 where b x k is a multiple of G): a team reads its
    share of the prompts, `prompts_per_step` = S x b x k / G of them a step, as one batch
    (`Ranks.teams(team_size)` reads them), and its member m samples and trains the team's
    completions m x b x k to (m + 1) x b x k in group order, b to a micro-batch. So a group's
    completions may sit on several micro-batches and ranks; `advantages` shares every rank's rewards
    for the groups' statistics. The group arithmetic only: which rows a rank reads is
    `distributed.Ranks`'."""

    group_size: int
    micro_batch: int
    accumulation: int
    data_rank: int
    data_world: int
    replicas: int = 1  # ranks that hold the same completions (a sequence-parallel group)

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
    def member(self) -> int:
        return self.data_rank % self.team_size

    @property
    def prompts_per_step(self) -> int:
        return self.team_size * self.per_rank // self.group_size

    @classmethod
    def of(cls, group_size: int, micro_batch: int, accumulation: int, ranks) -> "GroupLayout":
        """The layout of `ranks` (`distributed.Ranks`): a sequence-parallel group's ranks hold the
        same completions."""
        return cls(group_size=group_size, micro_batch=micro_batch, accumulation=accumulation,
                   data_rank=ranks.data_rank, data_world=ranks.data_world, replicas=ranks.split_size)

    def recorded(self) -> dict:
        """What a checkpoint records of it (a resume with other groups reads other prompts a
        step)."""
        return {"num_generations": self.group_size, "prompt_teams": self.teams,
                "loader_batch_size": self.prompts_per_step}

    def pieces(self) -> list[tuple[int, list[int]]]:
        """[(a prompt's index in the team's batch, the indices in its group)] of this rank's
        completions, in order."""
        pieces = {}
        for slot in range(self.member * self.per_rank, (self.member + 1) * self.per_rank):
            pieces.setdefault(slot // self.group_size, []).append(slot % self.group_size)
        return list(pieces.items())

    def advantages(self, rewards: torch.Tensor, scale: str, device) -> tuple[torch.Tensor, torch.Tensor]:
        """`group_advantages` of this rank's completions (`rewards`, NaN where a function failed),
        from the step's rewards on every rank (one all-reduce of W x b x k values: each rank adds
        its own at its place, each of `replicas` ranks alike)."""
        mine = slice(self.data_rank * self.per_rank, (self.data_rank + 1) * self.per_rank)
        every = torch.zeros(self.data_world * self.per_rank, dtype=torch.float64)
        every[mine] = rewards
        every = sum_over_ranks(every.to(device)).cpu() / self.replicas
        advantages, zero_std = group_advantages(every, self.group_size, scale)
        return advantages[mine], zero_std[mine]


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, zero-std flags) of a step's `rewards` (`[groups x group_size]` in group order,
    NaN where a reward function failed): each reward minus its group's mean, divided by the group's
    unbiased std (`scale` group) or by all of `rewards`' (batch), + 1e-4, or not divided (none); 0
    for a failed completion, which the statistics leave out. The flags mark completions whose
    group's std is 0 (TRL's frac_reward_zero_std)."""
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
        # unbiased; 0 for one reward
        advantages = advantages / (grouped[valid].std().nan_to_num(0) + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std)).expand_as(grouped)
    return (advantages * valid).flatten(), zero_std.flatten()


def token_losses(logps, old_logps, ref_logps, advantages, mask, args: GRPOArgs) -> dict:
    """Per-token terms of the policy loss, TRL 1.16's `_compute_loss`: r = exp(logp - old logp) per
    token, or per completion, its tokens' mean log-ratio (--importance_sampling_level sequence:
    GSPO); the clipped surrogate -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) (PPO's, with
    DAPO's asymmetric clip), CISPO's -sg(min(r, epsilon_high)) A logp, or SAPO's -sigmoid(tau (r -
    1)) 4 / tau A; plus beta KL, the k3 estimator exp(ref - logp) - (ref - logp) - 1, times r with
    --use_bias_correction_kl (TRL 1.16's default: the KL of the sampling policy's tokens); and the
    clip flags TRL logs (CISPO's clip counts as high). Every tensor `[rows, tokens]`, zero where
    `mask` is False."""
    log_ratio = logps - old_logps
    if args.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)  # [rows, tokens], or [rows, 1]
    advantages = advantages[:, None]
    no_flags = torch.zeros_like(mask)
    if args.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=args.epsilon_high).detach() * advantages * logps
        low, high = no_flags, (ratio > args.epsilon_high) & (advantages > 0) & mask
    elif args.loss_type == "sapo":
        temperature = torch.where(advantages > 0, advantages.new_tensor(args.sapo_temperature_pos),
                                  advantages.new_tensor(args.sapo_temperature_neg))
        loss = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages
        low = high = no_flags
    elif args.loss_type == "vespo":
        loss = -vespo_weights(logps - old_logps, advantages, mask, args) * advantages * logps
        low = high = no_flags
    else:
        clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)
        loss = -torch.min(ratio * advantages, clipped * advantages)
        low = (ratio < 1 - args.epsilon) & (advantages < 0) & mask
        high = (ratio > 1 + args.epsilon_high) & (advantages > 0) & mask
    terms = {}
    if args.beta:
        delta = ref_logps - logps
        terms["kl"] = (torch.exp(delta) - delta - 1) * (ratio if args.use_bias_correction_kl else 1) * mask
        loss = loss + args.beta * terms["kl"]
    return terms | {"loss": loss * mask, "low": low, "high": high, "region": low | high}


def vespo_weights(log_ratio, advantages, mask, args: GRPOArgs) -> torch.Tensor:
    """VESPO's weight of each completion (TRL 1.16's `get_gamma_weights`), no gradient through it:
    phi(w) = e^lambda w^k e^(-lambda w) (1 at w = 1) of w, the completion's ratio (the sum of its
    tokens' log-ratios, each clamped to [-20, 20], the sum to [log 1e-8, 20]), with k and lambda by
    the sign of its advantage."""
    with torch.no_grad():
        log_w = (log_ratio.clamp(-20, 20) * mask).sum(-1, keepdim=True).clamp(math.log(1e-8), 20)
        positive = advantages >= 0
        k = torch.where(positive, advantages.new_tensor(args.vespo_k_pos), advantages.new_tensor(args.vespo_k_neg))
        decay = torch.where(positive, advantages.new_tensor(args.vespo_lambda_pos),
                            advantages.new_tensor(args.vespo_lambda_neg)).clamp(min=1e-4)
        return torch.exp(decay + k * log_w - decay * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class LossSums(dict):
    """A step's sums for the log line, added micro-batch after micro-batch (detached): the weighted
    loss, the KL, the trained tokens and the clip flags TRL counts (`CLIP_COUNTS`)."""

    def __init__(self):
        super().__init__(dict.fromkeys(["loss", "kl", "tokens_trained", *[f"clip_{name}" for name in CLIP_COUNTS]], 0))

    def add(self, weighted: torch.Tensor, terms: dict, mask: torch.Tensor):
        for name, value in [("loss", weighted), ("kl", terms.get("kl", weighted.new_zeros(()))),
                            ("tokens_trained", mask)] + [(f"clip_{name}", terms[name]) for name in CLIP_COUNTS]:
            self[name] = self[name] + value.detach().sum().float()


class LossNormaliser:
    """The weight of each token and the step's normaliser N for `loss_type`: the step's gradient is
    that of sum(weight x token loss) / N over every rank's window; `count` is this rank's share of
    N."""

    def __init__(self, args: GRPOArgs):
        self.loss_type, self.max_completion_length = args.loss_type, args.max_completion_length

    def weights(self, mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        mask = mask.to(dtype)
        if self.loss_type in ("grpo", "sapo"):  # each completion's token mean
            return mask / mask.sum(1, keepdim=True).clamp_min(1)
        return mask

    def count(self, masks: list[torch.Tensor]) -> float:
        completions = sum(len(mask) for mask in masks)
        # completions' token means or sums, averaged
        if self.loss_type in ("grpo", "sapo", "luspo"):
            return float(completions)
        if self.loss_type == "dr_grpo":
            return float(completions * self.max_completion_length)
        return float(sum(int(mask.sum()) for mask in masks))  # dapo, bnpo, cispo: tokens


@dataclass
class MicroBatch:
    """A micro-batch of completions with what its loss needs: the inputs on the device, the
    completion tokens trained (`mask`), each completion's advantage, and the log-probabilities it
    was sampled with (None: the policy's own, detached, when each batch trains one optimizer step)
    and the reference's (None without --beta)."""

    inputs: dict
    mask: torch.Tensor
    advantages: torch.Tensor
    sampled_logps: torch.Tensor | None
    reference_logps: torch.Tensor | None

    def old_logps(self, logps: torch.Tensor) -> torch.Tensor:
        return logps.detach() if self.sampled_logps is None else self.sampled_logps


def micro_batches(rollouts, advantages: torch.Tensor, model, reference, args: GRPOArgs, device) -> list[MicroBatch]:
    """The rollouts' micro-batches ready to train, before any update: the log-probabilities of the
    distribution they were sampled from (the logits over --temperature, as TRL scores them), the
    policy's where --num_iterations reuses them for several optimizer steps, and the reference's (no
    graph)."""
    inputs = [to_device(batch, device) for batch in rollouts.micro_batches]
    masks = [batch["labels"][:, 1:] != IGNORE_INDEX for batch in inputs]
    advantages = advantages.to(device, torch.float32).split([len(mask) for mask in masks])
    with torch.no_grad():
        sampled = [model(batch, TokenLogps(args.temperature)) if args.num_iterations > 1 else None for batch in inputs]
    references = [reference.token_logps(batch, args.temperature) if reference else None for batch in inputs]
    return [MicroBatch(*fields) for fields in zip(inputs, masks, advantages, sampled, references)]


def grpo_metrics(sums: dict, names, beta: float) -> dict:
    """TRL's GRPO metric names from a logging window's sums over ranks."""
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
    if "truncated_in_reasoning" in sums:  # cut before the think block closed: no answer to score
        metrics["completions/truncated_in_reasoning_ratio"] = ratio(sums["truncated_in_reasoning"], sums["completions"])
    if "tool_calls" in sums:  # TRL's names
        metrics |= {"tools/call_frequency": ratio(sums["tool_calls"], sums["completions"]),
                    "tools/failure_frequency": ratio(sums["tool_failures"], sums["tool_calls"]) if sums["tool_calls"]
                    else 0.0}
    if beta:
        metrics["kl"] = ratio(sums["kl"], sums["tokens_trained"])
    return metrics
