"""Video conversations through labels, collation, the vision calls and packing, in process, on the tiny
families of each video path (their real processors and video processors, their official chat templates):
Qwen2.5-VL (clips through the tower in the image call), LLaVA-OneVision (a video path of its own, a dummy clip
where a batch has none) and InternVL3 (frames as image tiles). The answer tokens are exactly the answers, clips
cross from the workers as uint8 and are finished to the processor's floats, the frames reach the loss in their
order, a packed video row gives the logits it gives alone, and bad clips are counted. The engines (DDP at batch
1 beside text-only ranks, FSDP2 and ZeRO-3 against DDP) run in test_vlm_family_runs.py."""

import json

import datasets
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from launch import REPO
from mmrecipes.distributed import Ranks
from mmrecipes.images import NORMALIZED_BY, to_device
from mmrecipes.vlm.arguments import ChatDataArgs, VideoArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs, video_path
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.losses import token_cross_entropy_sum
from mmrecipes.vlm.model.outputs import Logits, LossSum
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import CHAT_COUNTED, build_chat_dataloader, encode_row
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller
from mmrecipes.vlm.rows.videos import DecodedVideo, decode_video

VIDEO_CHAT = REPO / "data" / "vlm_shapes" / "video_chat"


PATHS = {"qwen2_5_vl": "with images", "llava_onevision": "own", "internvl3": "as images"}


def load(directory):
    model = AutoModelForImageTextToText.from_pretrained(directory)
    processor = AutoProcessor.from_pretrained(directory)
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor), videos=video_path(model, processor))
    return model, processor, labeller, dummy_image_inputs(model, processor)


@pytest.fixture(scope="module")
def qwen(tiny_vlms):
    return load(tiny_vlms["qwen2_5_vl"])


@pytest.fixture(scope="module", params=PATHS)
def family(request, tiny_vlms):
    return request.param, load(tiny_vlms[request.param])


def clip_rows(count):
    rows = datasets.load_dataset("parquet", data_files=str(VIDEO_CHAT / "train-*.parquet"), split="train")
    return [rows[index] for index in range(count)]


def video_row(labeller, row, reverse=False, max_frames=8):
    video, problem = decode_video(row["videos"][0], VideoArgs(video_max_frames=max_frames))
    assert problem is None
    if reverse:
        video = DecodedVideo(video.frames[::-1].copy(), video.metadata)
    messages = [{"role": m["role"], "content": [{"type": p["type"]} if p["type"] == "video" else p
                                                for p in m["content"]]} for m in row["messages"]]
    input_ids, labels, inputs = encode_row(labeller, messages, [], [video])
    return {"input_ids": input_ids, "labels": labels, "media_inputs": inputs}


def text_row(labeller, question, answer):
    messages = [{"role": "user", "content": [{"type": "text", "text": question}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    input_ids, labels, inputs = encode_row(labeller, messages, [])
    return {"input_ids": input_ids, "labels": labels, "media_inputs": inputs}


def test_which_families_train_on_video(tiny_vlms):
    """The probe, from behaviour: Qwen2.5-VL's video features are its image features of the same patches,
    LLaVA-OneVision's own video path fills a clip's placeholders, InternVL3's processor makes frames image tiles;
    Idefics3 and the tiny Llava have no video processor, and only an own path gets a dummy clip."""
    for name, path in PATHS.items():
        model, processor = (auto.from_pretrained(tiny_vlms[name]) for auto in (AutoModelForImageTextToText,
                                                                            AutoProcessor))
        assert video_path(model, processor) == path
        assert ("pixel_values_videos" in dummy_image_inputs(model, processor)) == (path == "own")
    idefics3 = (auto.from_pretrained(tiny_vlms["idefics3"]) for auto in (AutoModelForImageTextToText, AutoProcessor))
    assert video_path(*idefics3) is None and video_path(*load_vlm(VLMModelArgs())) is None


def test_the_answer_tokens_of_a_video_conversation_are_exactly_the_answer(family):
    name, (model, processor, labeller, _) = family
    row = clip_rows(1)[0]
    encoded = video_row(labeller, row)
    ids, labels = encoded["input_ids"], encoded["labels"]
    answer = row["messages"][1]["content"][0]["text"]
    assert processor.tokenizer.decode(labels[labels != IGNORE_INDEX]) == f"{answer}<|im_end|>"
    if name == "qwen2_5_vl":  # mRoPE's temporal axis: 4 frames make 2 temporal patches of 1 second each
        video_tokens = int((ids == labeller.video_token_id).sum())
        grid = encoded["media_inputs"]["video_grid_thw"]
        assert video_tokens == int(grid.prod()) // 4 > 0 and grid[0, 0] == 2
        assert encoded["media_inputs"]["second_per_grid_ts"].tolist() == [1.0]


@torch.no_grad()
def test_clips_leave_the_workers_as_uint8_and_are_finished_to_the_processors_own_floats(family):
    """Clips that reach the model as pixel_values_videos cross from the workers as uint8 (a quarter of float32's
    shared memory) and, rescaled and normalised on the device, equal the video processor's own floats to the bit:
    the same loss. InternVL3's frames, image tiles beside float images, stay float."""
    name, (model, processor, labeller, dummy) = family
    row = clip_rows(1)[0]
    batch = ChatCollator(0, dummy)([video_row(labeller, row)])
    if name == "internvl3":
        assert "pixel_values_videos" not in batch and NORMALIZED_BY["pixel_values_videos"] not in batch
        assert batch["pixel_values"].dtype == torch.float32
        return
    assert batch["pixel_values_videos"].dtype == torch.uint8
    video, _ = decode_video(row["videos"][0], VideoArgs())
    own = processor.video_processor(videos=[video.frames], video_metadata=[video.metadata], do_sample_frames=False,
                                    return_tensors="pt")["pixel_values_videos"]
    inputs = to_device(batch, "cpu")
    assert torch.equal(inputs["pixel_values_videos"], own)
    assert not torch.equal(batch["pixel_values_videos"].float(), own)  # the raw uint8 values are not the inputs
    step = VLMForTraining(model)
    assert torch.equal(step(inputs, LossSum()).summed, step(inputs | {"pixel_values_videos": own}, LossSum()).summed)


def losses_of(model, dummy, rows, packing=False):
    step = VLMForTraining(model)
    batch = ChatCollator(0, dummy, packing=packing)(rows)
    inputs = to_device(batch, "cpu")
    return token_cross_entropy_sum(step(inputs, Logits()), inputs["labels"]), step(inputs, Logits())


@torch.no_grad()
def test_the_frames_reach_the_loss_in_their_order(family):
    """Reversing a clip's frames changes the loss (the old failure, a video read as its placeholder text or not
    at all, gives the same loss either way)."""
    _, (model, _, labeller, dummy) = family
    row = clip_rows(1)[0]
    forward, again, backward = (losses_of(model, dummy, [video_row(labeller, row, reverse)])[0]
                                for reverse in (False, False, True))
    # The same clip gives the same loss to the bit, so any difference is the frames' order.
    assert torch.equal(forward, again) and not torch.equal(forward, backward), (forward, backward)


@pytest.mark.parametrize("name, calls", [("qwen2_5_vl", {"video": 1, "text": 1}), ("llava_onevision", {"video": 2,
                                                                                                        "text": 2})])
def test_every_batch_makes_the_same_tower_calls(tiny_vlms, name, calls):
    """A video-only batch and a text-only batch call the tower as often (the ranks' collectives match): once
    for Qwen (the dummy image and the clip in one call), twice for LLaVA-OneVision (the image path on the dummy
    image, its video path on the clip or a dummy clip), and the text batch's vision parameters get exact-zero
    gradients."""
    model, _, labeller, dummy = load(tiny_vlms[name])
    tower = model.model.visual if name == "qwen2_5_vl" else model.model.vision_tower
    batches = {"video": [video_row(labeller, clip_rows(1)[0])], "text": [text_row(labeller, "Hi?", "hello")]}
    step = VLMForTraining(model)  # built before counting: LLaVA-OneVision's clip layout probe calls the tower
    for kind, rows in batches.items():
        counted = []
        hook = tower.register_forward_hook(lambda *args: counted.append(1))
        try:
            batch = ChatCollator(0, dummy)(rows)
            model.zero_grad()
            step(to_device(batch, "cpu"), LossSum()).summed.backward()
        finally:
            hook.remove()
        assert batch["dummy_image"] and len(counted) == calls[kind], (kind, counted)
        if kind == "text":
            assert batch.get("dummy_video", False) == (name == "llava_onevision")
            grads = [p.grad for p in tower.parameters() if p.grad is not None]
            assert grads and not any(grad.any() for grad in grads)


@torch.no_grad()
@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava_onevision"])
def test_clips_of_different_lengths_in_one_batch_give_the_losses_they_give_alone(tiny_vlms, name):
    """A 4-frame and a 2-frame clip in one micro-batch give the summed losses of each row alone (rtol 1e-4). For
    LLaVA-OneVision the 2-frame clip is zero-padded to 4 frames in the one video call, and the padding frames'
    rows dropped; before, the batch raised "Video features and video tokens do not match"."""
    model, _, labeller, dummy = load(tiny_vlms[name])
    long, short = clip_rows(2)
    rows = [video_row(labeller, long), video_row(labeller, short, max_frames=2)]
    batch = ChatCollator(0, dummy)(rows)
    assert ("video_frames" in batch) == (name == "llava_onevision")
    together = losses_of(model, dummy, rows)[0]
    alone = sum(losses_of(model, dummy, [row])[0] for row in rows)
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava_onevision"])
def test_a_packed_video_row_gives_the_logits_it_gives_alone(tiny_vlms, name):
    """Positions restarted per sample (Qwen: mRoPE's temporal axis per video): a video row packed after a text
    row and before another video row gives its own logits."""
    model, _, labeller, dummy = load(tiny_vlms[name])
    rows = [text_row(labeller, "What comes after one?", "two"), *(video_row(labeller, row) for row in clip_rows(2))]
    model.eval()
    packed = losses_of(model, dummy, rows, packing=True)[1]
    alone = torch.cat([losses_of(model, dummy, [row])[1] for row in rows], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def test_bad_clips_are_counted_and_the_rest_train(qwen, tmp_path):
    """LLaVA-Video rows under --video_folder: a zero-byte file, a truncated clip, a text file, a missing file, a
    placeholder without its clip, and one clip too long are each skipped and counted; the good rows arrive."""
    _, processor, labeller, dummy = qwen
    clip = clip_rows(1)[0]["videos"][0]["bytes"]
    files = {"empty.mp4": b"", "cut.mp4": clip[:len(clip) // 2], "notes.mp4": b"not a video", "good.mp4": clip}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    question = {"from": "human", "value": "<video>\nWhich way does the shape move?"}
    rows = [{"conversations": [question, {"from": "gpt", "value": "up"}], "video": name}
            for name in ["missing.mp4", *files]]  # the good row last: the counts ride along with a kept row
    rows.insert(0, {"conversations": [question, {"from": "gpt", "value": "up"}]})
    (tmp_path / "rows.jsonl").write_text("\n".join(map(json.dumps, rows)))
    args = ChatDataArgs(dataset_name="json", data_files=str(tmp_path / "rows.jsonl"), dataset_weights=None,
                        video_folder=str(tmp_path), dataloader_num_workers=0)
    loader = build_chat_dataloader(args, labeller, ChatCollator(0, dummy), batch_size=8, ranks=Ranks())
    (batch,) = list(loader)
    counts = {name: count for name, count in zip(CHAT_COUNTED, batch["data_counts"].tolist()) if count}
    assert counts == {"undecodable": 4, "video_mismatch": 1}, counts
    assert len(batch["input_ids"]) == 1 and len(batch["video_grid_thw"]) == 1 and batch["dummy_image"]
    # Over --video_max_seconds (the 2-second clip at 1): counted, read from the header before decoding.
    text = {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "hello"}]}
    (tmp_path / "long.jsonl").write_text("\n".join(map(json.dumps, [rows[-1], text])))
    short = ChatDataArgs(dataset_name="json", data_files=str(tmp_path / "long.jsonl"), dataset_weights=None,
                         video_folder=str(tmp_path), dataloader_num_workers=0, video_max_seconds=1.0)
    (batch,) = list(build_chat_dataloader(short, labeller, ChatCollator(0, dummy), batch_size=8, ranks=Ranks()))
    assert batch["data_counts"][CHAT_COUNTED.index("video_too_long")] == 1 and "pixel_values_videos" not in batch
