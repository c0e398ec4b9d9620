"""What the ranks agree on at every optimizer-step boundary, in one small all-reduce: skip a
non-finite step, stop on preemption (docs/long_runs.md).

A preemption signal reaching some ranks only sets a flag; through the reduction every rank saves a
checkpoint at the same step and exits with `PREEMPTED_EXIT_CODE`. A non-finite loss on any rank or
gradient norm skips the step on every rank (after `max_skipped_steps` in a row the run stops, naming
the last checkpoint); under DeepSpeed, which steps inside `backward`, the engine's own overflow
check decides and the guard follows it. With a fused optimizer the verdict goes to it on the device
(`found_inf`, as AMP's GradScaler) and the host reads it a step later: no sync.
"""

import math
import signal
import sys

import torch

from .distributed import sum_over_ranks

# EX_TEMPFAIL: stopped on a signal after saving; run the same command again
PREEMPTED_EXIT_CODE = 75


class StepGuard:
    def __init__(self, accelerator, model, optimizer, checkpoints, *, signals: str = "SIGTERM,SIGUSR1",
                 max_skipped_steps: int = 5):
        self.accelerator, self.model, self.checkpoints = accelerator, model, checkpoints
        self.max_skipped_steps = max_skipped_steps
        self.signal = None  # the name of the first preemption signal this rank received
        self.stop_requested = False  # on every rank once any rank received a signal
        self.skipped_in_a_row, self._skipped_steps = 0, 0
        # This step's verdict on the device (True: applied), for sums that must leave skipped steps out.
        self.applied = torch.ones((), dtype=torch.bool, device=accelerator.device)
        # accelerate's wrapper holds the torch optimizer
        inner = getattr(optimizer, "optimizer", optimizer)
        # Not under DeepSpeed (it steps inside backward) or a GradScaler (it sets found_inf itself).
        device_skip = (isinstance(inner, torch.optim.Optimizer) and inner.defaults.get("fused")
                       and accelerator.scaler is None and not hasattr(model, "was_step_applied"))
        self.fused_optimizer = inner if device_skip else None
        # (host copy of the reduced flags, its copy event, step): read one step late
        self.pending = None
        for name in filter(None, (name.strip() for name in signals.split(","))):
            signal.signal(getattr(signal, name), self._on_signal)

    def _on_signal(self, signum, frame):
        # acted on at the next step boundary
        self.signal = self.signal or signal.Signals(signum).name

    def skipped_so_far(self) -> int:
        """Optimizer steps skipped so far, the previous step's pending verdict read first (which can
        end the run)."""
        self._read_pending()
        return self._skipped_steps

    def should_call_optimizer(self, losses: torch.Tensor, grad_norm, step: int) -> bool:
        """Whether to call the optimizer and scheduler for this step (the same answer on every
        rank): False for a non-finite step, which is skipped. With a fused optimizer always True:
        the guard hands it the verdict (`found_inf`) and it skips a non-finite step on the device by
        itself; `self.applied` holds the verdict on the device either way. `losses`: this rank's
        micro-batch losses of the step; `grad_norm`: from `accelerator.clip_grad_norm_`."""
        device = losses.device
        if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns the norm as a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        norm = torch.as_tensor(math.nan if grad_norm is None else grad_norm, dtype=torch.float64, device=device)
        flags = torch.stack([(~torch.isfinite(losses.detach())).sum().double(), norm.reshape(()).double(),
                             torch.tensor(float(self.signal is not None), dtype=torch.float64, device=device)])
        flags = sum_over_ranks(flags)  # the step's one collective
        if self.fused_optimizer is not None and grad_norm is not None:
            self.applied = (flags[0] == 0) & torch.isfinite(flags[1])
            self.fused_optimizer.found_inf = (~self.applied).float()
            self._read_pending()  # the previous step's verdict
            copied = torch.cuda.Event() if device.type == "cuda" else None
            self.pending = (flags.to("cpu", non_blocking=True, copy=True), copied, step)
            if copied is not None:
                copied.record()
            return True
        finite = self._account(*flags.tolist(), grad_norm is None, step)  # the host read
        self.applied = torch.tensor(finite, device=device)
        return finite

    def _read_pending(self):
        if self.pending is not None:
            host_flags, copied, step = self.pending
            self.pending = None
            if copied is not None:
                copied.synchronize()  # finished long ago: the copy was queued a whole step earlier
            self._account(*host_flags.tolist(), False, step)

    def _account(self, bad_losses: float, norm_sum: float, signals: float, no_norm: bool, step: int) -> bool:
        """Count a step's verdict and act on it; whether it was applied."""
        # A norm is the same on every rank, so their sum is finite iff it is; DeepSpeed reports
        # none when it does not compute one (then its own overflow check is all there is).
        finite = bad_losses == 0 and (no_norm or math.isfinite(norm_sum))
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
        self._skipped_steps += 1
        self.accelerator.print(f"step {step}: loss or gradient norm not finite; step skipped "
                               f"({self.skipped_in_a_row} in a row, {self._skipped_steps} in all)")
        if self.skipped_in_a_row > self.max_skipped_steps:
            last_checkpoint = (self.checkpoints.complete() or [None])[-1]
            raise RuntimeError(
                f"step {step}: {self.skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                f"norm (--max_skipped_steps {self.max_skipped_steps}). The last complete checkpoint is "
                f"{last_checkpoint or 'none (no save yet)'}: resume from it with a lower --learning_rate, "
                "or find the bad rows in the data.")
        return False

    def exit_preempted(self, checkpoint):
        """After the checkpoint of a preempted run: leave with `PREEMPTED_EXIT_CODE` (every
        rank)."""
        self.accelerator.print(f"preemption signal: saved {checkpoint}; exiting with {PREEMPTED_EXIT_CODE}. "
                               "Run the same command with --resume_from_checkpoint latest to continue.")
        self.accelerator.end_training()
        sys.exit(PREEMPTED_EXIT_CODE)
