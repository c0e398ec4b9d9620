"""Streamed image-caption (or audio-caption) data: load, split by data rank, decode + transform +
tokenise, collate.

Every rank runs the same deterministic preprocessing (the image processor or feature extractor and
the tokenizer the model is saved with), so ranks differ only in which rows they read. Bad rows never
crash the run: unusual image modes are converted to RGB, and every row that cannot be used is
dropped inside the stream and counted by kind (`COUNTED`, `AUDIO_PAIR_COUNTED`; the counts ride
along with the next good row, so they survive DataLoader workers and reach the log).
"""

import zlib
from functools import partial

import datasets
import torch

from ..images import (
    NORMALIZED_BY,
    decode_image,
    device_normalization,
    padded_patches,
    patch_rows,
    processed_pixels,
    random_resized_crops,
    takes_patch_grids,
)
from ..loader import ROW_SEED, rank_loader
from ..skips import SKIPPED, DropCounter, Skip, data_counts
from ..sources import DATA_FILE, PROBLEM, SOURCE, load_stream, mixed_stream, split_sources
from .arguments import AUDIO_PAIR_COUNTED, COUNTED, DataArgs
from .audio_pairs import clip_features, decoded_clip, is_audio_extractor, stacked_clips


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


class PairPreprocessor:
    """Batched `datasets.map` function: rows in, model-ready rows out, bad rows dropped and counted.
    A subclass reads the media column (`decode`: the item, or why it is skipped, or a note on a
    kept row, `NOTES`) and encodes the kept items (`encode`)."""

    NOTES = ()

    def __init__(self, args: DataArgs, column: str, tokenizer, max_length: int):
        self.args, self.column, self.tokenizer, self.max_length = args, column, tokenizer, max_length
        self.drops = DropCounter()

    def __call__(self, batch):
        items, captions, counts, sources, seeds = [], [], [], [], []
        raw_items, raw_captions = batch[self.column], batch[self.args.caption_column]
        # rows from load_stream say what failed reading
        problems = batch.get(PROBLEM) or [None] * len(raw_items)
        # several sources: which one (mixed_stream)
        tags = batch.get(SOURCE) or [0] * len(raw_items)
        row_seeds = batch.get(ROW_SEED) or [None] * len(raw_items)  # from ResumableShuffle
        files = batch.get(DATA_FILE) or [None] * len(raw_items)
        for raw_item, caption, problem, source, seed, file in zip(raw_items, raw_captions, problems, tags, row_seeds,
                                                                  files):
            caption, problem = checked_caption(caption, problem)
            if problem is None:
                item, problem = self.decode(raw_item)
            if problem not in (None, *self.NOTES):
                self.drops.drop(Skip(problem), f"a row of {file}" if file else "")
                continue
            items.append(item)
            captions.append(caption)
            counts.append(self.drops.keep(problem))
            sources.append(source)
            seeds.append(seed)
        out = {"input_ids": [], "source": sources, SKIPPED: counts} | self.encode(items, seeds, captions)
        if items:
            out["input_ids"] = self.tokenizer(captions, truncation=True, max_length=self.max_length)["input_ids"]
        return out


def checked_caption(caption, problem: str | None) -> tuple:
    """(the caption stripped, problem): a binary caption decoded as UTF-8, a webdataset `.json`
    caption read from its "text" (LAION's audio shards: a list of captions, the first taken)."""
    if problem is None and isinstance(caption, dict):
        caption = caption.get("text")
    if problem is None and isinstance(caption, list):
        caption = next((text for text in caption if isinstance(text, str) and text.strip()), None)
    if problem is None and isinstance(caption, bytes):  # a binary caption column
        try:
            caption = caption.decode("utf-8")
        except UnicodeDecodeError:
            problem = "bad_text"
    if problem is None and (not isinstance(caption, str) or not caption.strip()):
        problem = "no_caption"
    return (caption.strip() if problem is None else None), problem


class ImageTextPreprocessor(PairPreprocessor):
    NOTES = ("converted",)

    def __init__(self, args: DataArgs, tokenizer, image_processor, max_length: int, augment: bool = False):
        super().__init__(args, args.image_column, tokenizer, max_length)
        self.image_processor, self.augment = image_processor, augment
        # uint8 pixels when the device can finish them (PairCollator, images.to_device)
        self.normalize_here = device_normalization(image_processor) is None
        # SigLIP 2 NaFlex: each row's patches and grid
        self.patch_grids = takes_patch_grids(image_processor)

    def decode(self, raw_image):
        return decode_image(raw_image, self.args.max_image_pixels, self.args.max_image_aspect_ratio)

    def encode(self, images, seeds, captions) -> dict:
        out = {"pixel_values": []} | ({"spatial_shapes": []} if self.patch_grids else {})
        if images and self.patch_grids:
            out["pixel_values"], out["spatial_shapes"] = patch_rows(self.image_processor, images)
        elif images:
            transform = partial(random_resized_crops, seeds=seeds) if self.augment else processed_pixels
            out["pixel_values"] = list(transform(self.image_processor, images, normalize=self.normalize_here))
        return out


class AudioTextPreprocessor(PairPreprocessor):
    """CLAP's rows (`audio_pairs`): each clip's features, drawn from its row's seed; in evaluation,
    where rows have none, from its caption and length (the same row, the same crop, on any number
    of ranks)."""

    NOTES = ("audio_cropped",)

    def __init__(self, args: DataArgs, tokenizer, extractor, max_length: int):
        super().__init__(args, args.audio_column, tokenizer, max_length)
        self.extractor = extractor

    def decode(self, raw_clip):
        samples, problem = decoded_clip(raw_clip, self.extractor, self.args.audio_max_seconds)
        if problem is None and len(samples) > self.extractor.nb_max_samples:
            problem = "audio_cropped"
        return samples, problem

    def encode(self, clips, seeds, captions) -> dict:
        seeds = [seed if seed is not None else zlib.crc32(caption.encode()) + len(clip)
                 for clip, seed, caption in zip(clips, seeds, captions)]
        rows = [clip_features(self.extractor, clip, seed) for clip, seed in zip(clips, seeds)]
        return {key: [row[key] for row in rows] for key in ("input_features", "is_longer", "clip_seed")}


class PairCollator:
    """Rows -> {media inputs, input_ids, attention_mask, num_samples, data_counts}; pads captions to
    the batch max, or to `pad_to_length`. Images: uint8 pixels come with the constants
    (`images.NORMALIZED_BY`) that `images.to_device` finishes them with (`device_normalization`);
    NaFlex rows are padded to the batch's longest image (`padded_patches`: with
    `pixel_attention_mask` and `spatial_shapes`). Clips: CLAP's features and flags
    (`audio_pairs.stacked_clips`). With several `sources`, `data_counts` ends with the rows from each
    (`DataArgs.counted`)."""

    def __init__(self, tokenizer, processor, pad_to_length: int | None = None, sources: int = 1):
        if tokenizer.pad_token_id is None:
            raise ValueError(f"{type(tokenizer).__name__} has no pad token to pad captions with: set "
                             "tokenizer.pad_token (e.g. to its eos_token) and save it with the model")
        self.pad_token_id, self.padding_side = tokenizer.pad_token_id, tokenizer.padding_side
        self.pad_to_length, self.sources = pad_to_length, sources
        self.processor, self.audio = processor, is_audio_extractor(processor)
        self.normalization = None if self.audio else device_normalization(processor)
        self.counted = AUDIO_PAIR_COUNTED if self.audio else COUNTED

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
            **self.media(rows),
            "input_ids": input_ids,
            "attention_mask": attention_mask.long(),
            "num_samples": len(rows),
            "data_counts": data_counts(rows, self.counted),
        }
        if self.sources > 1:
            rows_by_source = torch.bincount(torch.tensor([row["source"] for row in rows]), minlength=self.sources)
            batch["data_counts"] = torch.cat([batch["data_counts"], rows_by_source])
        return batch

    def media(self, rows) -> dict:
        if self.audio:
            return stacked_clips(rows, self.processor)
        pixels = [row["pixel_values"] for row in rows]
        media = (padded_patches(pixels, [row["spatial_shapes"] for row in rows]) if "spatial_shapes" in rows[0]
                 else {"pixel_values": torch.stack(pixels)})
        if media["pixel_values"].dtype == torch.uint8:
            if self.normalization is None:
                raise ValueError("uint8 pixel values, but the image processor does not rescale and normalise them in "
                                 "its standard pipeline: preprocess with processed_pixels(..., normalize=True)")
            media[NORMALIZED_BY["pixel_values"]] = self.normalization
        return media


def build_dataloader(args: DataArgs, split, data_files, tokenizer, processor, *, batch_size, ranks,
                     shuffle_seed=None, pad_to_max_length=False):
    """A DataLoader over this data rank's rows of `split` (`ranks.reads()`: `distributed.Ranks`):
    the training sources mixed at `dataset_weights` (`mmrecipes.sources.mixed_stream`), or, for any
    other split, the first source's. Pass it to `accelerator.prepare`? No: it is already split by
    data rank, and accelerate would shard a datasets stream a second time. `processor`: the image
    processor, or CLAP's feature extractor (audio-caption rows). `pad_to_max_length`: pad every
    caption to `caption_length` (SigLIP), not to the batch max."""
    audio = is_audio_extractor(processor)
    columns = [args.audio_column if audio else args.image_column, args.caption_column]

    def check_columns(name, available):
        if available is not None and set(columns) - set(available):
            flag = "audio" if audio else "image"
            raise ValueError(f"{name} has columns {available}; set --{flag}_column/--caption_column (missing "
                             f"{sorted(set(columns) - set(available))})")

    sources = split_sources(args.dataset_name, args.dataset_config_name, split, data_files)
    sources = sources if split == args.train_split else sources[:1]
    stream = mixed_stream(sources, args.dataset_weights, columns, **ranks.reads(),
                          seed=shuffle_seed or 0, check_columns=check_columns, tag_sources=True)
    max_length = caption_length(args, tokenizer, pad_to_max_length)
    # ROW_SEED's source
    augment = args.train_augment and split == args.train_split and shuffle_seed is not None
    # evaluation keeps fixed batches
    budget = args.max_patches_per_batch if shuffle_seed is not None else None
    check_media_flags(args, processor)
    preprocess = (AudioTextPreprocessor(args, tokenizer, processor, max_length) if audio
                  else ImageTextPreprocessor(args, tokenizer, processor, max_length, augment))
    collator = PairCollator(tokenizer, processor, max_length if pad_to_max_length else None, len(sources))
    # a clip's features cost more CPU than the model's step on it: one worker on a CPU as well
    return rank_loader(stream, preprocess, collator, args, batch_size=batch_size, shuffle_seed=shuffle_seed,
                       remove_columns=[*columns, PROBLEM, DATA_FILE, *[SOURCE] * (len(sources) > 1)],
                       budget=budget, length=image_patches, cpu_workers=int(audio))


def data_modality(args: DataArgs) -> str:
    """What the training data pairs with its captions, from the first source's columns: "image"
    (--image_column), else "audio" (--audio_column); the tiny default model follows it."""
    name, config, split, data_files = args.training_sources()[0]
    available = load_stream(name, config, split, data_files, [], data_rank=0, data_world=1)[1]
    if available is None or args.image_column in available:
        return "image"
    if args.audio_column in available:
        return "audio"
    raise ValueError(f"{name} has columns {available}, neither --image_column {args.image_column!r} nor "
                     f"--audio_column {args.audio_column!r}: set the one that holds the media")


def image_patches(row) -> int:
    return int(row["spatial_shapes"].prod())


def check_media_flags(args: DataArgs, image_processor):
    """Refuse, before the first step, image flags this processor cannot serve."""
    if is_audio_extractor(image_processor) and (args.max_patches_per_batch or args.train_augment):
        raise ValueError("--max_patches_per_batch and --train_augment are image flags; this model hears (CLAP): drop "
                         "them")
    if args.max_patches_per_batch and not takes_patch_grids(image_processor):
        raise ValueError("--max_patches_per_batch batches SigLIP 2 NaFlex images by their patch counts; this model "
                         "takes fixed-size images: use --per_device_train_batch_size")
    if args.max_patches_per_batch and args.max_patches_per_batch < getattr(image_processor, "max_num_patches", 0):
        raise ValueError(f"--max_patches_per_batch {args.max_patches_per_batch} is below one image's "
                         f"{image_processor.max_num_patches} patches (--max_num_patches): raise it")
    if args.train_augment and takes_patch_grids(image_processor):
        raise ValueError("--train_augment crops to the processor's fixed size; SigLIP 2 NaFlex keeps each image's "
                         "own size and aspect ratio: drop --train_augment")
