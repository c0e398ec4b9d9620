"""What the ranks agree on at every optimizer-step boundary: skip a non-finite step, stop on preemption.

One small all-reduce per optimizer step, after the backward, carries both flags, so every rank
takes the same decision at the same step:
- A preemption signal (Slurm sends SIGTERM, or the one set with `--signal`) may reach only some
  ranks. Its handler only sets a flag; the ranks see it through the reduction, save a checkpoint
  at this step boundary, and exit with `PREEMPTED_EXIT_CODE`.
- If the loss on any rank or the global gradient norm is not finite, no rank applies the step:
  no optimizer update, no scheduler step, gradients zeroed. After `max_skipped_steps` such steps
  in a row the run stops with an error naming the step and the last complete checkpoint.
  DeepSpeed steps inside `accelerator.backward`, before this check: there the engine's own
  overflow check decides (ZeRO-2 and ZeRO-3 skip any step whose gradients are not finite, in bf16
  too while `bf16.check_grad_overflow` keeps its default, true), and the guard reads
  `engine.was_step_applied()` to count the skip and hold the scheduler back. A non-finite loss
  with finite gradients is applied by DeepSpeed; the guard says so in the log.
"""

import math
import signal
import sys

import torch

from .distributed import sum_over_ranks

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on a signal after saving; run the same command again


class StepGuard:
    def __init__(self, accelerator, model, checkpoints, *, signals: str = "SIGTERM,SIGUSR1", max_skipped_steps: int = 5):
        self.accelerator, self.model, self.checkpoints = accelerator, model, checkpoints
        self.max_skipped_steps = max_skipped_steps
        self.signal = None  # the name of the first preemption signal this rank received
        self.stop_requested = False  # on every rank once any rank received a signal
        self.skipped_in_a_row, self.skipped_steps = 0, 0
        for name in filter(None, (name.strip() for name in signals.split(","))):
            signal.signal(getattr(signal, name), self._on_signal)

    def _on_signal(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name  # acted on at the next step boundary

    def step_is_finite(self, losses: torch.Tensor, grad_norm, step: int) -> bool:
        """Whether to apply this optimizer step (the same answer on every rank). `losses`: this
        rank's micro-batch losses of the step; `grad_norm`: from `accelerator.clip_grad_norm_`."""
        device = losses.device
        if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns the norm as a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        norm = torch.as_tensor(math.nan if grad_norm is None else grad_norm, dtype=torch.float64, device=device)
        flags = torch.stack([(~torch.isfinite(losses.detach())).sum().double(), norm.reshape(()).double(),
                             torch.tensor(float(self.signal is not None), dtype=torch.float64, device=device)])
        bad_losses, norm_sum, signals = sum_over_ranks(flags).tolist()  # the step's one collective and host read
        # A norm is the same on every rank, so their sum is finite iff it is; DeepSpeed reports
        # none when it does not compute one (then its own overflow check is all there is).
        finite = bad_losses == 0 and (grad_norm is None or math.isfinite(norm_sum))
        engine_applied = getattr(self.model, "was_step_applied", None)
        if engine_applied is not None:  # DeepSpeed already stepped (or skipped) inside backward
            if not finite and engine_applied():
                self.accelerator.print(f"step {step}: non-finite loss on some rank, but DeepSpeed applied the step "
                                       "(its overflow check looks at gradients only)")
            finite = engine_applied()  # the scheduler follows what the engine did
        self.stop_requested = self.stop_requested or signals > 0
        if finite:
            self.skipped_in_a_row = 0
            return True
        self.skipped_in_a_row += 1
        self.skipped_steps += 1
        self.accelerator.print(f"step {step}: loss or gradient norm not finite; step skipped "
                               f"({self.skipped_in_a_row} in a row, {self.skipped_steps} in all)")
        if self.skipped_in_a_row > self.max_skipped_steps:
            last_checkpoint = (self.checkpoints.complete() or [None])[-1]
            raise RuntimeError(
                f"step {step}: {self.skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                f"norm (--max_skipped_steps {self.max_skipped_steps}). The last complete checkpoint is "
                f"{last_checkpoint or 'none (no save yet)'}: resume from it with a lower --learning_rate, "
                "or find the bad rows in the data.")
        return False

    def exit_preempted(self, checkpoint):
        """After the checkpoint of a preempted run: leave with `PREEMPTED_EXIT_CODE` (every rank)."""
        self.accelerator.print(f"preemption signal: saved {checkpoint}; exiting with {PREEMPTED_EXIT_CODE}. "
                               "Run the same command with --resume_from_checkpoint latest to continue.")
        self.accelerator.end_training()
        sys.exit(PREEMPTED_EXIT_CODE)
