"""Micro-batches by token budget, and packed sequences without padding, for the VLM recipe
(docs/vlm.md, "Token budgets and packing").

`TokenBudgetBatches` (`--max_tokens_per_batch N`) fills each micro-batch with whole rows up to N
tokens; the loss stays the exact token mean because `distributed.token_loss_scale` counts the
window's targets on every rank. Packing (`--packing true`) concatenates the rows into sequences of
up to `--max_length` tokens in which each sample attends only to itself and its positions restart:
`packed_position_ids` gives plain positions per sample, or each sample's own 3-D mRoPE positions for
the Qwen families; `models.check_packing` proves it on the model before the first step.
"""

import inspect

import torch

from .labels import FEATURE_MASKS, feature_mask


def packed_position_ids(model, input_ids, sample_lengths, media_per_sample, media_inputs) -> torch.Tensor:
    """Position ids of a packed `[sequences, L]` batch whose segments (samples, and each sequence's
    padding) have `sample_lengths` in order: positions restart at every segment. `media_per_sample`:
    each segment's image, video and audio clip counts, a row each.

    A model whose base has `get_rope_index` (Qwen2/2.5/3-VL: 3-D mRoPE over text, image and video
    grids, a video's temporal axis in its own seconds; the Omni thinkers: audio from its frames)
    gets each sample's own 3-D positions, computed as if the sample were alone, with plain text
    positions stacked in front (`[4, sequences, L]`: transformers builds the packed mask from those);
    any other model gets `[sequences, L]` plain positions.
    """
    shape = input_ids.shape
    text = torch.cat([torch.arange(int(n), device=input_ids.device) for n in sample_lengths])
    rope_index = getattr(getattr(model, "model", model), "get_rope_index", None)
    if rope_index is None:
        return text.reshape(shape)
    flat = input_ids.reshape(1, -1)
    per_token = {name: media_inputs[name].reshape(1, -1) for name in ("mm_token_type_ids", "token_type_ids")
                 if name in media_inputs and name in inspect.signature(rope_index).parameters}
    # Per image: its grid; per video: its grid and seconds per temporal patch; per clip: its feature frames
    media = [{key: media_inputs[key] for key in keys if key in media_inputs}
             for keys in (("image_grid_thw",), ("video_grid_thw", "second_per_grid_ts"), FEATURE_MASKS)]
    counts = media_per_sample.T.tolist()
    positions, start, firsts = [], 0, [0, 0, 0]
    for length, sample_counts in zip(sample_lengths.tolist(), counts):
        kwargs = {name: value[:, start:start + length] for name, value in per_token.items()}
        for kind, count in enumerate(sample_counts):
            kwargs |= {key: value[firsts[kind]:firsts[kind] + count] for key, value in media[kind].items() if count}
            firsts[kind] += count
        if any(sample_counts[:2]):
            sample = flat[:, start:start + length]
            # every token of a sample alone is real (Qwen3-Omni's positions index a mask it needs given)
            if "attention_mask" in inspect.signature(rope_index).parameters:
                kwargs["attention_mask"] = torch.ones_like(sample)
            positions.append(rope_index(sample, **_audio_lengths(kwargs))[0])
        else:  # text (audio's positions are text's), or a sequence's padding: one plain position on all three axes
            positions.append(torch.arange(length, device=flat.device).expand(3, 1, -1))
        start += length
    return torch.cat([text[None, None], torch.cat(positions, dim=-1)]).reshape(4, *shape)


def _audio_lengths(kwargs: dict) -> dict:
    """The Qwen Omni thinkers' `get_rope_index` takes a sample's clips as their frame counts (`audio_seqlens`)."""
    mask = feature_mask(kwargs)
    kwargs = {name: value for name, value in kwargs.items() if name not in FEATURE_MASKS}
    return kwargs | ({"audio_seqlens": mask.sum(-1)} if mask is not None else {})
