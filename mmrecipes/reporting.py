"""What a recipe reports: one call writes the tracker, the model card's history and the console
line.

The loop hands the report its batches once per step (`add_batches`: samples, tokens, text-only
batches, FLOPs and the data counts, as each collator counts them) and its own sums (`add_step`: the
loss parts, kept on the device, left out on a skipped step). At a logging step, `close` sums the
window over all ranks in one collective and `log` writes the recipe's own metrics followed by the
throughput every recipe reports (`throughput`) and the counters so far. The run's evaluations are
components (`Evaluation`) the report runs when due (`evaluate`: one loop line for all).
"""

import dataclasses
import json
import time
from collections import Counter
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from .distributed import sum_over_ranks
from .model_card import History
from .throughput import peak_flops

# How the log line writes a value (others: as they are; a recipe adds its own metrics', `Report(formats=...)`); the
# tracker gets the numbers.
FORMATS = {"loss": ".6f", "grad_norm": ".6f", "lr": ".2e", "samples_per_s": ".1f", "tokens_per_s": ".0f",
           "mfu": ".2%", "data_wait": ".3f"}
LABELS = {"samples_per_s": "samples/s", "tokens_per_s": "tokens/s", "mfu": "MFU"}


class WindowSums:
    """The sums of one logging window on this rank, by name.

    - `add_applied(applied, name=value, ...)`: sums over the optimizer steps the guard applied, kept
      on the device (`applied` is its verdict there: no host read per step);
    - `add(name=value, ..., data_counts=...)`: plain numbers from the CPU batches, and the data
      counts;
    - `pause(seconds)`: time the window does not count (evaluation);
    - `close()`: every sum over all ranks in one collective, with the window's `seconds` and the
      data counts by name, and the next window started. `total` keeps the sums of all closed
      windows, from `total` on (a resumed run's: `Checkpointer.resumed_totals`);
    - `totals_so_far()`: `total` with the open window's sums (a collective), for a checkpoint.
    """

    def __init__(self, device, counted: tuple[str, ...], total: dict | None = None):
        self.device, self.counted, self.total = device, counted, Counter(total or {})
        self._start()

    def _start(self):
        self.on_device, self.on_host = {}, Counter()
        self.data_counts = torch.zeros(len(self.counted), dtype=torch.long)
        self.started = time.perf_counter()

    def add_applied(self, applied: torch.Tensor, **values):
        for name, value in values.items():
            value = torch.where(applied, torch.as_tensor(value, device=self.device).float(), 0)
            self.on_device[name] = self.on_device[name] + value if name in self.on_device else value

    def add(self, data_counts: torch.Tensor | None = None, **values):
        self.on_host.update({name: float(value) for name, value in values.items()})
        if data_counts is not None:
            self.data_counts += data_counts

    def pause(self, seconds: float):
        self.started += seconds

    def close(self) -> dict[str, float]:
        """The window's sums over all ranks, 0 for a name an earlier window had and this one has not
        (a GRPO step that trains on earlier completions samples nothing)."""
        seconds = time.perf_counter() - self.started
        sums = self._summed()
        self.total.update(sums)
        self._start()
        return dict.fromkeys(self.total, 0.0) | sums | {"seconds": seconds}

    def totals_so_far(self) -> dict[str, float]:
        return dict(self.total + Counter(self._summed()))

    def _summed(self) -> dict[str, float]:
        names = [*self.on_device, *self.on_host, *self.counted]
        local = torch.cat([torch.stack(list(self.on_device.values())).double() if self.on_device
                           else torch.zeros(0, dtype=torch.float64, device=self.device),
                           torch.tensor(list(self.on_host.values()), dtype=torch.float64, device=self.device),
                           self.data_counts.double().to(self.device)])
        return dict(zip(names, sum_over_ranks(local).tolist()))


class Evaluation:
    """An evaluation of the run that `Report.evaluate` runs when due: its `parts` in order (each
    `part(filler) -> {name: value}`, called on every rank, so collectives run inside; `filler`: what
    a rank with nothing left to evaluate forwards), their scores on one eval line. Due every `every`
    steps (None: the run's --eval_steps; 0: at the last step only) and at the run's last step, or,
    `at_start`, before the first step of a run that starts at 0 only. Without parts it is never due
    (held-out data not given, no benchmark named). For the model card: `curves`, the names of its
    scores it plots; `card`, a function giving its lines there (the benchmarks' numbers)."""

    def __init__(self, parts: list, every: int | None = None, at_start: bool = False, curves=(), card=None):
        self.parts, self.every, self.at_start = list(parts), every, at_start
        self.curves, self.card = list(curves), card

    def due(self, step: int, before_step: bool, eval_steps: int, max_steps: int) -> bool:
        if not self.parts or before_step != self.at_start:
            return False
        if self.at_start:
            return step == 0
        every = eval_steps if self.every is None else self.every
        return step == max_steps or (every > 0 and step % every == 0)

    def __call__(self, filler) -> dict:
        scores = {}
        for part in self.parts:
            scores |= part(filler)
        return scores


class Report:
    """One run's reporting: when a report or an evaluation is due, the window's sums, and the lines
    they make.

    `batches`: the loop's `loader.TrainBatches` (its wait for data is the report's `data_wait`, its
    epoch goes to the tracker); `counted`: the names of the collator's `data_counts`;
    `flops(batch)`: a batch's training FLOPs (MFU; None: not reported); `guard`: the run's
    `StepGuard` (its skipped steps are reported); `total`: the sums a resumed run starts from
    (`Checkpointer.resumed_totals`); `ranks` (`distributed.Ranks`): where another rank counts the
    batches this one reads too (a sequence-parallel peer), this one counts none; `formats`: how the
    log line writes the recipe's own metrics (`FORMATS`' format specs); `evaluations`: the run's
    `Evaluation`s in the order their lines come.
    """

    def __init__(self, accelerator, args, batches, counted: tuple[str, ...], *, guard, ranks, flops=None, total=None,
                 formats: dict | None = None, evaluations=()):
        self.accelerator, self.batches, self.counted, self.guard, self.flops, self.ranks = (
            accelerator, batches, counted, guard, flops, ranks)
        self.evaluations = list(evaluations)
        self.formats = FORMATS | (formats or {})
        self.logging_steps, self.eval_steps, self.max_steps = args.logging_steps, args.eval_steps, args.max_steps
        self.peak = peak_flops(args.peak_tflops)
        self.window, self.history = WindowSums(accelerator.device, counted, total), History()
        # keeps the bar intact
        self.write = tqdm.write if accelerator.is_main_process else lambda line: None

    @property
    def total(self) -> Counter:
        return self.window.total

    def due(self, step: int) -> bool:
        return step % self.logging_steps == 0 or step == self.max_steps

    def evaluate(self, step: int, filler, before_step: bool = False):
        """Each of the run's evaluations due at `step` (before its training where `before_step`), in
        order, each on an eval line of its own and left out of samples/s (`evaluating`); `filler`:
        what a rank with nothing left to evaluate forwards (any batch of the step). Those of the
        last step wait for `evaluate_last`."""
        if step == self.max_steps and not before_step:
            return
        self._run_due(step, filler, before_step)

    def evaluate_last(self, filler):
        """The evaluations due at the last step, called once the model is saved: whatever they do (a
        scorer that raises is counted; the model's own errors, out of memory in generation, end the
        run), the model is kept."""
        self._run_due(self.max_steps, filler, before_step=False)

    def _run_due(self, step: int, filler, before_step: bool):
        for evaluation in self.evaluations:
            if evaluation.due(step, before_step, self.eval_steps, self.max_steps):
                with self.evaluating(step) as scores:
                    scores |= evaluation(filler)

    def curves(self) -> list[str]:
        """The evaluations' scores the model card plots, in their order."""
        return [name for evaluation in self.evaluations for name in evaluation.curves]

    def card_lines(self) -> list[str]:
        """The evaluations' own lines for the model card (the benchmarks' numbers)."""
        return [line for evaluation in self.evaluations if evaluation.card for line in evaluation.card()]

    def add_batches(self, window: list, trained: list | None = None):
        """Count a step's batches: those read (`window`: rows, `num_samples`, and the data counts)
        and those trained (`trained`, by default the ones read: tokens and text-only batches where
        the collator counts them, FLOPs). GRPO reads prompts and trains their completions, each
        batch of them for --num_iterations steps; distillation trains samples of its prompts or
        their answers: a batch of `prompts` read is never counted as trained."""
        # a peer's zeros: every rank sums the same names
        share = 1 if self.ranks.counts_reads else 0
        for batch in window:
            self.window.add(data_counts=batch["data_counts"] * share, samples=batch["num_samples"] * share)
        for batch in [batch for batch in window if "prompts" not in batch] if trained is None else trained:
            counts = {"tokens": batch["num_tokens"], "dummy_image_batches": batch["dummy_image"]} if (
                "num_tokens" in batch) else {}
            if self.flops is not None:
                counts["flops"] = self.flops(batch)
            self.window.add(**{name: value * share for name, value in counts.items()})

    def add_step(self, **sums):
        """The step's own sums (loss parts), on the device, counted only if the guard applied the
        step."""
        self.window.add_applied(self.guard.applied, **sums)

    def close(self) -> dict[str, float]:
        """The window's sums over all ranks (one collective), with its `seconds`; the next window
        starts."""
        self.window.add(data_wait=self.batches.take_wait())
        return self.window.close()

    def totals_so_far(self) -> dict[str, float]:
        self.window.add(data_wait=self.batches.take_wait())
        return self.window.totals_so_far()

    def throughput(self, sums: dict) -> dict:
        """samples/s, tokens/s (where counted), MFU (None without a known peak), the share of time
        spent waiting for data, text-only batches (where counted), skipped steps and the data
        counters so far."""
        ranks, seconds = self.accelerator.num_processes, sums["seconds"]
        metrics = {"samples_per_s": sums["samples"] / seconds}
        if "tokens" in sums:
            metrics["tokens_per_s"] = sums["tokens"] / seconds
        metrics["mfu"] = sums["flops"] / seconds / (self.peak * ranks) if self.peak and "flops" in sums else None
        metrics["data_wait"] = sums["data_wait"] / ranks / seconds
        if "dummy_image_batches" in sums:
            metrics["dummy_image_batches"] = int(sums["dummy_image_batches"])
        metrics["skipped_steps"] = self.guard.skipped_so_far()
        return metrics | {name: int(self.total[name]) for name in self.counted}

    def log(self, step: int, metrics: dict, sums: dict):
        """The recipe's `metrics`, then `throughput(sums)`: to the trackers (with the epoch), the
        history and the console."""
        metrics = metrics | self.throughput(sums)
        self.accelerator.log(metrics | {"epoch": self.batches.epoch}, step=step)
        self.history.add(step, metrics)
        self.write(log_line(step, self.max_steps, metrics, self.formats))

    @contextmanager
    def evaluating(self, step: int):
        """`with report.evaluating(step) as scores:` the block's time is left out of samples/s, and
        what it puts into `scores` is logged after it."""
        start, scores = time.perf_counter(), {}
        yield scores
        self.window.pause(time.perf_counter() - start)
        if scores:
            self.accelerator.log(scores, step=step)
            self.history.add(step, scores, evaluation=True)
            self.write(eval_line(step, scores))


def tracker_config(*args) -> dict:
    """The run's flags for `accelerator.init_trackers`: every field of the argument dataclasses
    `args`, a mapping (--chat_template_kwargs) as its JSON text (TensorBoard's hparams take
    scalars only)."""
    values = {key: value for one in args for key, value in dataclasses.asdict(one).items()}
    return {key: json.dumps(value, sort_keys=True) if isinstance(value, dict) else value
            for key, value in values.items()}


def ratio(numerator: float, denominator: float) -> float:
    """A window's mean; nan when nothing was counted (every step skipped)."""
    return numerator / denominator if denominator else float("nan")


def log_line(step: int, max_steps: int, metrics: dict, formats: dict = FORMATS) -> str:
    """`step N/M | name value | ...`, each value as `formats` writes it."""
    return f"step {step}/{max_steps} | " + " | ".join(_pair(name, value, formats) for name, value in metrics.items())


def eval_line(step: int, metrics: dict) -> str:
    return f"eval step {step} | " + " | ".join(
        f"{name} {value:.4f}" if isinstance(value, float) else f"{name} {value}" for name, value in metrics.items())


def _pair(name, value, formats: dict) -> str:
    if value is None:
        return f"{LABELS.get(name, name)} n/a"
    return f"{LABELS.get(name, name)} {format(value, formats.get(name, ''))}"
