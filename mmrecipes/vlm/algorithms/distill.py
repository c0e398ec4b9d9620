"""On-policy distillation's steps: each trains on the student's own samples of the window's prompts
with probability --lmbda (`on_policy`, the same draw on every rank), else on the dataset's answers
or (--seq_kd) the teacher's samples (`StepTargets`); the held-out divergence
(`evaluate_divergence`). The teacher: `teacher`; the rows (a prompt with the dataset's answer after
it): `prompts.DistillPreprocessor`.
"""

import random
from dataclasses import dataclass

import torch

from ...distributed import batches_in_step, sum_over_ranks
from ...images import to_device
from ...reporting import ratio
from ..arguments import DistillArgs
from ..model.outputs import GeneralizedJSD
from .teacher import Teacher


def on_policy(seed: int, step: int, lmbda: float) -> bool:
    """Whether `step` trains on the student's own samples: a draw of probability `lmbda` from the
    run's seed and the step, the same on every rank (their sampling loops stay in step) and on a
    resume."""
    return random.Random(seed * 1_000_003 + step).random() < lmbda


@dataclass(frozen=True)
class OnePerPrompt:
    """The samplers' layout (`sampling.Sampler`, as GRPO's `GroupLayout`) for distillation: one
    sample of each of a micro-batch's `prompts`, all in one micro-batch."""

    prompts: int

    @property
    def micro_batch(self) -> int:
        return self.prompts

    def pieces(self) -> list[tuple[int, list[int]]]:
        return [(index, [0]) for index in range(self.prompts)]


class StepTargets:
    """What a step of distillation trains on, the same choice on every rank (`__call__`): the
    student's samples of the window's prompts with probability --lmbda (`on_policy`), else the
    teacher's (--seq_kd) or the dataset's answers; each prompt sampled from a seed of its own
    (`sampling.Sampler`: W ranks sample what one process does). `sums`: what the log counts of the
    last step; `metrics`: the log's values of a window's sums."""

    # the log line's, of `metrics`
    FORMATS = dict.fromkeys(("on_policy", "sample_length", "generation_share"), ".3f")

    def __init__(self, sampler, teacher: Teacher, args: DistillArgs, seed: int):
        self.sampler, self.teacher, self.args, self.seed = sampler, teacher, args, seed
        self.sampled, self.samples, self.micro_batches = False, [], []

    def __call__(self, model, window: list[dict], step: int) -> list[dict]:
        """The window's micro-batches to train on (`ChatCollator` batches), in the window's
        order."""
        self.sampled = on_policy(self.seed, step, self.args.lmbda)
        source = model if self.sampled else self.teacher.model
        self.samples = [self.sampler.rollouts(source, batch["prompts"], OnePerPrompt(len(batch["prompts"])),
                                              self.seed + step, gather=None if self.sampled else False)
                        for batch in window if self.sampled or self.args.seq_kd]
        self.micro_batches = ([rollouts.micro_batches[0] for rollouts in self.samples] if self.samples
                              else [batch["answers"] for batch in window])
        return self.micro_batches

    def sums(self) -> dict:
        """The last step's counts (`Report.add_step`): rows trained, the student's samples, all
        samples and their tokens, the seconds sampling took."""
        lengths = [length for rollouts in self.samples for length in rollouts.lengths]
        return {"rows": sum(batch["num_samples"] for batch in self.micro_batches),
                "student_samples": len(lengths) * self.sampled, "sampled_rows": len(lengths),
                "sample_length": sum(lengths), "generation_seconds": sum(rollouts.seconds for rollouts in self.samples)}

    @staticmethod
    def metrics(sums: dict, data_world: int) -> dict:
        """The share of rows trained on-policy, the samples' mean length, the share of the time
        spent sampling."""
        return {"on_policy": ratio(sums["student_samples"], sums["rows"]),
                "sample_length": ratio(sums["sample_length"], sums["sampled_rows"]),
                "generation_share": ratio(sums["generation_seconds"], sums["seconds"] * data_world)}


@torch.no_grad()
def evaluate_divergence(model, teacher: Teacher, eval_loader, filler_batch, device,
                        divergence: GeneralizedJSD) -> dict:
    """The held-out divergence: the token mean of the generalised JSD to the teacher on the held-out
    answers, over every rank's share (`DistillCollator` batches), each rank forwarding as often as
    every other (`batches_in_step`; `filler_batch`: one a rank with nothing left forwards and
    discards)."""
    model.eval()
    totals = torch.zeros(2, device=device)  # the divergence summed over target tokens, the tokens
    for batch, real in batches_in_step(eval_loader, filler_batch, device):
        inputs = to_device(batch["answers"], device)
        inputs["teacher_hidden"] = teacher.hidden(inputs, batch["prompts"])
        value = model(inputs, divergence)
        if real:
            tokens = float(batch["answers"]["target_tokens"])
            totals += torch.stack([value.float(), torch.tensor(tokens, device=device)])
    model.train()
    divergence, tokens = sum_over_ranks(totals).tolist()
    return {"divergence": divergence / tokens, "eval_tokens": int(tokens)} if tokens else {}
