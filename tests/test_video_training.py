"""Video conversations through labels, collation, the one tower call and packing, in process, on the tiny
Qwen2.5-VL (its real processor and video processor, its official chat template): the answer tokens are exactly
the answers, the frames reach the loss in their order, a packed video row gives the logits it gives alone, and
bad clips are counted. The engines (DDP at batch 1 beside text-only ranks, FSDP2 and ZeRO-3 against DDP) run in
test_vlm_family_runs.py."""

import json

import datasets
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from launch import REPO
from mmrecipes.chat_collate import DummyImageCollator, chat_model_inputs
from mmrecipes.chat_data import CHAT_COUNTED, ChatDataArgs, build_chat_dataloader, encode_row
from mmrecipes.chat_labels import AnswerLabeller
from mmrecipes.losses import IGNORE_INDEX
from mmrecipes.videos import DecodedVideo, VideoArgs, decode_video
from mmrecipes.vlm import VLMForTraining, VLMModelArgs, load_vlm, stop_token_ids
from mmrecipes.vlm_families import dummy_image_inputs, trains_videos

VIDEO_CHAT = REPO / "data" / "vlm_shapes" / "video_chat"


@pytest.fixture(scope="module")
def qwen(tiny_vlms):
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms["qwen2_5_vl"])
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen2_5_vl"])
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor), videos=trains_videos(model, processor))
    dummy = dummy_image_inputs(model, processor)
    return model, processor, labeller, dummy


def clip_rows(count):
    rows = datasets.load_dataset("parquet", data_files=str(VIDEO_CHAT / "train-*.parquet"), split="train")
    return [rows[index] for index in range(count)]


def video_row(labeller, row, reverse=False):
    video, problem = decode_video(row["videos"][0], VideoArgs())
    assert problem is None
    if reverse:
        video = DecodedVideo(video.frames[::-1].copy(), video.metadata)
    messages = [{"role": m["role"], "content": [{"type": p["type"]} if p["type"] == "video" else p
                                                for p in m["content"]]} for m in row["messages"]]
    input_ids, labels, inputs = encode_row(labeller, messages, [], [video])
    return {"input_ids": input_ids, "labels": labels, "image_inputs": inputs} | dict.fromkeys(CHAT_COUNTED, 0)


def text_row(labeller, question, answer):
    messages = [{"role": "user", "content": [{"type": "text", "text": question}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    input_ids, labels, inputs = encode_row(labeller, messages, [])
    return {"input_ids": input_ids, "labels": labels, "image_inputs": inputs} | dict.fromkeys(CHAT_COUNTED, 0)


def test_which_families_train_on_video(tiny_vlms, qwen):
    """The probe, from behaviour: Qwen2.5-VL's video features are its image features of the same patches;
    LLaVA-OneVision pools frames after the tower (its video rows are counted, not trained); the tiny Llava has
    no video processor."""
    assert qwen[2].video_token_id == qwen[1].tokenizer.convert_tokens_to_ids("<|video_pad|>")
    onevision = AutoModelForImageTextToText.from_pretrained(tiny_vlms["llava_onevision"])
    assert not trains_videos(onevision, AutoProcessor.from_pretrained(tiny_vlms["llava_onevision"]))
    assert not trains_videos(*load_vlm(VLMModelArgs()))


def test_the_answer_tokens_of_a_video_conversation_are_exactly_the_answer(qwen):
    model, processor, labeller, _ = qwen
    row = clip_rows(1)[0]
    encoded = video_row(labeller, row)
    ids, labels = encoded["input_ids"], encoded["labels"]
    answer = row["messages"][1]["content"][0]["text"]
    assert processor.tokenizer.decode(labels[labels != IGNORE_INDEX]) == f"{answer}<|im_end|>"
    video_tokens = int((ids == labeller.video_token_id).sum())
    grid = encoded["image_inputs"]["video_grid_thw"]
    assert video_tokens == int(grid.prod()) // 4 > 0 and grid[0, 0] == 2  # 4 frames: 2 temporal patches
    assert encoded["image_inputs"]["second_per_grid_ts"].tolist() == [1.0]  # 2 frames a patch at 2 per second


def losses_of(model, dummy, rows, packing=False):
    step = VLMForTraining(model)
    batch = DummyImageCollator(0, dummy, packing=packing)(rows)
    return step(**chat_model_inputs(batch, "cpu"), return_logits=True)


@torch.no_grad()
def test_the_frames_reach_the_loss_in_their_order(qwen):
    """Reversing a clip's frames changes the loss (the old failure, a video read as its placeholder text or not
    at all, gives the same loss either way); the video batch runs one tower call and no dummy."""
    model, _, labeller, dummy = qwen
    row = clip_rows(1)[0]
    forward, again, backward = (losses_of(model, dummy, [video_row(labeller, row, reverse)])[0]
                                for reverse in (False, False, True))
    assert torch.equal(forward, again) and (forward - backward).abs() > 1e-4, (forward, backward)
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    try:
        batch = DummyImageCollator(0, dummy)([video_row(labeller, row)])
        assert batch["dummy_image"] and "pixel_values_videos" in batch
        VLMForTraining(model)(**chat_model_inputs(batch, "cpu"))
    finally:
        hook.remove()
    assert calls == [1]


@torch.no_grad()
def test_a_packed_video_row_gives_the_logits_it_gives_alone(qwen):
    """mRoPE's temporal axis per video, restarted per sample: a video row packed between a text row and another
    video row gives its own logits."""
    model, _, labeller, dummy = qwen
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
    loader = build_chat_dataloader(args, labeller, DummyImageCollator(0, dummy), batch_size=8, data_rank=0,
                                   data_world=1)
    (batch,) = list(loader)
    counts = {name: count for name, count in zip(CHAT_COUNTED, batch["data_counts"].tolist()) if count}
    assert counts == {"undecodable": 4, "video_mismatch": 1}, counts
    assert len(batch["input_ids"]) == 1 and len(batch["video_grid_thw"]) == 1 and batch["dummy_image"]
    # Over --video_max_seconds (the 2-second clip at 1): counted, read from the header before decoding.
    text = {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "hello"}]}
    (tmp_path / "long.jsonl").write_text("\n".join(map(json.dumps, [rows[-1], text])))
    short = ChatDataArgs(dataset_name="json", data_files=str(tmp_path / "long.jsonl"), dataset_weights=None,
                         video_folder=str(tmp_path), dataloader_num_workers=0, video_max_seconds=1.0)
    (batch,) = list(build_chat_dataloader(short, labeller, DummyImageCollator(0, dummy), batch_size=8, data_rank=0,
                                          data_world=1))
    assert batch["data_counts"][CHAT_COUNTED.index("video_too_long")] == 1 and "pixel_values_videos" not in batch
