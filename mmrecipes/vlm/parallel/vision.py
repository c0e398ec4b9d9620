"""The vision tower's work shared over a sequence-parallel group ("vision data parallelism").

The ranks of a group hold the same rows. Instead of each running the tower on all of the group's
images, each encodes a share of them: whole images, and a clip's frames where the tower encodes each
frame alone (Qwen's grid families), spread over the ranks by patch count (the largest first, each to
the least loaded rank). Their features are gathered over the group (torch's differentiable
all-gather: its backward sums each rank's gradients into the features' owner, as each rank's loss
reaches the image tokens of its shard), so every rank merges the whole batch's features as before. A
rank left without an image encodes the smallest one again and uses none of it (its features enter
the loss as an exact zero, as a text-only batch's dummy does): every rank runs the tower and the
same collectives.

Whether a family's tower splits so is checked, not assumed (`VisionShare.of`): two random images
encoded together must give what each gives alone, and, for a grid family, a two-frame clip what its
frames give alone. A tower that fails the check (or whose inputs are not laid out by image) runs
whole on every rank, as before, and the log says so.
"""

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as collectives

from ..model.families import ENCODER_ONLY_OUTPUTS, dummy_image_inputs

GRID = "image_grid_thw"  # Qwen's patch grids: one row (frames, height, width) per image or clip
# inputs that say a row of the pixels holds several images (Idefics' tiles per row, LLaVA-OneVision's images per row)
ROWS_OF_SEVERAL = ("pixel_attention_mask", "batch_num_images")


@dataclass(frozen=True)
class Unit:
    """One image, clip or frame of a batch: its `item` (image or clip), its rows of the pixels (of
    every input, where the inputs have one row per image), its grid row (grid families) and its
    patches (the balance's cost)."""

    item: int
    rows: slice
    grid: torch.Tensor | None
    patches: int


def split_units(inputs: dict, frames: bool) -> list[Unit]:
    """The units of `get_image_features` inputs: a grid family's images, or their frames where
    `frames`; otherwise each row of the inputs (one image each)."""
    if GRID in inputs:
        units, start = [], 0
        for item, (t, h, w) in enumerate(inputs[GRID].tolist()):
            if frames:
                units += [Unit(item, slice(start + f * h * w, start + (f + 1) * h * w),
                               inputs[GRID].new_tensor([[1, h, w]]), h * w) for f in range(t)]
            else:
                units.append(Unit(item, slice(start, start + t * h * w), inputs[GRID][item:item + 1], t * h * w))
            start += t * h * w
        return units
    pixels = inputs["pixel_values"]
    if set(ROWS_OF_SEVERAL) & set(inputs) or any(len(value) != len(pixels) for value in inputs.values()
                                                  if torch.is_tensor(value)):
        raise ValueError("its inputs are not one image (or tile) a row")
    return [Unit(item, slice(item, item + 1), None, pixels[item].numel()) for item in range(len(pixels))]


def take(inputs: dict, units: list[Unit]) -> dict:
    """The inputs of `units` alone, in their order."""
    taken = {name: torch.cat([value[unit.rows] for unit in units]) for name, value in inputs.items()
             if torch.is_tensor(value) and name != GRID}
    if GRID in inputs:
        taken[GRID] = torch.cat([unit.grid for unit in units])
    return taken


def owners(costs: list[int], size: int) -> list[int]:
    """The rank of each unit: the largest first, each to the least loaded rank (the lowest of
    equals)."""
    loads, owner = [0] * size, [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda index: -costs[index]):
        owner[index] = min(range(size), key=lambda rank: loads[rank])
        loads[owner[index]] += costs[index]
    return owner


def streams(output) -> dict:
    """The features the language model takes, per unit: {(field, layer or None): list of per-unit
    tensors}, and each field's container (tuple, list or a tensor with a row per unit) to build the
    output again."""
    found, kinds = {}, {}
    for name, value in output.items():
        if name in ENCODER_ONLY_OUTPUTS or value is None:
            continue
        # Qwen3-VL's deepstack
        layered = isinstance(value, list) and value and isinstance(value[0], (list, tuple))
        for layer, part in enumerate(value) if layered else [(None, value)]:
            found[name, layer] = list(part)
        kinds[name] = ("layers" if layered else "") + type(value[0] if layered else value).__name__
    return found, kinds


def build(output_type, kinds: dict, items: dict):
    """An output of `output_type` from per-item tensors {(field, layer): [tensor per item]}."""
    def container(kind, parts):
        return torch.stack(parts) if kind.endswith("Tensor") else (tuple(parts) if "tuple" in kind else parts)

    fields = {}
    for (name, layer), parts in items.items():
        if layer is None:
            fields[name] = container(kinds[name], parts)
        else:
            fields.setdefault(name, []).append(container(kinds[name], parts))
    return output_type(**fields)


class VisionShare:
    """Each rank of a sequence-parallel `group` (`size` ranks, this one `rank`) encodes a share of
    the group's images (and frames, where `frames`), and every rank gets the whole batch's
    features."""

    def __init__(self, group, size: int, rank: int, frames: bool):
        self.group, self.size, self.rank, self.frames = group, size, rank, frames

    @classmethod
    @torch.no_grad()
    def of(cls, model, group, size: int, rank: int, processor=None) -> tuple["VisionShare | None", str]:
        """The share for `model`'s tower, or None where its tower does not split by image; and the
        log line. The processor makes the probe images where the model's config alone cannot."""
        try:
            # not a clip of its own video path
            takes = inspect.signature(model.get_image_features).parameters
            inputs = {name: value for name, value in dummy_image_inputs(model, processor).items() if name in takes}
            generator = torch.Generator().manual_seed(0)
            pixels = inputs["pixel_values"]
            two = [inputs | {"pixel_values": torch.randint(0, 256, pixels.shape, generator=generator).to(pixels.dtype)
                             if not pixels.is_floating_point() else torch.rand(pixels.shape, generator=generator)}
                   for _ in range(2)]
            both = {name: torch.cat([one[name] for one in two]) for name in inputs}
            training = model.training
            model.eval()  # no dropout between the encodings compared
            try:
                whole = streams(model.get_image_features(**both, return_dict=True))[0]
                units = split_units(both, frames=False)
                alone = [streams(model.get_image_features(**take(both, [unit]), return_dict=True))[0] for unit in units]
                same = len(units) == 2 and all(_close(whole[key][index], part[key][0]) for key in whole
                                               for index, part in enumerate(alone))
                frames = same and GRID in inputs and _frames_alone(model, two, whole)
            finally:
                model.train(training)
        except (ValueError, TypeError, RuntimeError, KeyError, IndexError) as error:
            same, why = False, f" ({error})"
        else:
            why = " (two images encoded together differ from each alone)"
        if not same:
            return None, f"the vision step runs on every rank of a group: its tower does not split by image{why}"
        return cls(group, size, rank, frames), ("the vision tower's work shared over the group: each rank encodes a "
                                                f"share of its images{' and frames' if frames else ''}, balanced by "
                                                "patches, the features gathered")

    def encode(self, encoder, inputs: dict):
        """(`encoder(**inputs)`'s output for the whole batch, gathered over the group; the features
        this rank encoded without using them, or None): the encoder runs on this rank's units
        only."""
        units = split_units(inputs, self.frames)
        owner = owners([unit.patches for unit in units], self.size)
        per_rank = [[index for index, rank in enumerate(owner) if rank == other] for other in range(self.size)]
        mine = per_rank[self.rank]
        spare = not mine
        # a rank without an image encodes the smallest again: the same tower and collectives as the
        # others
        if spare:
            mine = [min(range(len(units)), key=lambda index: units[index].patches)]
        encoded = encoder(**take(inputs, [units[index] for index in mine]), return_dict=True)
        local, kinds = streams(encoded)
        # every unit's rows in each stream, from the rank that encoded it, and the ranks whose tower gave other than
        # one item a unit (checked on every rank at once: none is left waiting in the gather)
        rows = torch.zeros(len(local), len(units) + 1, dtype=torch.long, device=inputs["pixel_values"].device)
        for stream, parts in enumerate(local.values()):
            if len(parts) != len(mine):
                rows[stream, -1] = 1
            elif not spare:
                rows[stream, mine] = rows.new_tensor([len(part) for part in parts])
        dist.all_reduce(rows, group=self.group)
        rows = rows.tolist()  # the only host read: the gathered rows' split
        if any(stream[-1] for stream in rows):
            raise RuntimeError("sequence parallel: the vision tower gave other than one feature item per image it "
                               "was given on some rank of the group; its work cannot be shared by image")
        items = {}
        for stream, (key, parts) in enumerate(local.items()):
            counts = rows[stream]
            most = max(sum(counts[index] for index in held) for held in per_rank)
            mine_rows = torch.cat(parts)[:0] if spare else torch.cat(parts)
            padded = torch.nn.functional.pad(mine_rows, (0, 0) * (mine_rows.dim() - 1) + (0, most - len(mine_rows)))
            gathered = collectives.all_gather_single_autograd(padded, 0, self.group).split(most)
            by_unit = [None] * len(units)
            for block, held in zip(gathered, per_rank):
                sizes = [counts[index] for index in held]
                for index, part in zip(held, block[:sum(sizes)].split(sizes)):
                    by_unit[index] = part
            items[key] = [torch.cat([by_unit[index] for index, unit in enumerate(units) if unit.item == item])
                          for item in range(units[-1].item + 1)]
        return build(type(encoded), kinds, items), encoded if spare else None


def _close(one: torch.Tensor, other: torch.Tensor) -> bool:
    return one.shape == other.shape and torch.allclose(one, other, rtol=1e-4, atol=1e-5)


def _frames_alone(model, two: list[dict], whole: dict) -> bool:
    """Whether a two-frame clip of the two images gives what the images give alone, frame by
    frame."""
    grid = two[0][GRID].clone()
    grid[:, 0] = 2
    clip = streams(model.get_image_features(pixel_values=torch.cat([one["pixel_values"] for one in two]),
                                            image_grid_thw=grid, return_dict=True))[0]
    return all(_close(clip[key][0], torch.cat(whole[key])) for key in whole)
