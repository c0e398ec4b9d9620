"""A rank's stream as batches: resumable block shuffling, token budgets, the DataLoader and the
loop's batches.

`ResumableShuffle` shuffles a rank's rows in blocks and knows where it stands after every row, so a
checkpoint resumes the stream exactly; `stream_loader` is the torchdata `StatefulDataLoader` over
it, whose state holds every DataLoader worker's position; `rank_loader` builds both for either
pipeline (image-caption pairs, conversations); `TrainBatches` is what the training loop takes
batches from, over epochs.
"""

import itertools
import multiprocessing.forkserver
import os
import select
import signal
import threading
import time
from functools import partial

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from .distributed import all_ranks_true
from .skips import no_rows_error

ROW_SEED = "__row_seed__"  # a column ResumableShuffle gives its preprocess function
FIRST_ROWS = 8  # check_held_out's rows at a time: one row decides, where a batch cost a whole batch's preprocessing


class ResumableShuffle(torch.utils.data.IterableDataset):
    """This rank's training rows, shuffled and preprocessed, and where the stream stands after the
    last row handed out (`state_dict`), so a checkpoint resumes the data exactly where it stood at
    the cost of re-reading one block (a shuffle buffer cannot resume: `datasets` drops its content
    on `load_state_dict`).

    `source` (a `datasets` stream, unshuffled, whose own `state_dict` resumes exactly) is read in
    blocks of `block_size` rows; each block is permuted by a generator seeded with (seed, epoch,
    block) and handed to `preprocess` (a batched `datasets.map` function) `batch_size` rows at a
    time, with a `ROW_SEED` column: each row's own seed, from its place in the stream (random
    augmentation drawn from it repeats on a resume). Every row is read once per epoch, as with a
    shuffle buffer of the same size; a row moves at most `block_size` places within its shard. The
    shards are read in an order seeded by (seed, epoch): `datasets` permutes a stream's shards by
    its own epoch, which is set from both, so each epoch reads them in another order (and a rank
    with `split_dataset_by_node` other shards).

    With DataLoader workers (torchdata's `StatefulDataLoader`: `stream_loader`), each worker reads
    its own shards and reports its own position; the loader's `state_dict` holds them all and which
    worker is next, so a resume is exact for the same number of workers.
    """

    def __init__(self, source, preprocess, *, block_size: int, seed: int, batch_size: int):
        self.source, self.preprocess = source, preprocess
        self.block_size, self.seed, self.batch_size = block_size, seed, batch_size
        self.initial_state = source.state_dict()
        self.start = self.position = None
        # In shared memory: persistent DataLoader workers hold a copy of this object made at their start.
        self.shared_epoch = torch.zeros((), dtype=torch.long).share_memory_()
        self.set_epoch(0)

    @property
    def num_shards(self) -> int:
        return self.source.num_shards

    @property
    def epoch(self) -> int:
        return int(self.shared_epoch)

    def set_epoch(self, epoch: int):
        """In the main process, before iterating: the workers' copies share both epochs' memory."""
        self.shared_epoch.fill_(epoch)
        # 0 would keep the file order
        self.source.set_epoch(1 + hash((self.seed, epoch)) % (2**31 - 1))

    def state_dict(self) -> dict | None:
        """Where the stream stands after the last row handed out (None: before the first)."""
        return self.position

    def load_state_dict(self, position: dict | None):
        """Continue after the row of `position` in its epoch (call before iterating)."""
        self.start = self.position = position

    @staticmethod
    def check_position(position: dict, *, block_size: int, batch_size: int, max_epoch: int):
        """Raise ValueError unless `position` is one `__iter__` can have handed out with these
        sizes."""
        limits = {"epoch": (0, max_epoch), "block": (0, None), "rows_done": (0, block_size - 1),
                  "kept": (1, batch_size)}
        for key, (low, high) in limits.items():
            value = position.get(key)
            if type(value) is not int or value < low or (high is not None and value > high):
                raise ValueError(f"data position {key}={value!r} is out of range ({low} to {high or 'any'})")
        if position["rows_done"] % batch_size or not isinstance(position.get("source_state"), dict):
            raise ValueError(f"data position rows_done={position['rows_done']} is not a multiple of the batch size "
                             f"{batch_size}, or its source_state is missing")

    def __iter__(self):
        start = {"block": 0, "source_state": self.initial_state, "rows_done": 0, "kept": 0}
        # later epochs start from the beginning
        if self.start is not None and self.start["epoch"] == self.epoch:
            start = self.start
        self.source.load_state_dict(start["source_state"])
        rows = iter(self.source)
        block, rows_done, kept_done = start["block"], start["rows_done"], start["kept"]
        # state_dict() reads the previous pass until a row is read
        source_state = start["source_state"]
        worker = getattr(torch.utils.data.get_worker_info(), "id", 0)
        while True:
            raw = list(itertools.islice(rows, self.block_size))
            if not raw:
                return
            generator = torch.Generator().manual_seed(hash((self.seed, self.epoch, block)) % 2**63)
            raw = [raw[i] for i in torch.randperm(len(raw), generator=generator).tolist()]
            for chunk_start in range(rows_done, len(raw), self.batch_size):
                chunk = raw[chunk_start:chunk_start + self.batch_size]
                columns = {column: [row[column] for row in chunk] for column in chunk[0]}
                columns[ROW_SEED] = [hash((self.seed, self.epoch, worker, block, chunk_start + index)) % 2**63
                                     for index in range(len(chunk))]
                out = self.preprocess(columns)
                for kept, values in enumerate(zip(*out.values()), start=1):
                    if kept > kept_done:
                        self.position = {"epoch": self.epoch, "block": block, "source_state": source_state,
                                         "rows_done": chunk_start, "kept": kept}
                        yield dict(zip(out, values))
                kept_done = 0
            block, rows_done, source_state = block + 1, 0, self.source.state_dict()


def default_num_workers(num_shards: int, cpu_workers: int = 0) -> int:
    """DataLoader workers for one rank's stream when none are asked for. With CUDA: one per core
    this rank can spare (its share of the cores, less one for the training loop), at most one per
    shard (a worker without a shard idles, and torch warns). On a CPU the step itself uses every
    core, so the pipeline's measured `cpu_workers` (CLIP 0, VLM 1), again at most one per shard."""
    if not torch.cuda.is_available():
        return min(cpu_workers, num_shards)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    spare_cores = len(os.sched_getaffinity(0)) // local_processes - 1
    return max(0, min(spare_cores, num_shards))


def rank_loader(stream, preprocess, collator, args, *, batch_size: int, shuffle_seed: int | None,
                remove_columns: list[str], budget: int | None = None, length=None, cpu_workers: int = 0):
    """The DataLoader over a data rank's rows `stream`, which both pipelines build the same way: for
    training (`shuffle_seed` set) shuffled in blocks and preprocessed (`ResumableShuffle`: a
    checkpoint resumes it exactly), then cut into micro-batches of `batch_size` rows or, with
    `budget`, of whole rows up to that many tokens or patches (`TokenBudgetBatches`, `length(row)`);
    for evaluation preprocessed in stream order (`remove_columns`: the raw columns) in fixed
    batches. `args`: the data arguments (`SourceArgs`). The workers' fork server imports the
    preprocessing's and the collator's modules once."""
    if shuffle_seed is None:
        rows = stream
        stream = stream.map(preprocess, batched=True, batch_size=batch_size, remove_columns=remove_columns)
        # its skip counts, as ResumableShuffle's, for `no_rows_error`; its rows a few at a time for `check_held_out`
        stream.preprocess = preprocess
        stream.first_rows = rows.map(preprocess, batched=True, batch_size=FIRST_ROWS, remove_columns=remove_columns)
    else:  # same seed on every rank; each rank shuffles its own rows
        stream = ResumableShuffle(stream, preprocess, block_size=args.shuffle_buffer_size, seed=shuffle_seed,
                                  batch_size=batch_size)
    preload = (type(preprocess).__module__, type(collator).__module__)
    if budget:  # whole micro-batches from the stream; the loader adds no batching of its own
        return stream_loader(TokenBudgetBatches(stream, budget, length or row_tokens), None, collator,
                             args.dataloader_num_workers, cpu_workers, preload)
    return stream_loader(stream, batch_size, collator, args.dataloader_num_workers, cpu_workers, preload)


def stream_loader(stream, batch_size: int, collate_fn, num_workers: int | None, cpu_workers: int = 0,
                  preload: tuple[str, ...] = ()):
    """The DataLoader over a rank's stream (never passed to `accelerator.prepare`: already split).
    `num_workers` None: `default_num_workers`. Workers persist across epochs (ResumableShuffle
    keeps its epoch in shared memory), each keeps 2 batches ready, and batches are pinned on CUDA.
    torchdata's `StatefulDataLoader`: its `state_dict` holds each worker's stream position (the
    dataset's `state_dict`, taken in the worker after each batch) and which worker comes next, so
    `load_state_dict` resumes with any number of workers, in time that does not grow with the step.

    Workers fork from multiprocessing's fork server, not from the training process: by the first
    batch that process runs threads (gloo, pyarrow's jemalloc, datasets' readers), and a child
    forked while one of them holds a lock can hang for good (our suspect for a CI run in which
    a rank never reached its first all-reduce). Forking from the server, which imports the data
    pipeline once (`preload`: the modules of the caller's preprocessing and collator), is cheap.
    """
    # The tokenizer's thread pool only competes with torch's for the cores on batches of short captions:
    # tokenising took twice as long with it on the 2-core machine. An explicit setting wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if num_workers is None:
        num_workers = default_num_workers(stream.num_shards, cpu_workers)
    if num_workers:
        start_worker_server(preload)
    return StatefulDataLoader(
        stream, batch_size=batch_size, collate_fn=collate_fn, num_workers=num_workers,
        pin_memory=torch.cuda.is_available(), worker_init_fn=partial(init_worker, training_pid=os.getpid()),
        multiprocessing_context="forkserver" if num_workers else None,
        persistent_workers=num_workers > 0, prefetch_factor=2 if num_workers else None,
    )


# What Slurm, srun and the launchers send to a whole process group on preemption or shutdown.
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def start_worker_server(preload=()):
    """Start the fork server (once per process) ignoring GROUP_SIGNALS, which it inherits; it
    imports the modules `preload` names once: the data pipeline's (what the workers run), and in the
    tests what their ranks import.

    The training process handles a preemption signal (StepGuard: checkpoint at the next step
    boundary, then exit), but the server shares its process group and would die of it, and then
    the workers, which watch their parent, stop too: the next batch would fail before the save.
    """
    # What the workers run, imported once in the server (Python 3.11 would re-import the recipe in
    # every worker otherwise: its preload of '__main__' is a no-op, fixed only in 3.12).
    multiprocessing.set_forkserver_preload(list(preload))
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in GROUP_SIGNALS}
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def init_worker(worker_id: int, training_pid: int):
    """DataLoader `worker_init_fn`. The worker leaves the process group that preemption signals
    reach, takes their default action back (the DataLoader stops its workers with SIGTERM), and
    ends when the training process ends, however it ends. torch's own check watches the parent,
    which here is the fork server, and the server in turn lives while any worker does: a crashed
    rank would leave both behind, holding the launcher's output pipes open.
    """
    os.setsid()
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    threading.Thread(target=_exit_with, args=(training_pid,), daemon=True).start()


def _exit_with(pid: int):
    try:
        process = os.pidfd_open(pid)  # readable once the process has ended
    except ProcessLookupError:
        os._exit(1)
    select.select([process], [], [])
    os._exit(1)


class TrainBatches:
    """`next(batches)`: this rank's next training batch, over epochs (`batches_forever`; None: the
    rank has no rows), timed: `epoch` is the epoch of the batch last taken, and `take_wait()` the
    seconds spent waiting for batches since it was last called (the report's data_wait)."""

    def __init__(self, dataloader, resumed_epoch: int | None = None):
        self.dataloader, self._batches = dataloader, batches_forever(dataloader, resumed_epoch)
        self.epoch, self._waited = resumed_epoch or 0, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        self.epoch, batch = next(self._batches)
        self._waited += time.perf_counter() - start
        return batch

    def take_wait(self) -> float:
        waited, self._waited = self._waited, 0.0
        return waited

    def check_rows(self, window: list, accelerator, data_world: int):
        """At the first step: every rank raises together if a data rank got no batch (every epoch
        reads the same rows, so once is enough); the rank without rows says why
        (`no_rows_error`)."""
        if not all_ranks_true(None not in window, accelerator.device):
            raise no_rows_error(self.dataloader, data_world, None in window)


def check_held_out(dataloader, device, source: str):
    """Before the first step: every rank raises together when no rank's held-out loader gives a row
    (every row skipped, an empty file), each saying what its share skipped, by reason
    (`no_rows_error`). Otherwise the evaluation would silently never run, and the model card would
    still name `source`. Read here, in the main process, `FIRST_ROWS` at a time until one is kept:
    no DataLoader worker starts for it."""
    empty = next(iter(dataloader.dataset.first_rows), None) is None
    if all_ranks_true(empty, device):
        raise no_rows_error(dataloader, 0, True, held_out=source)


def batches_forever(dataloader, resumed_epoch: int | None = None):
    """Yield (epoch, batch) over epochs of this rank's stream; (epoch, None) after an empty epoch.

    Each rank loops over its own rows, so a rank never runs dry while others train: every
    rank stops at the same optimizer step. The recipe agrees on "got a batch" once, at the
    first batch, so an empty shard stops every rank with one clear error instead of a hang.
    `resumed_epoch`: the epoch of a position loaded into the loader (`Checkpointer.open_run`), which
    continues there (and may have nothing left).
    """
    epoch, resumed = (0, False) if resumed_epoch is None else (resumed_epoch, True)
    while True:
        dataloader.dataset.set_epoch(epoch)  # a new shuffle order per epoch
        empty = True
        for batch in dataloader:
            empty = False
            yield epoch, batch
        if empty and not resumed:
            yield epoch, None
        epoch, resumed = epoch + 1, False


def row_tokens(row) -> int:
    return len(row["input_ids"])


class TokenBudgetBatches(torch.utils.data.IterableDataset):
    """This rank's rows (a `ResumableShuffle`) grouped into micro-batches of at most `max_tokens`
    tokens, a row's tokens as `length` counts them (a module-level function: DataLoader workers
    receive it pickled).

    Rows keep their stream order and the next row that does not fit starts the next micro-batch,
    so the grouping depends only on the rows: a resume after a micro-batch's last row (its saved
    position) groups the rest exactly as the straight run did.
    """

    def __init__(self, rows, max_tokens: int, length=row_tokens):
        self.rows, self.max_tokens, self.length = rows, max_tokens, length
        self.position = None

    @property
    def num_shards(self) -> int:
        return self.rows.num_shards

    @property
    def epoch(self) -> int:
        return self.rows.epoch

    def set_epoch(self, epoch: int):
        self.rows.set_epoch(epoch)

    def state_dict(self) -> dict | None:
        """After the last row of the last micro-batch handed out (the rows have read one
        further)."""
        return self.position

    def load_state_dict(self, position: dict | None):
        self.position = position
        self.rows.load_state_dict(position)

    def __iter__(self):
        batch, tokens, batch_end = [], 0, None
        for row in self.rows:
            length = self.length(row)
            if batch and tokens + length > self.max_tokens:
                self.position = batch_end
                yield batch
                batch, tokens = [], 0
            batch.append(row)
            tokens += length
            # after this row: the stream position the batch ends at
            batch_end = self.rows.state_dict()
        if batch:
            self.position = batch_end
            yield batch
