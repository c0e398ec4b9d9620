"""Why rows are skipped, counted: the reasons by kind, an example row of each and what to change.

A row that cannot be used raises `Skip` where it is read; the preprocessor drops it and
`DropCounter` counts it by reason, keeps one example of each and the fix (`FIXES`), and warns once
when more than half of the first rows are dropped. The counts travel in the stream beside the rows
kept (`SKIPPED`: the drops since the row before, on the next kept row), so they survive DataLoader
workers; `data_counts` sums them into a batch's counts. When a data rank ends up with no row at all,
`no_rows_error` is the error every rank raises, saying why.
"""

import logging
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# the column of a kept row: {reason: rows} dropped (or noted) since the row before it
SKIPPED = "skipped"


class Skip(Exception):
    """Why a row is skipped: a counted reason (`reason`, such as "outside_folder") and what was
    found (`detail`: the path tried, the column missing). The one exception a row's reading raises;
    its preprocessor counts it."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail

    def __reduce__(self):  # across processes (a DataLoader worker's), with its reason and detail
        return Skip, (self.reason, self.detail)


def data_counts(rows: list[dict], names: tuple[str, ...]) -> "torch.Tensor":
    """The rows' `SKIPPED` counts by `names` (a row without them counts nothing): a batch's
    `data_counts`."""
    # here: `Skip` is raised by the benchmark tasks, which the flags import before torch loads
    import torch

    return torch.tensor([sum(row.get(SKIPPED, {}).get(name, 0) for row in rows) for name in names])


# What to change, by skip reason: the line a skip report gives after each reason's count and example.
FIXES = {
    "outside_folder": "relative paths resolve against --image_folder / --video_folder, else the data file's own "
                      "folder; set the folder the paths are relative to, or --allow_images_outside_folder true to "
                      "read absolute and '../' paths",
    "undecodable": "check that the path exists relative to --image_folder (else the data file's folder) and that "
                   "the file is an image",
    "too_large": "raise --max_image_pixels or --max_image_aspect_ratio (clips: --video_max_pixels)",
    "image_mismatch": "give each <image> placeholder or image part one entry in the row's images (or LLaVA's "
                      "image) column",
    "video_mismatch": "give each <video> placeholder or video part one entry in the row's videos (or video) column",
    "video": "this model's processor takes no video: use a checkpoint with a video processor, or leave the video "
             "rows out",
    "audio": "this model does not hear (no audio tower, or no feature extractor), or (vlm_distill.py) its teacher "
             "does not: the rows are counted instead of trained without their sound; use a checkpoint that hears, or "
             "leave them out",
    "audio_mismatch": "give each <audio> placeholder or audio part one entry in the row's audios (or audio) column",
    "audio_undecodable": "check the clip's path (relative to --image_folder, else the data file's folder) and that "
                         "PyAV can decode it (an audio stream, a sound header)",
    "audio_empty": "the clip holds no samples: leave it out",
    "audio_too_long": "raise --audio_max_seconds (each second is 25 placeholders on Gemma 4: --max_length too)",
    "no_frames": "check the clip's path and that PyAV can decode it",
    "video_too_long": "raise --video_max_seconds",
    "too_long": "raise --max_length, or --max_tokens_per_batch where it is lower (rows are never truncated; "
                "--sequence_parallel_size N splits a row over N ranks, each holding the budget)",
    "no_target": "each conversation needs an assistant answer after its prompt",
    "unaligned": "the processor's tokens differ from the chat template's rendering of the answer: check the "
                 "tokenizer's chat template",
    "bad_row": "rows need 'messages' (role/content) or 'conversations' (from/value or role/content): see "
               "docs/data.md for the layouts read",
    "bad_text": "the file holds text that is not UTF-8",
    "bad_shard": "the file is empty, unreadable or truncated",
    "no_caption": "set --caption_column to the caption column",
    "no_preference": "a pair needs two different answers, neither empty",
}


class DropCounter:
    """Counts of dropped rows, attached to the next kept row: they ride along inside the stream, so
    they survive DataLoader workers and reach the log. It also keeps the whole tally, and the first
    example of each reason, for `report`: once `warn_after` rows are seen, more than half of them
    skipped is said in a warning with the report (and a rank left with no rows raises it)."""

    def __init__(self, warn_after: int = 200):
        self.pending, self.totals, self.examples = Counter(), Counter(), {}
        self.kept, self.warn_after = 0, warn_after

    def drop(self, skip: Skip, where: str = ""):
        """Count a skipped row (`where` names it)."""
        self.pending[skip.reason] += 1
        self.totals[skip.reason] += 1
        self.examples.setdefault(skip.reason, ", ".join(filter(None, [where, skip.detail])))
        self._warn_once()

    def keep(self, note: str | None = None) -> dict:
        """The counts a kept row carries (`SKIPPED`): the drops since the last kept row, and `note`,
        what was done to this one (e.g. "converted")."""
        self.kept += 1
        self._warn_once()
        counts = self.pending + Counter({note: 1} if note else {})
        self.pending = Counter()
        return dict(counts)

    def _warn_once(self):
        dropped = sum(self.totals.values())
        if dropped + self.kept == self.warn_after and dropped * 2 > self.warn_after:
            logger.warning("more than half of the first %d rows were skipped: %s", self.warn_after, self.report())

    def report(self) -> str:
        """The rows skipped so far by reason, each with its first example and what to change."""
        dropped = sum(self.totals.values())
        lines = [f"{dropped} of {dropped + self.kept} rows read were skipped"]
        for reason, count in self.totals.most_common():
            example = f", e.g. {self.examples[reason]}" if self.examples[reason] else ""
            lines.append(f"  {reason}: {count}{example}")
            if reason in FIXES:
                lines.append(f"    to change: {FIXES[reason]}")
        return "\n".join(lines)


def no_rows_error(dataloader, data_world: int, this_rank_empty: bool, held_out: str | None = None) -> RuntimeError:
    """The error every rank raises, together, when a data rank has no training rows at its first
    step, or (`held_out`: the evaluation's source) when no rank has a held-out row (one message for
    every recipe). The rank without rows says why: its skip report (`DropCounter.report`) from this
    process's preprocessing or, where DataLoader workers did that, from its share of the stream read
    again here."""
    message = (f"No data rank has a usable held-out row of {held_out}, so the evaluation would never run" if held_out
               else f"A data rank has no training rows ({data_world} data ranks)")
    if not this_rank_empty:
        return RuntimeError(f"{message}; that rank's error says why")
    shuffle = getattr(dataloader.dataset, "rows", dataloader.dataset)  # under TokenBudgetBatches
    drops = shuffle.preprocess.drops
    if not drops.totals:
        for _ in shuffle:  # nothing is kept: this reads to the end of the share
            pass
    if not drops.totals:
        return RuntimeError(f"{message}: this rank's share of the data is empty ({shuffle.num_shards} files or "
                            "shards): use more data files or fewer processes")
    return RuntimeError(f"{message}: {drops.report()}")
