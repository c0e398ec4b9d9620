"""Streamed image-caption data: load, split by data rank, decode + transform + tokenise, collate.

Every rank runs the same deterministic preprocessing (the image processor and tokenizer the
model is saved with), so ranks differ only in which rows they read. Bad rows never crash the
run: unusual image modes are converted to RGB, and undecodable, oversized or captionless rows
are dropped inside the stream and counted (the counts ride along with the next good row, so
they survive DataLoader workers and reach the log).
"""

import io
import itertools
import logging
import multiprocessing.forkserver
import os
import re
import select
import signal
import threading
from collections import Counter
from dataclasses import dataclass
from functools import partial

import datasets
import numpy
import torch
from datasets.distributed import split_dataset_by_node
from PIL import Image
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision.transforms.v2.functional import normalize as normalize_image
from transformers.image_processing_backends import TorchvisionBackend

from .models import EMBEDDED

logger = logging.getLogger(__name__)

# The tokenizer's thread pool only competes with torch's for the cores on batches of short captions:
# tokenising took twice as long with it on the 2-core machine. An explicit setting wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHAPES_DATA = EMBEDDED / "shapes"
COUNTED = ("converted", "undecodable", "too_large", "no_caption")  # what the log reports


@dataclass
class DataArgs:
    dataset_name: str = str(SHAPES_DATA)  # hub id, local dataset dir, or a builder ('parquet', 'imagefolder')
    dataset_config_name: str | None = None
    # Training files for a builder: globs, brace ranges ({00000..00099}), comma-separated, local or
    # fsspec URLs (expand_data_files). The eval files go in eval_data_files.
    data_files: str | None = None
    eval_data_files: str | None = None
    train_split: str = "train"
    eval_split: str | None = "test"  # None (or an empty eval set) turns evaluation off
    image_column: str = "image"
    caption_column: str = "text"
    max_caption_length: int | None = None  # tokens; default the tokenizer's model_max_length
    max_image_pixels: int = 50_000_000  # larger images are skipped before they are decoded
    shuffle_buffer_size: int = 1000  # rows per shuffled block (ResumableShuffle)
    # None: chosen per rank (default_num_workers): none on a CPU, where the step already uses every core
    # (on 2 cores one worker halves data_wait but makes the default run slower: bench/data_loading.py);
    # with CUDA one per spare core, at most one per shard. One worker keeps the sample order of none;
    # more split the shards between them (a checkpoint holds each one's position: docs/long_runs.md).
    dataloader_num_workers: int | None = None


def expand_data_files(spec: str | list[str] | None) -> list[str] | None:
    """`--data_files` as `load_dataset` takes it: comma-separated entries (or a list), each with its
    brace ranges expanded as open_clip/webdataset users write them (`/data/{00000..41455}.tar`, zero
    padding kept; `{a,b}` alternatives too). Globs and fsspec URLs pass through to `datasets`."""
    if not spec:
        return None
    if not isinstance(spec, str):
        return [path for entry in spec for path in expand_data_files(entry)]
    entries, depth, current = [], 0, ""
    for char in spec:  # split on commas outside braces
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    return [path for entry in entries + [current] if entry.strip() for path in _expand_braces(entry.strip())]


def _expand_braces(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[:match.start()], match.group(1), pattern[match.end():]
    numeric = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric:
        first, last = numeric.groups()
        width = len(first) if first.startswith("0") and len(first) > 1 else 0
        step = 1 if int(last) >= int(first) else -1
        choices = [f"{i:0{width}d}" for i in range(int(first), int(last) + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:
        return [head + "{" + body + "}" + path for path in _expand_braces(tail)]  # a literal brace
    return [path for choice in choices for path in _expand_braces(head + choice + tail)]


def evaluation_off_reason(args: DataArgs) -> str | None:
    """Why this run has no evaluation, or None. A builder (`parquet`, `webdataset`, `json`, ...)
    reads only the files it is given: without --eval_data_files it would glob the working
    directory for the eval split, so evaluation is off instead."""
    if not args.eval_split:
        return "--eval_split is empty"
    if args.dataset_name in datasets.packaged_modules._PACKAGED_DATASETS_MODULES and not args.eval_data_files:
        return (f"--dataset_name {args.dataset_name} reads only the files it is given and --eval_data_files is not "
                "set (give it, or --eval_split '' to silence this line)")
    return None


def split_by_data_rank(stream, name: str, data_rank: int, data_world: int):
    """This data rank's share of a stream. Whole shards when their number is a multiple of the data
    world; otherwise `split_dataset_by_node` has every rank read every shard and keep 1/W of its
    rows, which multiplies the read traffic by W: said once in the log, with what to do."""
    if data_world > 1 and stream.num_shards % data_world and data_rank == 0:
        logger.warning(f"{name}: {stream.num_shards} shards over {data_world} data ranks, not a multiple: every rank "
                       f"reads every shard and keeps 1/{data_world} of its rows ({data_world}x the read traffic). "
                       f"Split the data into a multiple of {data_world} files to give each rank whole shards.")
    return split_dataset_by_node(stream, rank=data_rank, world_size=data_world)


def load_image_text_stream(args: DataArgs, split: str, data_files, data_rank: int, data_world: int):
    """This data rank's share of a split, streamed, with images left undecoded."""
    data_files = expand_data_files(data_files)
    stream = datasets.load_dataset(
        args.dataset_name, args.dataset_config_name, data_files={split: data_files} if data_files else None,
        split=split, streaming=True,
    )
    missing = {args.image_column, args.caption_column} - set(stream.column_names or ())
    if stream.column_names is not None and missing:
        raise ValueError(f"{args.dataset_name} has columns {stream.column_names}; set --image_column/--caption_column "
                         f"(missing {sorted(missing)})")
    stream = split_by_data_rank(stream, args.dataset_name, data_rank, data_world)
    if stream.features is not None and isinstance(stream.features[args.image_column], datasets.Image):
        stream = stream.cast_column(args.image_column, datasets.Image(decode=False))  # we decode, and count failures
    return stream


def caption_length(args: DataArgs, tokenizer, pad_to_max_length: bool = False) -> int:
    """Tokens per caption. A model that pads captions to a fixed length (SigLIP pools the last
    position) must train at the length it is used with: the tokenizer's `model_max_length`."""
    length = args.max_caption_length or tokenizer.model_max_length
    if pad_to_max_length and length != tokenizer.model_max_length:
        raise ValueError(f"--max_caption_length {length}: this model pools its text at the last padded position, so "
                         f"it must train at the length it is used with, the tokenizer's model_max_length "
                         f"({tokenizer.model_max_length}; the zero-shot pipeline pads SigLIP to 64). Leave "
                         "--max_caption_length unset.")
    return length


class ImageTextPreprocessor:
    """Batched `datasets.map` function: rows in, model-ready rows out, bad rows dropped and counted."""

    def __init__(self, args: DataArgs, tokenizer, image_processor, max_length: int):
        self.args, self.tokenizer, self.image_processor = args, tokenizer, image_processor
        self.max_length = max_length
        self.drops = DropCounter()
        # uint8 pixels when the device can finish them (ImageTextCollator, model_inputs)
        self.normalize_here = device_normalization(image_processor) is None

    def __call__(self, batch):
        images, captions, counts = [], [], []
        for raw_image, caption in zip(batch[self.args.image_column], batch[self.args.caption_column]):
            if not isinstance(caption, str) or not caption.strip():
                self.drops.drop("no_caption")
                continue
            image, problem = decode_image(raw_image, self.args.max_image_pixels)
            if problem in ("undecodable", "too_large"):
                self.drops.drop(problem)
                continue
            images.append(image)
            captions.append(caption.strip())
            counts.append(self.drops.keep(problem))
        out = {"pixel_values": [], "input_ids": []} | {name: [] for name in COUNTED}
        if images:
            out["pixel_values"] = list(processed_pixels(self.image_processor, images, normalize=self.normalize_here))
            out["input_ids"] = self.tokenizer(captions, truncation=True, max_length=self.max_length)["input_ids"]
            for name in COUNTED:
                out[name] = [row[name] for row in counts]
        return out


def processed_pixels(image_processor, images: list[Image.Image], normalize: bool = True) -> torch.Tensor:
    """`image_processor(images)["pixel_values"]` for RGB images, computed a size group at a time.

    A processor that runs transformers' standard torchvision pipeline (CLIP, SigLIP, ...) is applied
    as its own resize, center crop and rescale-normalise on one uint8 stack per image size: the same
    operations and output as its __call__, which converts, checks and (on CPU) resizes one image
    at a time, about 4x the time on the embedded images. Any other processor is called as it is.
    `normalize=False`: the standard pipeline stops before rescale-normalise and returns uint8 pixels
    (a quarter of float32's bytes through the loader's shared memory, pinning and the copy to the
    device); `model_inputs` finishes them on the device (`device_normalization`), to the same floats.
    """
    if not _standard_pipeline_applies(image_processor):
        return image_processor(images=images, return_tensors="pt")["pixel_values"]
    groups = {}
    for index, image in enumerate(images):
        groups.setdefault(image.size, []).append(index)
    pixel_values = [None] * len(images)
    for indices in groups.values():
        stack = torch.from_numpy(numpy.stack([numpy.asarray(images[i]) for i in indices])).permute(0, 3, 1, 2)
        for index, pixels in zip(indices, _standard_pipeline(image_processor, stack, normalize)):
            pixel_values[index] = pixels
    return torch.stack(pixel_values)


def _standard_pipeline_applies(image_processor) -> bool:
    return (isinstance(image_processor, TorchvisionBackend) and not image_processor.do_pad
            and type(image_processor)._preprocess is TorchvisionBackend._preprocess)


def _standard_pipeline(processor, stack, normalize: bool):
    """TorchvisionBackend._preprocess's steps on one stack of equally sized uint8 images."""
    if processor.do_resize:
        stack = processor.resize(stack, processor.size, resample=processor.resample)
    if processor.do_center_crop:
        stack = processor.center_crop(stack, processor.crop_size)
    if not normalize:
        return stack
    return processor.rescale_and_normalize(stack, processor.do_rescale, processor.rescale_factor,
                                           processor.do_normalize, processor.image_mean, processor.image_std)


def device_normalization(image_processor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mean, std) for finishing uint8 pixels on the device, in the fused form of the processor's
    own `rescale_and_normalize` (mean / rescale, std / rescale: the same floats to the bit); None
    when its pixels are finished in the workers (not the standard pipeline, or no rescale-normalise)."""
    if not (_standard_pipeline_applies(image_processor) and image_processor.do_rescale and image_processor.do_normalize):
        return None
    scale = 1.0 / image_processor.rescale_factor
    return torch.tensor(image_processor.image_mean) * scale, torch.tensor(image_processor.image_std) * scale


class DropCounter:
    """Counts of dropped rows, attached to the next kept row: they ride along inside the stream,
    so they survive DataLoader workers and reach the log."""

    def __init__(self):
        self.pending = Counter()

    def drop(self, reason: str):
        self.pending[reason] += 1

    def keep(self, note: str | None = None) -> Counter:
        """The counts to attach to a kept row (`note`: what was done to it, e.g. "converted")."""
        counts = self.pending + Counter({note: 1} if note else {})
        self.pending = Counter()
        return counts


def decode_image(raw_image, max_pixels: int):
    """(RGB image or None, problem or None); problem is "converted", "undecodable" or "too_large".

    `raw_image`: a PIL image, a path, or a datasets.Image(decode=False) dict {"bytes", "path"}.
    """
    try:
        if isinstance(raw_image, dict):
            raw_image = io.BytesIO(raw_image["bytes"]) if raw_image.get("bytes") else raw_image["path"]
        image = raw_image if isinstance(raw_image, Image.Image) else Image.open(raw_image)
        if image.width * image.height > max_pixels:  # header only: nothing decoded yet
            return None, "too_large"
        image.load()
    except Image.DecompressionBombError:  # PIL refuses at open() beyond twice its own pixel limit
        return None, "too_large"
    except Exception as error:  # missing files; PIL raises many types for corrupt or truncated ones
        logger.debug("undecodable image: %s", error)
        return None, "undecodable"
    if image.mode == "RGB":
        return image, None
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background, "converted"
    return image.convert("RGB"), "converted"  # L, P, CMYK, I;16, ...


class ResumableShuffle(torch.utils.data.IterableDataset):
    """This rank's training rows, shuffled and preprocessed, and where the stream stands after the
    last row handed out (`state_dict`), so a checkpoint resumes the data exactly where it stood at
    the cost of re-reading one block (a shuffle buffer cannot resume: `datasets` drops its content
    on `load_state_dict`).

    `source` (a `datasets` stream, unshuffled, whose own `state_dict` resumes exactly) is read in
    blocks of `block_size` rows; each block is permuted by a generator seeded with (seed, epoch,
    block) and handed to `preprocess` (a batched `datasets.map` function) `batch_size` rows at a
    time. Every row is read once per epoch, as with a shuffle buffer of the same size; a row moves
    at most `block_size` places within its shard. The shards are read in an order seeded by (seed,
    epoch): `datasets` permutes a stream's shards by its own epoch, which is set from both, so each
    epoch reads them in another order (and a rank with `split_dataset_by_node` other shards).

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
        self.source.set_epoch(1 + hash((self.seed, epoch)) % (2**31 - 1))  # 0 would keep the file order

    def state_dict(self) -> dict | None:
        """Where the stream stands after the last row handed out (None: before the first)."""
        return self.position

    def load_state_dict(self, position: dict | None):
        """Continue after the row of `position` in its epoch (call before iterating)."""
        self.start = self.position = position

    def __iter__(self):
        start = {"block": 0, "source_state": self.initial_state, "rows_done": 0, "kept": 0}
        if self.start is not None and self.start["epoch"] == self.epoch:  # later epochs start from the beginning
            start = self.start
        self.source.load_state_dict(start["source_state"])
        rows = iter(self.source)
        block, rows_done, kept_done = start["block"], start["rows_done"], start["kept"]
        source_state = start["source_state"]  # state_dict() reads the previous pass until a row is read
        while True:
            raw = list(itertools.islice(rows, self.block_size))
            if not raw:
                return
            generator = torch.Generator().manual_seed(hash((self.seed, self.epoch, block)) % 2**63)
            raw = [raw[i] for i in torch.randperm(len(raw), generator=generator).tolist()]
            for chunk_start in range(rows_done, len(raw), self.batch_size):
                chunk = raw[chunk_start:chunk_start + self.batch_size]
                out = self.preprocess({column: [row[column] for row in chunk] for column in chunk[0]})
                for kept, values in enumerate(zip(*out.values()), start=1):
                    if kept > kept_done:
                        self.position = {"epoch": self.epoch, "block": block, "source_state": source_state,
                                         "rows_done": chunk_start, "kept": kept}
                        yield dict(zip(out, values))
                kept_done = 0
            block, rows_done, source_state = block + 1, 0, self.source.state_dict()


class ImageTextCollator:
    """Rows -> {pixel_values, input_ids, attention_mask, data_counts}; pads captions to the batch
    max, or to `pad_to_length`. uint8 pixels come with the `pixel_mean` and `pixel_std` that
    `model_inputs` finishes them with (`device_normalization`)."""

    def __init__(self, tokenizer, image_processor, pad_to_length: int | None = None):
        if tokenizer.pad_token_id is None:
            raise ValueError(f"{type(tokenizer).__name__} has no pad token to pad captions with: set "
                             "tokenizer.pad_token (e.g. to its eos_token) and save it with the model")
        self.pad_token_id, self.padding_side = tokenizer.pad_token_id, tokenizer.padding_side
        self.pad_to_length = pad_to_length
        self.normalization = device_normalization(image_processor)

    def __call__(self, rows):
        # What tokenizer.pad returns, without its per-row Python (a third of the collate time).
        lengths = torch.tensor([len(row["input_ids"]) for row in rows])
        positions = torch.arange(self.pad_to_length or int(lengths.max()))
        if self.padding_side == "left":
            positions = positions.flip(0)
        attention_mask = positions < lengths[:, None]
        input_ids = torch.full(attention_mask.shape, self.pad_token_id)
        input_ids[attention_mask] = torch.tensor([token for row in rows for token in row["input_ids"]])
        batch = {
            "pixel_values": torch.stack([row["pixel_values"] for row in rows]),
            "input_ids": input_ids,
            "attention_mask": attention_mask.long(),
            "data_counts": torch.tensor([sum(row[name] for row in rows) for name in COUNTED]),
        }
        if batch["pixel_values"].dtype == torch.uint8:
            if self.normalization is None:
                raise ValueError("uint8 pixel values, but the image processor does not rescale and normalise them in "
                                 "its standard pipeline: preprocess with processed_pixels(..., normalize=True)")
            batch["pixel_mean"], batch["pixel_std"] = self.normalization
        return batch


def build_dataloader(args: DataArgs, split, data_files, tokenizer, image_processor, *, batch_size, data_rank,
                     data_world, shuffle_seed=None, pad_to_max_length=False):
    """A DataLoader over this data rank's rows. Pass it to `accelerator.prepare`? No: it is
    already split by data rank, and accelerate would shard a datasets stream a second time.
    `pad_to_max_length`: pad every caption to `caption_length` (SigLIP), not to the batch max."""
    stream = load_image_text_stream(args, split, data_files, data_rank, data_world)
    max_length = caption_length(args, tokenizer, pad_to_max_length)
    preprocess = ImageTextPreprocessor(args, tokenizer, image_processor, max_length)
    if shuffle_seed is None:
        stream = stream.map(preprocess, batched=True, batch_size=batch_size, remove_columns=stream.column_names)
    else:  # same seed on every rank; each rank shuffles its own rows
        stream = ResumableShuffle(stream, preprocess, block_size=args.shuffle_buffer_size, seed=shuffle_seed,
                                  batch_size=batch_size)
    collator = ImageTextCollator(tokenizer, image_processor, max_length if pad_to_max_length else None)
    return stream_loader(stream, batch_size, collator, args.dataloader_num_workers)


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


def stream_loader(stream, batch_size: int, collate_fn, num_workers: int | None, cpu_workers: int = 0):
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
    pipeline once, is cheap.
    """
    if num_workers is None:
        num_workers = default_num_workers(stream.num_shards, cpu_workers)
    if num_workers:
        start_worker_server()
    return StatefulDataLoader(
        stream, batch_size=batch_size, collate_fn=collate_fn, num_workers=num_workers,
        pin_memory=torch.cuda.is_available(), worker_init_fn=partial(init_worker, training_pid=os.getpid()),
        multiprocessing_context="forkserver" if num_workers else None,
        persistent_workers=num_workers > 0, prefetch_factor=2 if num_workers else None,
    )


# What Slurm, srun and the launchers send to a whole process group on preemption or shutdown.
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def start_worker_server():
    """Start the fork server (once per process) ignoring GROUP_SIGNALS, which it inherits.

    The training process handles a preemption signal (StepGuard: checkpoint at the next step
    boundary, then exit), but the server shares its process group and would die of it, and then
    the workers, which watch their parent, stop too: the next batch would fail before the save.
    """
    # What the workers run, imported once in the server (Python 3.11 would re-import the recipe in
    # every worker otherwise: its preload of '__main__' is a no-op, fixed only in 3.12).
    multiprocessing.set_forkserver_preload(["mmrecipes.data", "mmrecipes.chat_data"])
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


def model_inputs(batch, device):
    """The model's tensors of a collated batch, on `device`; uint8 pixels rescaled and normalised there."""
    inputs = {key: batch[key].to(device, non_blocking=True) for key in ("input_ids", "attention_mask", "pixel_values")}
    if "pixel_mean" in batch:
        mean, std = (batch[key].to(device, non_blocking=True) for key in ("pixel_mean", "pixel_std"))
        inputs["pixel_values"] = normalize_image(inputs["pixel_values"].to(torch.float32), mean, std, inplace=True)
    return inputs


def batches_forever(dataloader, first_epoch=0, resumed=False):
    """Yield (epoch, batch) over epochs of this rank's stream; (epoch, None) after an empty epoch.

    Each rank loops over its own rows, so a rank never runs dry while others train: every
    rank stops at the same optimizer step. The recipe agrees on "got a batch" once, at the
    first batch, so an empty shard stops every rank with one clear error instead of a hang.
    `resumed`: the first epoch continues a saved position (and may have nothing left).
    """
    epoch = first_epoch
    while True:
        dataloader.dataset.set_epoch(epoch)  # a new shuffle order per epoch
        empty = True
        for batch in dataloader:
            empty = False
            yield epoch, batch
        if empty and not resumed:
            yield epoch, None
        epoch, resumed = epoch + 1, False
