"""Rows to micro-batches for VLM fine-tuning: the dummy-image collator (padding or packing), and the
checks before the first step that use it.

`ChatCollator` gives a batch without any image the model's tiny dummy image, so the vision step runs
on every rank for every micro-batch (see mmrecipes.vlm.model.step); it also counts, on the host,
what the loop needs (rows, tokens, target tokens, data counts: `images.HOST_KEYS`, which
`images.to_device` leaves on the host). `probe_rows`: two probe conversations for the checks before
training (`models.check_packing`).
"""

import numpy
import torch
from PIL import Image

from ...audio_windows import WINDOWS
from ...images import NORMALIZED_BY
from ...skips import data_counts
from .chat_data import CHAT_COUNTED, TOKEN_ALIGNED, encode_row
from .labels import FEATURE_MASKS, IGNORE_INDEX, count_target_tokens

# the audio inputs of transformers' audio families: the features and which of their frames are a clip's
AUDIO_KEYS = ("input_features", *FEATURE_MASKS)
# a row holds images, videos, audio clips when it has these
MEDIA_KEYS = ("pixel_values", "pixel_values_videos", "input_features")


class ChatCollator:
    """Rows -> one micro-batch that runs the same graph on every rank (see
    mmrecipes.vlm.model.step).

    Pads each row to the longest on the right (labels with IGNORE_INDEX). With `packing`, the rows
    are first packed in order into sequences of up to `pack_length` tokens (one sequence if None),
    each row's first label ignored (it is never predicted from the sample before it), and
    `sample_lengths` / `media_per_sample` (images, videos, audio clips) list every
    segment of the padded `[sequences, L]` batch in order (a sequence's padding is a segment of its
    own), for per-sample positions and attention (mmrecipes.vlm.rows.packing). Concatenates the
    rows' image and video inputs in row order, and gives a batch without any image the model's tiny
    dummy image (`dummy_image_inputs`) with `dummy_image=True`, so the vision step runs on every
    micro-batch (a batch's videos go through the tower in the same call:
    `mmrecipes.vlm.model.step.VLMForTraining`). Where the dummy inputs hold a clip (a video path of
    the model's own), a batch without a clip gets it, with `dummy_video=True`; where they hold a sound (a model
    that hears), a batch without audio gets it, with `dummy_audio=True`. Audio features are right-padded to the
    batch's longest clip, their mask saying which frames are the clip's.
    """

    def __init__(self, pad_token_id: int, dummy_inputs: dict, packing: bool = False, pack_length: int | None = None):
        self.pad_token_id, self.dummy_inputs = pad_token_id, dummy_inputs
        self.packing, self.pack_length = packing, pack_length

    def __call__(self, rows):
        """The micro-batch of `rows`, in named steps: the packs (one a row without packing), the
        text, the segments of packed sequences, the media, the dummies for what the batch lacks, and
        the host's counts."""
        lengths = [len(row["input_ids"]) for row in rows]
        packs = _next_fit(lengths, self.pack_length) if self.packing else [[i] for i in range(len(rows))]
        joined = Joined(packs, max(sum(lengths[i] for i in pack) for pack in packs))
        batch = self.text(rows, joined)
        if self.packing:
            batch |= segments(rows, packs, lengths, joined.length)
        batch |= media(rows, joined)
        batch |= self.dummies(batch)
        return batch | counts(rows, lengths, batch["labels"])

    def text(self, rows, joined: "Joined") -> dict:
        """The token ids, the attention mask and the labels, padded (packed: each row's first label
        ignored)."""
        labels = [row["labels"] for row in rows]
        if self.packing:
            labels = [torch.cat([row_labels.new_full((1,), IGNORE_INDEX), row_labels[1:]]) for row_labels in labels]
        return {"input_ids": joined([row["input_ids"] for row in rows], self.pad_token_id),
                "attention_mask": joined([torch.ones_like(row["input_ids"]) for row in rows], 0),
                "labels": joined(labels, IGNORE_INDEX)}

    def dummies(self, batch: dict) -> dict:
        """The dummy image where the batch holds none (`dummy_image`), the dummy clip where the
        model has a video path of its own and the batch holds no clip (`dummy_video`), and the dummy
        sound where the model hears and the batch holds no audio (`dummy_audio`)."""
        # a model that only hears has no dummy image
        dummies = {"dummy_image": "pixel_values" not in batch and "pixel_values" in self.dummy_inputs}
        if dummies["dummy_image"]:
            dummies |= {key: value for key, value in self.dummy_inputs.items()
                        if key not in ("pixel_values_videos", *AUDIO_KEYS)}
        if "pixel_values_videos" in self.dummy_inputs and "pixel_values_videos" not in batch:
            dummies |= {"pixel_values_videos": self.dummy_inputs["pixel_values_videos"], "dummy_video": True}
        if "input_features" in self.dummy_inputs and "input_features" not in batch:
            dummies |= {key: self.dummy_inputs[key] for key in AUDIO_KEYS if key in self.dummy_inputs}
            dummies["dummy_audio"] = True
        return dummies


class Joined:
    """Rows' per-token tensors joined by pack and padded to the batch's `length` (`joined(tensors,
    pad value)`)."""

    def __init__(self, packs: list, length: int):
        self.packs, self.length = packs, length

    def __call__(self, tensors: list, value) -> torch.Tensor:
        return _pad([torch.cat([tensors[i] for i in pack]) for pack in self.packs], self.length, value)


def segments(rows, packs, lengths, length: int) -> dict:
    """Every segment of the packed sequences in order (`sample_lengths`; a sequence's padding a
    segment of its own) and its media (`media_per_sample`: its images, videos and audio clips)."""
    found = []
    for pack in packs:
        used = sum(lengths[i] for i in pack)
        found += [(lengths[i], *_media_counts(rows[i])) for i in pack]
        found += [(length - used, 0, 0, 0)] if used < length else []
    sample_lengths, *per_sample = torch.tensor(found).T.clone()
    return {"sample_lengths": sample_lengths, "media_per_sample": torch.stack(per_sample)}


def media(rows, joined: Joined) -> dict:
    """The rows' per-token media inputs joined as the text is (a text-only row's zeros: no image
    token), their image and video inputs concatenated in row order (`media_tensors`)."""
    batch = {}
    for key in TOKEN_ALIGNED[2:]:
        if any(key in row["media_inputs"] for row in rows):
            batch[key] = joined([row["media_inputs"].get(key, torch.zeros_like(row["input_ids"])) for row in rows], 0)
    return batch | media_tensors([row["media_inputs"] for row in rows if {*MEDIA_KEYS} & set(row["media_inputs"])])


def media_tensors(with_media: list) -> dict:
    """Images' and clips' inputs of the rows that hold any, concatenated in row order; the frames of
    clips of different lengths (`video_frames`); the constants that finish uint8 images and clips on
    the device (the same for every row)."""
    keys = {key for inputs in with_media for key in inputs} - {*TOKEN_ALIGNED, *NORMALIZED_BY.values()}
    batch = {key: _cat_padded([inputs[key] for inputs in with_media if key in inputs]) for key in keys}
    clips = [inputs["pixel_values_videos"] for inputs in with_media if "pixel_values_videos" in inputs]
    batch |= clip_frames(clips)
    return batch | {key: inputs[key] for inputs in with_media for key in NORMALIZED_BY.values() if key in inputs}


def clip_frames(clips: list) -> dict:
    """`video_frames`, each clip's frames, where clips of different lengths were zero-padded to the
    longest."""
    if clips and clips[0].dim() == 5 and len({clip.shape[1] for clip in clips}) > 1:
        return {"video_frames": [frames for row in clips for frames in [row.shape[1]] * len(row)]}
    return {}


def counts(rows, lengths, labels: torch.Tensor) -> dict:
    """What the loop reads on the host: rows, tokens (padding left out), target tokens, the data
    counts."""
    return {"num_samples": len(rows), "num_tokens": sum(lengths), "target_tokens": count_target_tokens(labels),
            "data_counts": data_counts(rows, CHAT_COUNTED)}


def _next_fit(lengths, capacity):
    """Row indices in order, grouped into packs of at most `capacity` tokens (one pack if None)."""
    packs, used = [[]], 0
    for index, length in enumerate(lengths):
        if packs[-1] and capacity is not None and used + length > capacity:
            packs.append([])
            used = 0
        packs[-1].append(index)
        used += length
    return packs



def _media_counts(row) -> tuple[int, int, int]:
    """(images, videos, audio clips) of a row: its grid rows (Qwen; its clips' windows: Voxtral),
    else its pixel values' (or features') first dimension."""
    inputs = row["media_inputs"]
    return tuple(len(inputs[grid]) if grid in inputs else len(inputs[pixels]) if pixels in inputs else 0
                 for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"),
                                      ("input_features", WINDOWS)))


def _cat_padded(tensors):
    """Concatenate per-row image tensors along dim 0, zero-padding the other dims to the largest, as
    the processors do within a batch (Idefics3 tiles, LLaVA-OneVision patches: all-zero ones are
    recognised as padding by the model)."""
    shape = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors))]
    padded = []
    for tensor in tensors:
        pad = [p for size, target in zip(reversed(tensor.shape[1:]), reversed(shape)) for p in (0, target - size)]
        padded.append(torch.nn.functional.pad(tensor, pad) if any(pad) else tensor)
    return torch.cat(padded)



def _pad(sequences, length, value):
    return torch.stack([torch.nn.functional.pad(seq, (0, length - len(seq)), value=value) for seq in sequences])



def probe_rows(labeller) -> list[dict]:
    """Two collator rows made with the labeller: a question about a white 32 px image (a model that only hears: about
    a second of noise) and a text-only one (checks before the first step)."""
    if labeller.image_token_id is not None:
        image = Image.new("RGB", (32, 32), (255, 255, 255))
        media, question, answer = {"images": [image]}, "What colour is it?", "white"
    else:
        rate = labeller.processor.feature_extractor.sampling_rate
        noise = numpy.random.default_rng(0).uniform(-0.5, 0.5, rate).astype(numpy.float32)
        media, question, answer = {"audios": [noise]}, "What is it?", "noise"
    kind = "image" if "images" in media else "audio"
    rows = []
    for given, question, answer in ((media, question, answer), ({}, "What comes after one?", "two")):
        content = [{"type": kind}] * bool(given) + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        input_ids, labels, media_inputs = encode_row(labeller, messages, given.get("images", []),
                                                     audios=given.get("audios", ()))
        rows.append({"input_ids": input_ids, "labels": labels, "media_inputs": media_inputs})
    return rows


def chat_rows(prompt: dict, completions: list[list[int]], labelled: list[bool]) -> list[dict]:
    """Collator rows (`ChatCollator`) of a prompt and its completions: the completion tokens are the
    targets (none where `labelled` is False: a masked truncated completion)."""
    rows = []
    for completion, target in zip(completions, labelled):
        tokens = torch.tensor(completion, dtype=prompt["input_ids"].dtype)
        labels = torch.cat([torch.full_like(prompt["input_ids"], IGNORE_INDEX),
                            tokens if target else torch.full_like(tokens, IGNORE_INDEX)])
        rows.append({"input_ids": torch.cat([prompt["input_ids"], tokens]), "labels": labels,
                     "media_inputs": prompt["media_inputs"]})
    return rows
