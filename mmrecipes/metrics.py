"""What a recipe logs: the sums of a logging window, by name, reduced over the ranks once per window."""

import time
from collections import Counter

import torch

from .distributed import sum_over_ranks

# How the log line writes a value (others: as they are); the tracker gets the numbers.
FORMATS = {"loss": ".6f", "grad_norm": ".6f", "lr": ".2e", "samples_per_s": ".1f", "tokens_per_s": ".0f",
           "mfu": ".2%", "data_wait": ".3f", "rewards/accuracies": ".3f"}
FORMATS |= dict.fromkeys(("rewards/chosen", "rewards/rejected", "rewards/margins"), ".5f")  # the DPO recipe's
FORMATS |= dict.fromkeys(("logps/chosen", "logps/rejected"), ".4f")
LABELS = {"samples_per_s": "samples/s", "tokens_per_s": "tokens/s", "mfu": "MFU"}


class LogWindow:
    """The sums of one logging window on this rank, by name.

    - `next(batches)`: the next batch, the wait for it summed as `data_wait` (seconds);
    - `add_applied(applied, name=value, ...)`: sums over the optimizer steps the guard applied, kept on the
      device (`applied` is its verdict there: no host read per step);
    - `add(name=value, ..., data_counts=...)`: plain numbers from the CPU batches, and the data counts;
    - `pause(seconds)`: time the window does not count (evaluation);
    - `close()`: every sum over all ranks in one collective, with the window's `seconds` and the data
      counts by name, and the next window started. `total` keeps the sums of all closed windows, from
      `total` on (a resumed run's: `Checkpointer.resumed_totals`);
    - `totals_so_far()`: `total` with the open window's sums (a collective), for a checkpoint.
    """

    def __init__(self, device, counted: tuple[str, ...], total: dict | None = None):
        self.device, self.counted, self.total = device, counted, Counter(total or {})
        self._start()

    def _start(self):
        self.on_device, self.on_host = {}, Counter()
        self.data_counts = torch.zeros(len(self.counted), dtype=torch.long)
        self.started = time.perf_counter()

    def next(self, batches):
        start = time.perf_counter()
        item = next(batches)
        self.on_host["data_wait"] += time.perf_counter() - start
        return item

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
        seconds = time.perf_counter() - self.started
        sums = self._summed()
        self.total.update(sums)
        self._start()
        return sums | {"seconds": seconds}

    def totals_so_far(self) -> dict[str, float]:
        return dict(self.total + Counter(self._summed()))

    def _summed(self) -> dict[str, float]:
        names = [*self.on_device, *self.on_host, *self.counted]
        local = torch.cat([torch.stack(list(self.on_device.values())).double() if self.on_device
                           else torch.zeros(0, dtype=torch.float64, device=self.device),
                           torch.tensor(list(self.on_host.values()), dtype=torch.float64, device=self.device),
                           self.data_counts.double().to(self.device)])
        return dict(zip(names, sum_over_ranks(local).tolist()))


def log_line(step: int, max_steps: int, metrics: dict) -> str:
    """`step N/M | name value | ...`, each value as FORMATS writes it."""
    return f"step {step}/{max_steps} | " + " | ".join(_pair(name, value) for name, value in metrics.items())


def eval_line(step: int, metrics: dict) -> str:
    return f"eval step {step} | " + " | ".join(
        f"{name} {value:.4f}" if isinstance(value, float) else f"{name} {value}" for name, value in metrics.items())


def _pair(name, value) -> str:
    if value is None:
        return f"{LABELS.get(name, name)} n/a"
    return f"{LABELS.get(name, name)} {format(value, FORMATS.get(name, ''))}"
