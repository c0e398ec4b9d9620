"""The vision tower's work shared over a sequence-parallel group (mmrecipes.vlm.parallel.vision) against one process
running the whole batch.

- In process, on 2 gloo ranks: batches of 1 to 4 images, of different sizes, and a text-only one (the dummy), for a
  grid family (Qwen2.5-VL, whose clips split by frame too: an 8-frame clip alone), one with deepstack features
  (Qwen3-VL), a Gated DeltaNet one (Qwen3.5), and one image a row (Llava; LLaVA-NeXT's anyres patches, Mistral 3's
  padded pixels, Gemma 4's patch sequences, each with its sizes or positions): the loss and every gradient as one
  process gives them, each rank encoding its share of the pixels (a rank without an image encodes one again,
  unused). Qwen3.5's head-parallel layers are split so even when their forward was dropped after the split was
  built, as transformers 5.25's `kernels` drop it on train().
- README's table of packing, sequence parallelism and the tower's share per family against the checks on each tiny
  family; the balance; a tower that gives other than one item an image stopping every rank at once.
"""

import pytest
import torch
import torch.distributed as dist
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from gloo import averaged_difference, run_on_ranks, taken_gradients
from helpers import tiny
from launch import REPO
from mmrecipes.images import to_device
from mmrecipes.vlm.arguments import VideoArgs
from mmrecipes.vlm.model.families import dummy_image_inputs, video_path
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.module_groups import apply_train_modules
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.parts import check_packing
from mmrecipes.vlm.model.segments import apply_segment_aware_mixers
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.parallel import vision
from mmrecipes.vlm.parallel.sequence_parallel import SequenceParallel, refusal
from mmrecipes.vlm.rows.chat_data import encode_row
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.videos import decode_video

SHARED = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "llava_next", "mistral3", "gemma4"]
GRID_FAMILIES = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_think", "qwen3_5_moe"}


def _row(labeller, images=(), videos=(), answer="red"):
    content = ([{"type": "image"}] * len(images) + [{"type": "video"}] * len(videos)
               + [{"type": "text", "text": "What colour?"}])
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text",
                                                                                        "text": answer}]}]
    input_ids, labels, media_inputs = encode_row(labeller, messages, list(images), list(videos))
    return {"input_ids": input_ids, "labels": labels, "media_inputs": media_inputs}


def clip_bytes(frames=8) -> bytes:
    """An 8-frame clip, encoded once for both ranks (libx264's bytes can differ between encodes in one process)."""
    from make_videos import encode_clip, moving_shape

    return encode_clip([frame.resize((32, 32)) for frame in moving_shape("right", "red", "circle", frames=frames)])


def _clip(encoded, frames=8):
    video, problem = decode_video(encoded, VideoArgs(video_fps=1000.0, video_max_frames=frames))
    assert problem is None, problem
    return video


def _shared_against_whole(rank, world_size, directories, clip):
    """{family: [(whole loss, split loss, largest gradient difference relative to the largest gradient, the pixels
    this rank's tower encoded over the batch's) per batch]}."""
    results = {}
    images = [Image.new("RGB", (side, side), colour) for side, colour in ((32, "red"), (48, "blue"), (64, "green"))]
    for family, directory in directories.items():
        torch.manual_seed(0)
        model, processor, groups = tiny(directory)
        apply_train_modules(groups, "all")
        labeller = AnswerLabeller(processor, stop_token_ids(model, processor), videos=video_path(model, processor))
        collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
        rows = [[_row(labeller, images), _row(labeller, images[:1]), _row(labeller)],  # 4 images, a text row
                [_row(labeller, images[1:2]), _row(labeller)],  # 1 image: a rank without one
                [_row(labeller)]]  # text only: the dummy
        if family in GRID_FAMILIES:
            rows.append([_row(labeller, videos=[_clip(clip)], answer="right")])  # 8 frames, one clip
        split = SequenceParallel(model, 2, processor)
        assert split.vision is not None, split.vision_line
        for layer, _ in split.head_parallel:  # as transformers 5.25's `kernels` do on train(): each split puts it back
            del layer.forward
        whole_step, split_step = VLMForTraining(model), VLMForTraining(model, split)
        encoded = []
        encoder = model.get_image_features
        model.get_image_features = lambda **inputs: encoded.append(inputs["pixel_values"].shape[0]) or encoder(
            **inputs)
        results[family] = []
        for batch in (to_device(collator(batch_rows), "cpu") for batch_rows in rows):
            model.zero_grad()
            whole = whole_step(batch, LossSum()).summed
            whole.backward()
            truth = taken_gradients(model)
            encoded.clear()
            summed = split_step(batch, LossSum()).summed
            summed.backward()
            worst = averaged_difference(model, truth, world_size)
            all_pixels = sum(len(batch[name]) for name in ("pixel_values", "pixel_values_videos") if name in batch)
            results[family].append((whole.item(), summed.item(), worst, encoded[0], all_pixels))
    return results


def test_each_rank_encodes_its_share_and_the_step_equals_one_process(tiny_vlms):
    directories = {family: tiny_vlms[family] if family != "llava" else None for family in SHARED}
    ranks = run_on_ranks(_shared_against_whole, 2, directories, clip_bytes())
    for family in SHARED:
        for batch, results in enumerate(zip(*(rank[family] for rank in ranks))):
            (whole, summed, worst, _, all_pixels) = results[0]
            assert summed == pytest.approx(whole, rel=1e-5) and worst < 1e-5, (family, batch, results)
            if batch in (0, 3):  # several images, or a clip's frames: each rank encoded a part of the pixels
                shares = [result[3] for result in results]
                assert sum(shares) == all_pixels and max(shares) < all_pixels, (family, batch, shares)


README_FAMILIES = {"Llava-1.5": ["llava"], "LLaVA-NeXT": ["llava_next"], "LLaVA-OneVision": ["llava_onevision"],
                   "Qwen2-VL, Qwen2.5-VL, Qwen3-VL": ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"],
                   "Qwen3-VL-MoE": ["qwen3_vl_moe"],
                   "Qwen3.5, Qwen3.5-MoE": ["qwen3_5", "qwen3_5_think", "qwen3_5_moe"],
                   "InternVL3": ["internvl3"], "Idefics2, SmolVLM (Idefics3)": ["idefics2", "idefics3"],
                   "Mistral 3.1": ["mistral3"], "Gemma 3": ["gemma3"], "Gemma 4 (E2B, E4B)": ["gemma4"],
                   "Gemma 4 26B-A4B": ["gemma4_moe"]}


def test_the_readme_table_says_what_the_checks_decide(tiny_vlms):
    """README's table of `--packing`, `--sequence_parallel_size` and the tower's share, row by row, against the checks
    on each family's tiny model (`check_packing`, `sequence_parallel.refusal`, `VisionShare.of`): the checks decide,
    not a name (the processor makes the probe images, as the recipes pass it). Idefics' and LLaVA-OneVision's rows
    of several images run whole on every rank, the log line saying why; the balance puts the largest first, each on
    the least loaded rank."""
    table = (REPO / "README.md").read_text().split("| family | `--packing` |")[1].split("\n\n")[0]
    rows = {cells[0]: cells[1:] for line in table.splitlines()[2:]
            for cells in [[cell.strip() for cell in line.strip("|").split("|")]]}
    assert set(rows) == set(README_FAMILIES)
    for name, families in README_FAMILIES.items():
        packing, split, tower = rows[name]
        for family in families:
            model = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])
            processor = AutoProcessor.from_pretrained(tiny_vlms[family])
            labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
            apply_segment_aware_mixers(model)  # as vlm_parts does: the check must not rest on an earlier test's patch
            try:
                check_packing(model, labeller, dummy_image_inputs(model, processor))
                packs = True
            except ValueError:
                packs = False
            assert packs == packing.startswith("yes"), (name, family, packing)
            assert (refusal(model, 2) is None) == split.startswith("yes"), (name, family, split)
            share, line = vision.VisionShare.of(model, None, 2, 0, processor)
            assert (share is None) == tower.startswith("whole"), (name, family, line)
            assert share is None or share.frames == ("frames" in tower), (name, family)
            if family in ("idefics3", "llava_onevision"):  # a row of pixels holds several images
                assert "its inputs are not one image (or tile) a row" in line
    assert vision.owners([5, 1, 4, 4, 2], 2) == [0, 0, 1, 1, 0]  # 5, 4 and 4, then 2 and 1 to the lighter: 8 and 8
    assert vision.owners([3], 2) == [0]  # rank 1 has none


def _items_mismatch(rank, world_size):
    share = vision.VisionShare(dist.group.WORLD, world_size, rank, frames=False)
    inputs = {"pixel_values": torch.ones(3, 3, 4, 4)}

    def encoder(pixel_values, return_dict):  # rank 1's tower drops an image, as Idefics3 drops padding images
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        kept = pixel_values[:len(pixel_values) - rank]
        return BaseModelOutputWithPooling(pooler_output=[image.flatten()[None] for image in kept])

    try:
        share.encode(encoder, inputs)
    except RuntimeError as error:
        return str(error)
    return None


def test_a_tower_giving_other_than_an_item_an_image_stops_every_rank():
    messages = run_on_ranks(_items_mismatch, 2)
    assert all("gave other than one feature item per image" in message for message in messages), messages
