"""What one forward of the VLM step returns: `model(batch, output)`, `model` a `step.VLMForTraining`
(prepared or not), `output` one of the objects below.

Each output computes itself from the language model's last hidden states and its output layer
(`Forward`), says whether a sequence-parallel rank may compute it from its shard of the sequence
(`splits`; then `reduce` makes the whole sequence's value on every rank of the group), and whether a
backward follows (`trains`: the dummy image's zero term rides on it). The output is an argument of
the wrapped module's forward, so whatever it computes runs inside the engine's hooks (DDP's, FSDP2's
unsharding, ZeRO-3's gathers).

A recipe defines its own output in its own file: subclass `StepOutput`, write `compute`, and declare
`splits`: False (it reads whole sequences), or True with the `reduce` its value needs (the default
sums the ranks' values, right for a sum over tokens; a per-token value must be placed at its
positions first, as `TokenLogps.reduce` does). An output that declares nothing is refused where a
sequence is split, never summed over positions that differ. To change the training loss, subclass
`LossSum` and override `cross_entropy` (a label-smoothed CE, a token-weighted one): its `compute`
adds a mixture of experts' load-balancing term, which overriding `compute` would drop.
"""

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from .losses import (
    IGNORE_INDEX,
    head_cross_entropy_per_row,
    head_cross_entropy_per_token,
    head_cross_entropy_sum,
    head_generalized_jsd_sum,
    soft_capped,
)


@dataclass
class Forward:
    """What an output computes itself from: `hidden`, the language model's last hidden states
    `[rows, tokens, width]` (a sequence-parallel rank's shard of them where `shard` is set,
    `sequence_parallel.Shard`); the output layer `head` and the family's final logit soft-capping
    `softcap`; the micro-batch `batch` (labels, masks, what the recipe added); the routers' logits
    where the output asked (`routing`)."""

    hidden: torch.Tensor | None
    head: torch.nn.Module
    softcap: float | None
    batch: dict
    shard: object = None
    router_logits: tuple | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` through the output layer, soft-capped where the family does."""
        return soft_capped(self.head(hidden), self.softcap)

    @property
    def positions(self) -> torch.Tensor:
        """The hidden states that predict a next token: every position but the last (a shard: all of
        its own)."""
        return self.hidden if self.shard is not None else self.hidden[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        """The next token of each of `positions`, IGNORE_INDEX where it is no target."""
        labels = self.batch["labels"]
        return self.shard.targets(labels) if self.shard is not None else labels[:, 1:]

    @property
    def token_mask(self) -> torch.Tensor:
        """1 for each real token the language model ran, `[rows, tokens]` (a shard: its own, 0 past
        the sequence)."""
        mask = self.batch["attention_mask"]
        return self.shard.take(mask) if self.shard is not None else mask

    def aligned(self, per_token: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the whole sequence (a teacher's hidden states) at `positions`."""
        return self.shard.take(per_token) if self.shard is not None else per_token[:, :-1]


class StepOutput:
    """An output of the step (see the module's docstring). `routing`: the forward records the MoE
    routers' logits."""

    # undeclared: refused where the sequence is split (see the module)
    splits: ClassVar[bool | None] = None
    trains: ClassVar[bool] = True
    runs_model: ClassVar[bool] = True  # False: computed from the output layer alone (`OutputLayer`)
    routing: bool = False

    def compute(self, forward: Forward) -> torch.Tensor:
        raise NotImplementedError

    def reduce(self, value: torch.Tensor, shard) -> torch.Tensor:
        """The whole sequence's value on every rank of a sequence-parallel group from each rank's
        (`shard.sum`: an all-reduce whose backward gives each shard the group's gradients): a sum of
        the ranks' values."""
        return shard.sum(value)

    def plus(self, value, zero: torch.Tensor):
        """`value` with the dummy media's exact zero term added (its parameters get gradients)."""
        return value + zero

    @classmethod
    def check_split(cls):
        """Refuse to split an output that does not say how (`splits` None)."""
        if cls.splits is None:
            raise TypeError(f"{cls.__name__} does not declare how it splits over a sequence-parallel group: set "
                            "`splits = False` (computed from whole sequences) or `splits = True` with its `reduce` "
                            "(the default sums the ranks' values: right for a sum over tokens; a per-token value "
                            "needs `shard.place`, as TokenLogps.reduce does)")


class CrossEntropy(NamedTuple):
    """`LossSum`'s value: `summed`, the token cross-entropy summed over the targets (training
    back-propagates it times `Ranks.loss_scale`), and `extra`, what to back-propagate beside it
    unscaled (a mixture of experts' load-balancing term; 0 without one)."""

    summed: torch.Tensor
    extra: torch.Tensor | float = 0.0


class LossSum(StepOutput):
    """The training loss, a `CrossEntropy`: `summed, extra = model(batch, LossSum(balance))`, then
    `backward(summed * loss_scale + extra)` (the exact token mean over the optimizer step, plus a
    mixture of experts' load-balancing term where `balance`, `moe.LoadBalance`, is on). A recipe's
    own CE overrides `cross_entropy` (this `compute` adds the term)."""

    splits = True

    def __init__(self, balance=None):
        self.balance = balance if balance is not None and balance.on else None
        self.routing = self.balance is not None

    def compute(self, forward: Forward) -> CrossEntropy:
        extra = self.balance.term_of(forward) if self.balance is not None else 0.0
        return CrossEntropy(self.cross_entropy(forward), extra)

    def cross_entropy(self, forward: Forward) -> torch.Tensor:
        return head_cross_entropy_sum(forward.positions, forward.head, forward.targets, softcap=forward.softcap,
                                      shifted=True)

    def reduce(self, value: CrossEntropy, shard) -> CrossEntropy:
        """The group's sum of the CE; the balance's term is its group's already (`term_of`)."""
        return value._replace(summed=shard.sum(value.summed))

    def plus(self, value: CrossEntropy, zero: torch.Tensor) -> CrossEntropy:
        return value._replace(summed=value.summed + zero)


class SequenceLogps(StepOutput):
    """Each row's answer log-probability, `[rows]`: the sum over its target tokens (DPO's; unpacked
    batches)."""

    splits = True

    def compute(self, forward: Forward) -> torch.Tensor:
        return -head_cross_entropy_per_row(forward.positions, forward.head, forward.targets, softcap=forward.softcap,
                                           shifted=True)


class TokenLogps(StepOutput):
    """Each target token's log-probability at `temperature` (GRPO's: the sampling temperature, as
    TRL scores them), `[rows, tokens - 1]`, 0 elsewhere."""

    splits = True

    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    def compute(self, forward: Forward) -> torch.Tensor:
        return -head_cross_entropy_per_token(forward.positions, forward.head, forward.targets,
                                             softcap=forward.softcap, temperature=self.temperature, shifted=True)

    def reduce(self, value: torch.Tensor, shard) -> torch.Tensor:
        """Each shard's tokens at their place in the whole sequence, zeros elsewhere, summed over
        the group."""
        return shard.sum(shard.place(value))[:, :shard.length - 1]


class GeneralizedJSD(StepOutput):
    """The batch's summed generalised JSD between the teacher's and the student's next-token
    distributions over its target tokens (`losses.head_generalized_jsd_sum`):
    `batch["teacher_hidden"]`, the teacher's hidden states of the same tokens (`Hidden`, whole
    sequences); `teacher_head`, its output layer (`OutputLayer` through the teacher's prepared
    module: `teacher.Teacher.head_logits`)."""

    splits = True

    def __init__(self, teacher_head, *, beta: float, temperature: float):
        self.teacher_head, self.beta, self.temperature = teacher_head, beta, temperature

    def compute(self, forward: Forward) -> torch.Tensor:
        teacher_hidden = forward.aligned(forward.batch["teacher_hidden"])
        return head_generalized_jsd_sum(forward.positions, forward.head, teacher_hidden, self.teacher_head,
                                        forward.targets != IGNORE_INDEX, beta=self.beta, temperature=self.temperature,
                                        student_softcap=forward.softcap)


class Logits(StepOutput):
    """The logits, `[rows, tokens, vocabulary]` (soft-capped where the family does): evaluation and
    sampling, never a backward (no dummy term), whole sequences."""

    splits = trains = False

    def compute(self, forward: Forward) -> torch.Tensor:
        return forward.logits(forward.hidden)


class Hidden(StepOutput):
    """The language model's last hidden states, `[rows, tokens, hidden]`: a teacher's, whole
    sequences, no graph."""

    splits = trains = False

    def compute(self, forward: Forward) -> torch.Tensor:
        return forward.hidden


class OutputLayer(StepOutput):
    """Another model's `hidden` states through this one's output layer, soft-capped as it does: the
    model itself does not run, but the prepared module's forward gathers the layer as in any forward
    (a teacher's head under ZeRO-3)."""

    splits = trains = runs_model = False

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden

    def compute(self, forward: Forward) -> torch.Tensor:
        return forward.logits(self.hidden)
