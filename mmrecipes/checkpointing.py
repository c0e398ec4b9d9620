"""Checkpoints a killed job cannot corrupt, kept to a limit, and a resume that finds the right one.

Every rank writes into `checkpoints/.partial-checkpoint-N`. After a barrier (all ranks done) the
main process writes the completeness marker `checkpoint.json` and renames the directory to
`checkpoint-N` in one step. `--resume_from_checkpoint latest` only picks directories with the
marker, so a job killed inside a save resumes from the previous complete checkpoint; leftover
partial directories are removed at the next start. Checkpoints and the resuming run must live
on a filesystem every rank sees (as for `accelerator.save_state`).
"""

import json
import os
import shutil
from pathlib import Path

from .data import batches_forever

MARKER = "checkpoint.json"
PARTIAL = ".partial-"


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[-1])


class Checkpointer:
    """Saves and restores one run's checkpoints under `<output_dir>/checkpoints`.

    `layout` is what the saved data position depends on (data ranks, per-device batch size,
    accumulation steps); a resume with a different layout is refused before any step.
    """

    def __init__(self, accelerator, output_dir: str, *, total_limit: int | None, data_world: int, batch_size: int):
        self.accelerator = accelerator
        self.root = Path(output_dir) / "checkpoints"
        self.total_limit = total_limit
        self.layout = {"data_ranks": data_world, "per_device_train_batch_size": batch_size,
                       "gradient_accumulation_steps": accelerator.gradient_accumulation_steps}

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return sorted((path for path in self.root.glob("checkpoint-*") if (path / MARKER).is_file()), key=step_of)

    def save(self, step: int) -> Path:
        """Model, optimizer, scheduler and RNG state after `step` optimizer steps (call on every rank)."""
        accelerator = self.accelerator
        partial, final = self.root / f"{PARTIAL}checkpoint-{step}", self.root / f"checkpoint-{step}"
        if accelerator.is_main_process and partial.exists():
            shutil.rmtree(partial)
        accelerator.wait_for_everyone()
        accelerator.save_state(partial)
        accelerator.wait_for_everyone()  # every rank's files are written
        if accelerator.is_main_process:
            (partial / MARKER).write_text(json.dumps({"step": step, **self.layout}, indent=1))
            replaced = self.root / f"{PARTIAL}replaced-checkpoint-{step}"
            if final.exists():  # the same step saved again, e.g. after resuming from an older checkpoint
                os.rename(final, replaced)
            os.rename(partial, final)  # one step: readers see the whole checkpoint or none of it
            shutil.rmtree(replaced, ignore_errors=True)
            if self.total_limit:
                for old in self.complete()[:-self.total_limit]:
                    doomed = self.root / f"{PARTIAL}deleted-{old.name}"
                    os.rename(old, doomed)  # never picked again, even if the deletion is cut short
                    shutil.rmtree(doomed)
        accelerator.wait_for_everyone()
        return final

    def find(self, which: str) -> Path | None:
        """The checkpoint `--resume_from_checkpoint` names: "latest" (None when there is none yet) or a path."""
        if which == "latest":
            found = self.complete()
            return found[-1] if found else None
        path = Path(which)
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"--resume_from_checkpoint {which}: not a complete checkpoint (no {MARKER}; "
                                    "a save that was cut short, or not a checkpoint directory)")
        return path

    def remove_partial(self):
        """Remove what saves cut short left behind (main process; call before the first save)."""
        if self.accelerator.is_main_process:
            for leftover in sorted(self.root.glob(f"{PARTIAL}*")):
                shutil.rmtree(leftover)
                self.accelerator.print(f"removed {leftover}: a checkpoint save that did not finish")
        self.accelerator.wait_for_everyone()

    def resume(self, which: str | None, train_loader):
        """(start_step, batches): the run restored from `which` (model, optimizer, scheduler, RNG)
        and the training stream at the same position, so it repeats the uninterrupted run exactly.
        Each rank re-reads and discards the micro-batches it had consumed (exact; costs reading time)."""
        self.remove_partial()
        start_step = 0
        checkpoint = self.find(which) if which else None
        if which and checkpoint is None:
            self.accelerator.print(f"--resume_from_checkpoint {which}: no complete checkpoint under {self.root} yet; "
                                   "starting from step 0")
        if checkpoint is not None:
            saved = json.loads((checkpoint / MARKER).read_text())
            changed = {key: (saved.get(key), value) for key, value in self.layout.items() if saved.get(key) != value}
            if changed:
                raise ValueError(f"{checkpoint} was saved with {', '.join(f'{k}={old}' for k, (old, _) in changed.items())}; "
                                 f"this run has {', '.join(f'{k}={new}' for k, (_, new) in changed.items())}. The saved "
                                 "data position only holds for the same data layout: resume with the same number of "
                                 "processes, batch size and accumulation steps.")
            self.accelerator.load_state(checkpoint)
            start_step = step_of(checkpoint)
            self.accelerator.print(f"resumed from {checkpoint} at step {start_step}")
        batches = batches_forever(train_loader)
        for _ in range(start_step * self.accelerator.gradient_accumulation_steps):
            next(batches)
        return start_step, batches
