"""Checkpoints a killed job cannot corrupt, kept to a limit, and a resume that finds the right one.

Every rank writes into `checkpoints/.partial-checkpoint-N`. After a barrier (all ranks done) the
main process writes the completeness marker `checkpoint.json` and renames the directory to
`checkpoint-N` in one step. `--resume_from_checkpoint latest` only picks directories with the
marker, so a job killed inside a save resumes from the previous complete checkpoint; leftover
partial directories are removed at the next start. Checkpoints and the resuming run must live
on a filesystem every rank sees (as for `accelerator.save_state`).

Each process also saves where its training stream stands (`data_position_<process>.json`, from
`mmrecipes.data.ResumableShuffle`), so a resume costs the same at step 10 and at step 100k. With
more than one DataLoader worker there is no single position: the resume then re-reads and
discards the micro-batches consumed so far (exact too, but its time grows with the step).
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

    def __init__(self, accelerator, output_dir: str, *, total_limit: int | None, data_world: int, batch_size: int,
                 **data_layout):
        self.accelerator = accelerator
        self.root = Path(output_dir) / "checkpoints"
        self.total_limit = total_limit
        self.data_position = None  # of the last batch the loop took (tracked by `resume`'s iterator)
        self.layout = {"data_ranks": data_world, "per_device_train_batch_size": batch_size,
                       "gradient_accumulation_steps": accelerator.gradient_accumulation_steps} | data_layout

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
        if self.data_position is not None:
            position_file = partial / f"data_position_{accelerator.process_index}.json"
            position_file.write_text(json.dumps(self.data_position))
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
        `batches` yields (epoch, batch) and notes each batch's data position for the next save."""
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
                                 "processes, batch size (or token budget and packing) and accumulation steps.")
            self.accelerator.load_state(checkpoint)
            start_step = step_of(checkpoint)
            self.accelerator.print(f"resumed from {checkpoint} at step {start_step}")
        # ResumableShuffle, or TokenBudgetBatches over one
        positioned = hasattr(train_loader.dataset, "resume_from") and train_loader.num_workers <= 1
        position_file = checkpoint / f"data_position_{self.accelerator.process_index}.json" if checkpoint else None
        if positioned and position_file and position_file.is_file():
            position = json.loads(position_file.read_text())
            train_loader.dataset.resume_from(position)
            batches = batches_forever(train_loader, first_epoch=position["epoch"], resumed=True)
        else:
            batches = batches_forever(train_loader)
            skipped = start_step * self.accelerator.gradient_accumulation_steps
            if skipped:
                self.accelerator.print(f"no saved data position: re-reading {skipped} micro-batches per rank")
            for _ in range(skipped):
                next(batches)
        return start_step, self._noting_positions(batches, positioned)

    def _noting_positions(self, batches, positioned: bool):
        for epoch, batch in batches:
            if positioned and batch is not None:
                self.data_position = batch["data_position"]
            yield epoch, batch
