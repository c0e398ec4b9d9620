"""Checkpoints a killed job cannot corrupt, kept to a limit, and a resume that finds the right one
(docs/long_runs.md).

Every rank writes into `checkpoints/.partial-checkpoint-N`; after a barrier the main process writes
the completeness marker (the step, the run's data layout and model, the manifest of every file's
size and SHA-256) and renames it in one step. Each process also saves its training stream's
position, so a resume costs the same at any step. Before a resume loads anything the checkpoint is
validated (`checkpoint_validation`), and it must belong to this run: the same model and data layout,
unless `--ignore_data_skip true`. `latest` takes the newest that validates.
"""

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

from accelerate.utils import gather_object, merge_fsdp_weights
from safetensors.torch import load_file

from .checkpoint_validation import (
    UnsafeCheckpoint,
    check_manifest,
    checkpoint_files,
    file_digest,
    link_problems,
    plain_data_problem,
)
from .loader import ResumableShuffle
from .output_dir import OutputDirBusy, OutputDirLock
from .sources import data_fingerprint

MARKER = "checkpoint.json"
PARTIAL = ".partial-"
SCHEDULER = "scheduler.json"
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
# what saves leave when cut short
PARTIAL_NAME = re.compile(rf"{PARTIAL}(replaced-|deleted-)?checkpoint-\d+")
# What torch's zip writer raises (a RuntimeError) when a write fails: a full disk, an I/O error
WRITE_FAILED = re.compile(r"iostream error|inline_container|PytorchStreamWriter|file write failed")


class CheckpointSaveFailed(RuntimeError):
    """A save that could not be written; the message says what failed and how to resume."""


def step_of(checkpoint: Path) -> int:
    return int(CHECKPOINT_NAME.fullmatch(checkpoint.name)[1])


# What the learning rate of every step depends on: a resume with other values follows another schedule (said)
SCHEDULE = ("max_steps", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps")


def data_layout(data_args, args, ranks, *, batch_size: int) -> dict:
    """What a saved data position depends on (`ranks`: `distributed.Ranks`): resuming it with
    anything else would read other rows. The flags as typed (a rank's token budget, not a
    sequence-parallel group's)."""
    layout = {"data_ranks": ranks.data_world, "per_device_train_batch_size": batch_size,
              "gradient_accumulation_steps": args.gradient_accumulation_steps, "seed": args.seed,
              "shuffle_buffer_size": data_args.shuffle_buffer_size,
              "data": data_fingerprint(data_args.training_sources())}
    # batching
    for name in ("dataset_weights", "max_tokens_per_batch", "packing", "max_patches_per_batch"):
        if hasattr(data_args, name):
            layout[name] = getattr(data_args, name)
    return layout


def checkpoint_weights(checkpoint: str | Path) -> dict:
    """The full state dict of the model a `checkpoint-N` directory of any engine holds, read on the
    CPU without a process group, for any number of processes: `model.safetensors` (DDP), FSDP2's
    sharded `pytorch_model_fsdp_0` (accelerate's `merge_fsdp_weights`) or DeepSpeed's ZeRO files
    (its fp32 recovery). The checkpoint is checked first as a resume checks it: its manifest, and
    plain data in every pickle."""
    checkpoint = Path(checkpoint)
    try:
        manifest = json.loads((checkpoint / MARKER).read_text())["files"]
        names = sorted(set(manifest) | set(checkpoint_files(checkpoint, MARKER)))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{checkpoint}: not a checkpoint these recipes saved (no {MARKER} with a file manifest: "
                         f"{error}); a saved model directory goes to --model_name_or_path") from error
    # DeepSpeed's files: its plain-data classes are allowed once imported
    if (checkpoint / "pytorch_model").is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    problems = (link_problems(checkpoint) or check_manifest(checkpoint, manifest, names)
                or [problem for name in names if (problem := plain_data_problem(checkpoint, name))])
    if problems:
        raise UnsafeCheckpoint(f"{checkpoint} cannot seed a run: " + " | ".join(problems))
    if (checkpoint / "model.safetensors").is_file():
        return load_file(checkpoint / "model.safetensors")
    if (checkpoint / "pytorch_model_fsdp_0").is_dir():
        with tempfile.TemporaryDirectory() as merged:
            merge_fsdp_weights(str(checkpoint / "pytorch_model_fsdp_0"), merged)
            return load_file(Path(merged) / "model.safetensors")
    if (checkpoint / "pytorch_model").is_dir():
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")
    raise ValueError(f"{checkpoint} holds no model weights these recipes know (model.safetensors, "
                     "pytorch_model_fsdp_0/, pytorch_model/)")


def model_layout(model) -> dict:
    """{parameter name: shape, e.g. "64x32"} of the model as the engine holds it (ZeRO-3: the
    unpartitioned shape)."""
    return {name: "x".join(map(str, getattr(param, "ds_shape", param.shape)))
            for name, param in model.named_parameters()}


class Checkpointer:
    """Saves and restores one run's checkpoints under `<args.output_dir>/checkpoints`.

    `model`: the unwrapped model (its parameter layout is recorded); `layout`: `data_layout(...)`;
    `saved_with`: what writes JSON beside the weights with `save_pretrained` (the model's config,
    its image processor), so that a checkpoint names its model as a saved directory does
    (`mmrecipes.vlm.model.compose` takes a CLIP checkpoint as a tower).
    """

    def __init__(self, accelerator, args, scheduler, model, layout: dict, ranks, saved_with: tuple = ()):
        self.accelerator, self.scheduler, self.saved_with, self.ranks = accelerator, scheduler, saved_with, ranks
        self.root = Path(args.output_dir) / "checkpoints"
        self.total_limit, self.ignore_data_skip = args.save_total_limit, args.ignore_data_skip
        self.save_steps, self.max_steps = args.save_steps, args.max_steps
        self.lock = OutputDirLock(args.output_dir)
        self.train_loader = None  # the training stream whose position saves keep (`resume`)
        self.layout, self.model = dict(layout), model_layout(model)
        self.schedule = {name: getattr(args, name) for name in SCHEDULE}
        self.resumed_totals = {}  # the log's totals at the checkpoint resumed from (`resume`)

    def _data_state(self) -> tuple[str, bool]:
        """(this rank's data position file, whether it writes it): its data rank's (`ranks`). The
        ranks of a sequence-parallel group (reading the same rows) share their group's, written by
        the first; so a resume with another group size reads each data rank's own position."""
        return f"data_state_{self.ranks.data_rank}.json", self.ranks.counts_reads

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (other names beside them, e.g. a copy
        'checkpoint-6-backup', are not)."""
        return sorted((path for path in self.root.glob("checkpoint-*")
                       if CHECKPOINT_NAME.fullmatch(path.name) and (path / MARKER).is_file()), key=step_of)

    def save_if_due(self, step: int, epoch: int, guard, report):
        """Save at every --save_steps step and when a preemption signal reached any rank
        (`guard.stop_requested`; then exit with `PREEMPTED_EXIT_CODE` on every rank); never at the
        last step, which saves the model."""
        if step < self.max_steps and (guard.stop_requested or self.save_steps and step % self.save_steps == 0):
            checkpoint = self.save(step, epoch, report.totals_so_far())
            if guard.stop_requested:
                guard.exit_preempted(checkpoint)  # run the same command again to continue

    def save(self, step: int, epoch: int, totals: dict | None = None) -> Path:
        """Model, optimizer, scheduler and RNG state after `step` optimizer steps, the training
        stream's position after its last batch, which came from `epoch`, and the log's `totals` so
        far (its counters, `Report.totals_so_far`) (call on every rank). A write that fails (a full
        or read-only disk, an I/O error) raises CheckpointSaveFailed, saying what failed, the last
        complete checkpoint and how to resume; what it wrote is removed (or, where it cannot be,
        removed at the next start)."""
        partial = self.root / f"{PARTIAL}checkpoint-{step}"
        try:
            return self._save(step, epoch, totals, partial)
        # torch's writer raises RuntimeError on a full disk
        except (OSError, RuntimeError) as error:
            if isinstance(error, RuntimeError) and not WRITE_FAILED.search(str(error)):
                raise
            raise self._save_failed(step, partial, error) from None

    def _save(self, step: int, epoch: int, totals: dict | None, partial: Path) -> Path:
        accelerator, final = self.accelerator, self.root / f"checkpoint-{step}"
        if accelerator.is_main_process and partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial)
        accelerator.wait_for_everyone()
        accelerator.save_state(partial)
        # plain data (the schedule's functions are the recipe's code)
        if accelerator.is_main_process:
            (partial / SCHEDULER).write_text(json.dumps(self.scheduler.state_dict()))
            for item in self.saved_with:
                item.save_pretrained(partial)
        name, writes = self._data_state()
        # after the last batch the loop took: none read ahead
        if self.train_loader is not None and writes:
            data_state = {"epoch": epoch, "loader": self.train_loader.state_dict()}
            (partial / name).write_text(json.dumps(data_state))
        accelerator.wait_for_everyone()  # every rank's files are written
        manifest = dict(self._on_every_rank(lambda name: [(name, file_digest(partial / name))],
                                            checkpoint_files(partial, MARKER)))
        if accelerator.is_main_process:
            (partial / MARKER).write_text(json.dumps({"step": step, "layout": self.layout, "model": self.model,
                                                      "schedule": self.schedule,
                                                      "files": manifest, "totals": totals or {}}, indent=1))
            replaced = self.root / f"{PARTIAL}replaced-checkpoint-{step}"
            # the same step saved again, e.g. after resuming from an older checkpoint
            if final.exists():
                os.rename(final, replaced)
            os.rename(partial, final)  # one step: readers see the whole checkpoint or none of it
            shutil.rmtree(replaced, ignore_errors=True)
            if self.total_limit:
                self._rotate()
        accelerator.wait_for_everyone()
        return final

    def _rotate(self):
        """Remove the oldest checkpoints beyond --save_total_limit: only the folders saves wrote,
        not a link to a checkpoint moved elsewhere (neither the link nor what it points to); one
        that cannot be removed stays."""
        for old in [path for path in self.complete() if not path.is_symlink()][:-self.total_limit]:
            doomed = self.root / f"{PARTIAL}deleted-{old.name}"
            try:
                os.rename(old, doomed)  # never picked again, even if the deletion is cut short
                shutil.rmtree(doomed)
            except OSError as error:
                self.accelerator.print(f"could not remove {old} beyond --save_total_limit ({error}); left in place")

    def _save_failed(self, step: int, partial: Path, error: Exception) -> "CheckpointSaveFailed":
        """The error that ends a run whose save failed, after removing what it wrote where it
        can."""
        shutil.rmtree(partial, ignore_errors=True)
        complete = self.complete()
        last = f"the last complete checkpoint is {complete[-1]}" if complete else "no complete checkpoint yet"
        what = f"{error.strerror} ({error.filename})" if isinstance(error, OSError) and error.strerror else str(error)
        return CheckpointSaveFailed(
            f"saving checkpoint-{step} failed: {what.splitlines()[0]}; {last}. Free space or make {self.root} "
            "writable, then run the same command with --resume_from_checkpoint latest")

    def _on_every_rank(self, work, items: list) -> list:
        """`work(item)` (a list) for every item, the items shared out over the ranks; every rank
        gets all results."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        mine = [result for item in items[rank::world] for result in work(item)]
        return gather_object(mine) if world > 1 else mine

    def claim_output_dir(self):
        """Take the output directory's lock on the main process; every rank raises if it could
        not."""
        problem = ""
        if self.accelerator.is_main_process:
            try:
                note = self.lock.acquire()
                if note:
                    self.accelerator.print(note)
            except OutputDirBusy as error:
                problem = str(error)
        problem = gather_object([problem])[0] if self.accelerator.num_processes > 1 else problem
        if problem:
            raise OutputDirBusy(problem)

    def remove_partial(self):
        """Remove what saves cut short left behind (main process; call before the first save): the
        folders a save names, not a file or a link of another name that merely starts the same."""
        if self.accelerator.is_main_process:
            for leftover in sorted(self.root.glob(f"{PARTIAL}*")):
                if PARTIAL_NAME.fullmatch(leftover.name) and leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover)
                    self.accelerator.print(f"removed {leftover}: a checkpoint save that did not finish")
        self.accelerator.wait_for_everyone()

    def find(self, which: str) -> Path | None:
        """The checkpoint `--resume_from_checkpoint` names, validated: "latest" is the newest
        complete one that validates (None when there is none yet), or a path. Raises if it does not
        belong to this run."""
        if which != "latest":
            path = Path(which)
            if not (path / MARKER).is_file():
                raise FileNotFoundError(f"--resume_from_checkpoint {which}: not a complete checkpoint (no {MARKER}; "
                                        "a save that was cut short, or not a checkpoint directory)")
            if problems := self.problems(path):
                raise UnsafeCheckpoint(f"--resume_from_checkpoint {which} cannot be resumed: {'; '.join(problems)}")
            return path
        passed_over = []
        for path in reversed(self.complete()):
            if not (problems := self.problems(path)):
                if passed_over:
                    self.accelerator.print(f"resuming from {path.name}, the newest checkpoint that validates; passed "
                                           f"over {' | '.join(passed_over)}")
                return path
            passed_over.append(f"{path.name}: {'; '.join(problems)}")
        if passed_over:
            raise UnsafeCheckpoint(f"--resume_from_checkpoint latest: no checkpoint under {self.root} validates: "
                                   + " | ".join(passed_over))
        return None

    def problems(self, checkpoint: Path) -> list[str]:
        """Why `checkpoint` cannot be resumed as it is (the same list on every rank); raises
        ValueError if it belongs to another run (another model, or another data layout without
        --ignore_data_skip)."""
        try:
            saved = json.loads((checkpoint / MARKER).read_text())
            manifest = saved["files"]
            if not (isinstance(manifest, dict) and isinstance(saved["step"], int)
                    and isinstance(saved["layout"], dict)):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return [f"{MARKER} has no file manifest, step and layout (not written by these recipes, or by an older "
                    "version)"]
        self._check_belongs(checkpoint, saved)
        if links := link_problems(checkpoint):
            return links
        names = sorted(set(manifest) | set(checkpoint_files(checkpoint, MARKER)))
        problems = self._on_every_rank(lambda name: check_manifest(checkpoint, manifest, [name]), names)
        if problems:
            return problems
        problems = self._on_every_rank(lambda name: list(filter(None, [plain_data_problem(checkpoint, name)])), names)
        problems += self._on_every_rank(self._state_problems, [(checkpoint, saved)])
        return problems

    def _state_problems(self, item) -> list[str]:
        """The scheduler's state and every rank's data position, against what this run can load."""
        checkpoint, saved = item
        problems = []
        scheduler_state = json.loads((checkpoint / SCHEDULER).read_text())
        expected = self.scheduler.state_dict()
        if not isinstance(scheduler_state, dict) or set(scheduler_state) != set(expected):
            problems.append(f"{SCHEDULER} holds {sorted(scheduler_state) if isinstance(scheduler_state, dict) else '?'}"
                            f", not the scheduler's state {sorted(expected)}")
        if self.ignore_data_skip:
            return problems
        # every epoch gives a batch
        max_epoch = saved["step"] * saved["layout"]["gradient_accumulation_steps"]
        for process in range(saved["layout"]["data_ranks"]):
            name = f"data_state_{process}.json"
            try:
                state = json.loads((checkpoint / name).read_text())
                if not (isinstance(state["epoch"], int) and 0 <= state["epoch"] <= max_epoch):
                    raise ValueError(f"epoch {state['epoch']!r} is not an epoch {saved['step']} steps can reach")
                for position in _positions(state["loader"]):
                    ResumableShuffle.check_position(position, block_size=saved["layout"]["shuffle_buffer_size"],
                                                    # rows a loader batch
                                                    batch_size=saved["layout"].get(
                                                        "loader_batch_size",
                                                        saved["layout"]["per_device_train_batch_size"]),
                                                    max_epoch=max_epoch)
            except (OSError, ValueError, KeyError, TypeError) as error:
                problems.append(f"{name}: {error}")
        return problems

    def _check_belongs(self, checkpoint: Path, saved: dict):
        model = saved.get("model", {})
        if model != self.model:
            differ = [f"{name} {model.get(name, 'absent')} there, {self.model.get(name, 'absent')} here"
                      for name in sorted(set(model) | set(self.model)) if model.get(name) != self.model.get(name)]
            raise ValueError(f"{checkpoint} holds another model: {len(differ)} parameters differ, e.g. "
                             f"{'; '.join(differ[:3])}. Resume with the --model_name_or_path / model flags it was "
                             "saved with (to start another model from these weights, load its saved model instead).")
        layout = saved.get("layout", {})
        changed = [(key, layout.get(key), value) for key, value in self.layout.items() if layout.get(key) != value]
        if changed and not self.ignore_data_skip:
            raise ValueError(f"{checkpoint} was saved with {', '.join(f'{k}={old}' for k, old, _ in changed)}; this "
                             f"run has {', '.join(f'{k}={new}' for k, _, new in changed)}. The saved data position "
                             "only holds for the same data and data layout: resume with the processes, batch size (or "
                             "token budget and packing), accumulation steps, --dataloader_num_workers, --seed, "
                             "--shuffle_buffer_size and data it was saved with, or pass --ignore_data_skip true to "
                             "restore the rest and start the data from the beginning.")

    def open_run(self, which: str | None, train_loader) -> tuple[int, int | None]:
        """(start_step, epoch): take the output directory (its lock), remove saves cut short, and,
        with `which` (--resume_from_checkpoint), restore model, optimizer, scheduler and RNG from it
        and the training stream's position into `train_loader`, saying which epoch that position is
        in (None: the data start from the beginning). Iterating from there repeats the uninterrupted
        run exactly."""
        self.claim_output_dir()
        self.remove_partial()
        self.train_loader = train_loader
        # the sample order depends on it
        self.layout["dataloader_num_workers"] = train_loader.num_workers
        checkpoint = self.find(which) if which else None
        if which and checkpoint is None:
            self.accelerator.print(f"--resume_from_checkpoint {which}: no complete checkpoint under {self.root} yet; "
                                   "starting from step 0")
        if checkpoint is None:
            return 0, None
        # this run's (--learning_rate, a part's own), before the saved
        peak_rates = list(self.scheduler.base_lrs)
        self.accelerator.load_state(checkpoint)
        self.scheduler.load_state_dict(json.loads((checkpoint / SCHEDULER).read_text()))
        self._keep_peak_rates(peak_rates)
        start_step = step_of(checkpoint)
        marker = json.loads((checkpoint / MARKER).read_text())
        self._say_schedule(checkpoint, start_step, marker.get("schedule"))
        totals = marker.get("totals")  # counters: finite, >= 0, or left out
        self.resumed_totals = {name: value for name, value in (totals if isinstance(totals, dict) else {}).items()
                               if type(value) in (int, float) and math.isfinite(value) and value >= 0}
        if self.ignore_data_skip:
            self.accelerator.print(f"resumed from {checkpoint} at step {start_step}; --ignore_data_skip: the data "
                                   "start from the beginning")
            return start_step, None
        data_state = json.loads((checkpoint / self._data_state()[0]).read_text())
        # no row is read again to find the position
        train_loader.load_state_dict(data_state["loader"])
        self.accelerator.print(f"resumed from {checkpoint} at step {start_step}, the data at its saved position in "
                               f"epoch {data_state['epoch']}")
        return start_step, data_state["epoch"]


    def _keep_peak_rates(self, peak_rates: list[float]):
        """This run's peak learning rates, not the saved run's: the scheduler's and the optimizer's
        state bring back the rates they were saved with, so a resume with another --learning_rate
        trained at the old one while its flags said the new one. The current rates follow this run's
        schedule from the saved step on."""
        scheduler = self.scheduler
        if list(scheduler.base_lrs) == peak_rates:
            return
        scheduler.base_lrs = peak_rates
        rates = [peak * schedule(scheduler.last_epoch) for peak, schedule in zip(peak_rates, scheduler.lr_lambdas)]
        for group, peak, rate in zip(scheduler.optimizer.param_groups, peak_rates, rates):
            group["initial_lr"], group["lr"] = peak, rate
        scheduler._last_lr = rates

    def _say_schedule(self, checkpoint: Path, step: int, saved):
        """Where this run's learning-rate schedule is not the checkpoint's run's, say so: its steps
        after `step` follow this one, those before followed the other, so the run repeats no
        straight run."""
        if not isinstance(saved, dict):
            return
        changed = [(name, saved.get(name), value) for name, value in self.schedule.items() if saved.get(name) != value]
        if changed:
            now = ", ".join(f"--{name} {new}" for name, _, new in changed)
            before = ", ".join(f"--{name} {old}" for name, old, _ in changed)
            self.accelerator.print(f"resumed with {now} where {checkpoint} was saved with {before}: the learning rate "
                                   f"of the steps after {step} follows this run's schedule, of those before the saved "
                                   "run's, so this run repeats neither straight run")


def _positions(loader_state):
    """Every ResumableShuffle position in a StatefulDataLoader state (one per DataLoader worker)."""
    if isinstance(loader_state, dict):
        if "rows_done" in loader_state:
            yield loader_state
        else:
            for value in loader_state.values():
                yield from _positions(value)
    elif isinstance(loader_state, list):
        for value in loader_state:
            yield from _positions(value)
