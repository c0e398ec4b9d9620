"""Checkpoints a killed job cannot corrupt, kept to a limit, and a resume that finds the right one.

Every rank writes into `checkpoints/.partial-checkpoint-N`. After a barrier (all ranks done) the
main process writes the completeness marker `checkpoint.json` and renames the directory to
`checkpoint-N` in one step. `--resume_from_checkpoint latest` only picks directories with the
marker, so a job killed inside a save resumes from the previous complete checkpoint; leftover
partial directories are removed at the next start. Checkpoints and the resuming run must live
on a filesystem every rank sees (as for `accelerator.save_state`).

Each process also saves where its training stream stands (`data_state_<process>.json`: the epoch
and the `StatefulDataLoader`'s state, which holds each DataLoader worker's position in its shards
and which worker comes next), so a resume costs the same at step 10 and at step 100k, with any
number of workers. The order of the rows depends on the number of workers (each reads its own
shards), so a resume with another number is refused before the first step.

A resume builds nothing but tensors and plain data: the scheduler's state is JSON, and before any
file is loaded every pickle in the checkpoint (accelerate's RNG and optimizer files, DeepSpeed's and
torch.distributed.checkpoint's) is read with a restricted unpickler (`check_plain_data`). A
checkpoint whose pickles name any other class or function (code that unpickling would run) is
refused, so a checkpoint directory from someone else cannot run code at resume.
"""

import json
import os
import pickle
import re
import shutil
import sys
import zipfile
from pathlib import Path, PosixPath

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from accelerate.utils.other import TORCH_SAFE_GLOBALS

from .data import batches_forever

MARKER = "checkpoint.json"
PARTIAL = ".partial-"
SCHEDULER = "scheduler.json"
# What the pickles of a checkpoint may build beyond torch's weights-only allowlist: accelerate's RNG
# states (numpy arrays) and torch.distributed.checkpoint's metadata (plain dataclasses, the file
# names of its shards, the checkpoint's path, layouts by name).
PLAIN_DATA = [*TORCH_SAFE_GLOBALS, _StorageInfo, PosixPath, torch.serialization._get_layout,
              *(value for value in vars(dcp_metadata).values()
                if isinstance(value, type) and value.__module__ == dcp_metadata.__name__)]


class _PlainDataUnpickler(pickle.Unpickler):
    """pickle's documented way to restrict globals, for pickles that are not torch.save files."""

    def __init__(self, file, allowed: list):
        super().__init__(file)
        self.allowed = {(value.__module__, value.__qualname__): value for value in allowed}

    def find_class(self, module, name):
        found = getattr(torch, name, None) if module == "torch" else None
        if isinstance(found, torch.dtype) or found is torch.Size:
            return found
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        raise pickle.UnpicklingError(f"{module}.{name}")


def deepspeed_plain_data() -> list:
    """The plain-data classes in DeepSpeed's checkpoint files (an enum, a named tuple, the loss scale's
    attributes), when a DeepSpeed engine runs (it imported deepspeed; others need not pay the import)."""
    if "deepspeed" not in sys.modules:
        return []
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


def check_plain_data(checkpoint: Path):
    """Raise ValueError if a pickle in `checkpoint` would build anything but tensors and plain data."""
    allowed = PLAIN_DATA + deepspeed_plain_data()
    for path in sorted(checkpoint.rglob("*")):
        if not path.is_file() or path.suffix in (".json", ".safetensors", ".distcp"):
            continue  # .distcp: tensor data, which torch.distributed.checkpoint loads weights-only
        try:
            if zipfile.is_zipfile(path):  # torch.save's format
                with torch.serialization.safe_globals(allowed):
                    torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            else:
                with open(path, "rb") as file:
                    if file.read(1) == pickle.PROTO:
                        file.seek(0)
                        _PlainDataUnpickler(file, allowed).load()
        except pickle.UnpicklingError as error:
            named = re.search(r"GLOBAL ([\w.]+)", str(error))  # torch's message names the global it refused
            raise ValueError(f"{path}: unpickling it would call {named[1] if named else error}, which is not tensors "
                             "or plain data. A resume builds nothing else: resume from a checkpoint these recipes "
                             "wrote.") from None


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[-1])


class Checkpointer:
    """Saves and restores one run's checkpoints under `<output_dir>/checkpoints`.

    `layout` is what the saved data position depends on (data ranks, per-device batch size,
    accumulation steps, DataLoader workers); a resume with a different layout is refused before any step.
    """

    def __init__(self, accelerator, output_dir: str, scheduler, *, total_limit: int | None, data_world: int,
                 batch_size: int, **data_layout):
        self.accelerator, self.scheduler = accelerator, scheduler
        self.root = Path(output_dir) / "checkpoints"
        self.total_limit = total_limit
        self.train_loader, self.epoch = None, 0  # the training stream and the epoch of its last batch (`resume`)
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
        if accelerator.is_main_process:  # plain data (the schedule's functions are the recipe's code)
            (partial / SCHEDULER).write_text(json.dumps(self.scheduler.state_dict()))
        if self.train_loader is not None:  # after the last batch the loop took: the loader reads none ahead
            data_state = {"epoch": self.epoch, "loader": self.train_loader.state_dict()}
            (partial / f"data_state_{accelerator.process_index}.json").write_text(json.dumps(data_state))
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
        `batches` yields (epoch, batch) and notes each batch's epoch for the next save."""
        self.remove_partial()
        self.train_loader = train_loader
        self.layout["dataloader_num_workers"] = train_loader.num_workers  # the sample order depends on it
        start_step = 0
        checkpoint = self.find(which) if which else None
        if which and checkpoint is None:
            self.accelerator.print(f"--resume_from_checkpoint {which}: no complete checkpoint under {self.root} yet; "
                                   "starting from step 0")
        if checkpoint is None:
            return start_step, self._noting_epochs(batches_forever(train_loader))
        saved = json.loads((checkpoint / MARKER).read_text())
        changed = {key: (saved.get(key), value) for key, value in self.layout.items() if saved.get(key) != value}
        if changed:
            raise ValueError(f"{checkpoint} was saved with {', '.join(f'{k}={old}' for k, (old, _) in changed.items())}; "
                             f"this run has {', '.join(f'{k}={new}' for k, (_, new) in changed.items())}. The saved "
                             "data position only holds for the same data layout: resume with the same number of "
                             "processes, batch size (or token budget and packing), accumulation steps and "
                             "--dataloader_num_workers.")
        check_plain_data(checkpoint)
        self.accelerator.load_state(checkpoint)
        self.scheduler.load_state_dict(json.loads((checkpoint / SCHEDULER).read_text()))
        start_step = step_of(checkpoint)
        self.accelerator.print(f"resumed from {checkpoint} at step {start_step}")
        data_state = json.loads((checkpoint / f"data_state_{self.accelerator.process_index}.json").read_text())
        train_loader.load_state_dict(data_state["loader"])
        return start_step, self._noting_epochs(batches_forever(train_loader, first_epoch=data_state["epoch"],
                                                               resumed=True))

    def _noting_epochs(self, batches):
        for epoch, batch in batches:
            self.epoch = epoch
            yield epoch, batch
