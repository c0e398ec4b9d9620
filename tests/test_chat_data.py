"""Chat data for the VLM recipe: both formats to tokens + labels, counted skips, the dummy image,
the mixture of sources on every rank."""

import itertools
import json

import pytest
import torch
from PIL import Image

from helpers import chat_row, write_chat_parquet
from mmrecipes.distributed import Ranks
from mmrecipes.images import to_device
from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.outputs import Logits, LossSum
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import CHAT_COUNTED, build_chat_dataloader
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.held_out import generation_prompts
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller


@pytest.fixture(scope="module")
def tiny():
    model, processor = load_vlm(VLMModelArgs())
    return model, processor, ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model))


def load_all(args, tiny, batch_size=64, max_batches=None, **kwargs):
    model, processor, collator = tiny
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    ranks = Ranks(kwargs.pop("rank", 0), kwargs.pop("world", 1))
    loader = build_chat_dataloader(args, labeller, collator, batch_size=batch_size, ranks=ranks, **kwargs)
    return list(itertools.islice(loader, max_batches))


def answers(batch, tokenizer):
    """The labelled text of each row, as the tokenizer decodes it."""
    return [tokenizer.decode(row[row != IGNORE_INDEX]) for row in batch["labels"]]


def test_llava_json_labels_only_assistant_turns_and_skips_are_counted(tmp_path, tiny):
    _, processor, _ = tiny
    Image.new("RGB", (40, 40), (200, 0, 0)).save(tmp_path / "red.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    turns = [{"from": "human", "value": "<image>\nWhat colour is the shape?"}, {"from": "gpt", "value": "red"},
             {"from": "human", "value": "How many shapes are there?"}, {"from": "gpt", "value": "one"}]
    rows = [
        {"id": "multi-turn", "image": "red.png", "conversations": turns},
        {"id": "missing file", "image": "nowhere.png", "conversations": turns[:2]},
        {"id": "undecodable", "image": "broken.png", "conversations": turns[:2]},
        {"id": "two placeholders, one image", "image": "red.png",
         "conversations": [{"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "no"}]},
        {"id": "too long", "image": "red.png", "conversations": turns + turns[2:] * 20},
        {"id": "nothing to learn", "conversations": [{"from": "human", "value": "Hello?"}]},
        # Drops are reported with the next kept row, so a kept row ends this finite stream.
        {"id": "text-only", "conversations": [{"from": "human", "value": "What is the opposite of above?"},
                                              {"from": "gpt", "value": "below"}]},
    ]
    (tmp_path / "llava.json").write_text(json.dumps(rows))
    args = ChatDataArgs(dataset_name="json", data_files=str(tmp_path / "llava.json"), image_folder=str(tmp_path),
                        dataset_weights=None, max_length=128)
    (batch,) = load_all(args, tiny)
    assert dict(zip(CHAT_COUNTED, batch["data_counts"].tolist())) == {
        "converted": 0, "undecodable": 2, "too_large": 0, "outside_folder": 0, "image_mismatch": 1, "too_long": 1,
        "no_target": 1, "unaligned": 0, "bad_text": 0, "bad_row": 0, "bad_shard": 0, "image": 0, "audio": 0, "video": 0,
        "no_frames": 0, "video_too_long": 0, "video_mismatch": 0, "audio_undecodable": 0, "audio_empty": 0,
        "audio_too_long": 0, "audio_mismatch": 0}
    assert answers(batch, processor.tokenizer) == ["red<|end|>one<|end|>", "below<|end|>"]
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    image_positions = batch["input_ids"] == image_token
    assert image_positions[0].sum() == 16 and not image_positions[1].any()  # (32/8)^2 patches, CLS dropped
    assert (batch["labels"][image_positions] == IGNORE_INDEX).all()
    assert batch["pixel_values"].shape == (1, 3, 32, 32) and not batch["dummy_image"]
    # right padding: the shorter row's padding is masked out and never a target
    pad = batch["attention_mask"][1] == 0
    assert pad.any() and (batch["labels"][1][pad] == IGNORE_INDEX).all()


def test_video_rows_are_counted_and_never_trained_as_text(tmp_path, tiny):
    """LLaVA-Video rows (`video` + `<video>`), chat rows with a video part and a `videos` column, and a video
    column beside a text-only conversation are skipped and counted as `video`, in training and in the held-out
    prompts; before, a `<video>` placeholder was trained on as the text it looks like."""
    _, processor, _ = tiny
    question = {"from": "human", "value": "<video>\nWhich way does the shape move?"}
    user = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which colour comes first?"}]}
    rows = [
        {"conversations": [question, {"from": "gpt", "value": "left"}], "video": "clip.mp4"},
        {"conversations": [question, {"from": "gpt", "value": "right"}]},
        {"messages": [user, {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
         "videos": ["clip.mp4"]},
        {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "hello"}], "video": "a.mp4"},
        {"conversations": [{"from": "human", "value": "What is the opposite of above?"},
                           {"from": "gpt", "value": "below"}]},
    ]
    (tmp_path / "videos.jsonl").write_text("\n".join(map(json.dumps, rows)))
    args = ChatDataArgs(dataset_name="json", data_files=str(tmp_path / "videos.jsonl"), dataset_weights=None,
                        eval_dataset_name="json", eval_data_files=str(tmp_path / "videos.jsonl"), eval_split="train")
    (batch,) = load_all(args, tiny)
    counts = dict(zip(CHAT_COUNTED, batch["data_counts"].tolist()))
    assert counts["video"] == 4 and sum(counts.values()) == 4, counts
    assert answers(batch, processor.tokenizer) == ["below<|end|>"]
    assert "video" not in processor.tokenizer.decode(batch["input_ids"][0])
    prompts = generation_prompts(args, processor, rows=8, ranks=Ranks())
    assert [held.answer for held in prompts] == ["below"]


def test_chat_format_text_only_batch_gets_the_dummy_image(tmp_path, tiny):
    model, processor, _ = tiny
    grey = Image.new("L", (20, 20), 128)  # converted to RGB and counted
    write_chat_parquet(tmp_path / "mixed.parquet", [chat_row("What colour is it?", "grey", grey),
                                                    chat_row("What comes after one?", "two"),
                                                    chat_row("What comes after two?", "three")])
    args = ChatDataArgs(dataset_name="parquet", data_files=str(tmp_path / "mixed.parquet"), dataset_weights=None)
    image_batch, text_batch = load_all(args, tiny, batch_size=1)[:2]
    assert not image_batch["dummy_image"] and image_batch["data_counts"][CHAT_COUNTED.index("converted")] == 1
    assert text_batch["dummy_image"]
    assert text_batch["pixel_values"].shape == (1, 3, 32, 32)
    assert not (text_batch["input_ids"] == processor.tokenizer.convert_tokens_to_ids(processor.image_token)).any()
    assert answers(text_batch, processor.tokenizer) == ["two<|end|>"]
    # The same forward runs on both, and on the text-only batch it equals the plain LM loss.
    wrapper = VLMForTraining(model)
    for batch in (image_batch, text_batch):
        inputs = to_device(batch, "cpu")
        assert torch.isfinite(wrapper(inputs, LossSum()).summed) and wrapper(inputs, Logits()).shape[:2] == batch[
            "input_ids"].shape
    plain = model(input_ids=text_batch["input_ids"], attention_mask=text_batch["attention_mask"]).logits
    assert torch.equal(wrapper(to_device(text_batch, "cpu"), Logits()), plain)


def test_every_rank_sees_the_weighted_mixture(tiny):
    """The embedded sources at weights 0.75/0.25: each of 2 data ranks gets about 25% text-only rows."""
    _, processor, _ = tiny
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    for rank in (0, 1):
        batches = load_all(ChatDataArgs(), tiny, batch_size=100, max_batches=10, rank=rank, world=2, shuffle_seed=0)
        rows = torch.cat([(b["input_ids"] == image_token).any(dim=1) for b in batches])
        assert len(rows) == 1000
        assert 0.20 < (~rows).float().mean().item() < 0.30, rank


def test_bad_weights_and_sources_are_rejected(tiny):
    with pytest.raises(ValueError, match="give one finite weight, 0 or more, per --dataset_name source"):
        load_all(ChatDataArgs(dataset_weights="1.0"), tiny)
    with pytest.raises(ValueError, match="--data_files goes with a single --dataset_name source"):
        load_all(ChatDataArgs(data_files="x.json"), tiny)
