"""A user's own data the first time: one small file per public conversation layout, with images referenced as
users do (relative to the data file, relative to --image_folder, in nested folders), trains every row; a stream
that loses its rows says which reason, with an example row and what to change."""

import importlib.util
import json
import logging
import re

import pytest
from PIL import Image

from launch import QUICK, REPO, VLM_RECIPE, _in_process, run_recipe
from mmrecipes.config import parse_args
from mmrecipes.distributed import Ranks
from mmrecipes.skips import DropCounter, Skip, no_rows_error
from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.rows.chat_data import CHAT_COUNTED, build_chat_dataloader
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller


@pytest.fixture(scope="module")
def llava():
    model, processor = load_vlm(VLMModelArgs())
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    return processor, labeller, ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model))


def loader_of(labeller, collator, data_file, **flags):
    args = ChatDataArgs(dataset_name="json", data_files=str(data_file), dataset_weights=None, max_length=256,
                        **flags)
    return build_chat_dataloader(args, labeller, collator, batch_size=64, ranks=Ranks(), shuffle_seed=0)


def image(path, colour):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 40), colour).save(path)


def write(path, rows, lines=True):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(map(json.dumps, rows)) if lines else json.dumps(rows))
    return path


def layouts(root):
    """{layout: (data file, flags, rows, answers)}: the schemas of public datasets, paths as their users write them."""
    image(root / "trl" / "images" / "red.png", (200, 0, 0))
    image(root / "sharegpt" / "media" / "nested" / "deep" / "blue.png", (0, 0, 200))
    image(root / "lf" / "imgs" / "a.png", (0, 200, 0))
    image(root / "lf" / "imgs" / "b.png", (200, 200, 0))
    image(root / "llava_images" / "coco" / "c.png", (0, 200, 200))
    user = [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]
    trl = [{"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
            "images": ["images/red.png"]},
           {"messages": [{"role": "user", "content": [{"type": "text", "text": "Opposite of up?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "down"}]}], "images": []}]
    sharegpt = [{"messages": [{"role": "user", "content": "<image>What colour is the square?"},
                              {"role": "assistant", "content": "blue"}],
                 "images": ["media/nested/deep/blue.png"]}]
    llama_factory = [
        {"conversations": [{"from": "human", "value": "<image><image>Which colours are shown?"},
                           {"from": "gpt", "value": "green and yellow"}], "images": ["imgs/a.png", "imgs/b.png"]},
        {"conversations": [{"role": "user", "content": "<image>What colour is the square?"},
                           {"role": "assistant", "content": "green"}], "images": ["imgs/a.png"]},
    ]
    llava = [
        {"id": "one", "image": "coco/c.png",
         "conversations": [{"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "cyan"}]},
        {"id": "list", "image": ["coco/c.png"],
         "conversations": [{"from": "human", "value": "<image>\nAnd now?"}, {"from": "gpt", "value": "cyan"}]},
    ]
    return {
        "trl": (write(root / "trl" / "train.jsonl", trl), {}, 2, ["red<|end|>", "down<|end|>"]),
        "sharegpt": (write(root / "sharegpt" / "train.json", sharegpt, lines=False), {}, 1, ["blue<|end|>"]),
        "llama_factory": (write(root / "lf" / "data.json", llama_factory, lines=False), {}, 2,
                          ["green and yellow<|end|>", "green<|end|>"]),
        "llava": (write(root / "llava" / "llava.json", llava, lines=False),
                  {"image_folder": str(root / "llava_images")}, 2, ["cyan<|end|>", "cyan<|end|>"]),
    }


def test_every_public_layout_trains_every_row_with_paths_as_users_write_them(llava, tmp_path):
    """Launched from the checkout (the working directory), not the data's folder: before, `messages` rows read their
    paths from the working directory and LLaMA-Factory's `images` was not read, so these lost every image row."""
    processor, labeller, collator = llava
    for layout, (data_file, flags, rows, expected) in layouts(tmp_path).items():
        (batch,) = list(loader_of(labeller, collator, data_file, **flags))
        counts = {name: count for name, count in zip(CHAT_COUNTED, batch["data_counts"].tolist()) if count}
        assert counts == {} and len(batch["input_ids"]) == rows, (layout, counts)
        answers = [processor.tokenizer.decode(row[row != IGNORE_INDEX]) for row in batch["labels"]]
        assert sorted(answers) == sorted(expected), layout
        image_tokens = (batch["input_ids"] == processor.tokenizer.convert_tokens_to_ids(processor.image_token)).sum()
        assert image_tokens == 16 * {"trl": 1, "sharegpt": 1, "llama_factory": 3, "llava": 2}[layout]  # 16 each


def test_llava_video_paths_resolve_against_the_data_file(tiny_vlms, tmp_path):
    """LLaVA-Video rows whose clip path is relative to the JSON file, on a family with a video path (Qwen2.5-VL)."""
    from test_video_training import clip_rows, load

    _, _, labeller, dummy = load(tiny_vlms["qwen2_5_vl"])
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "move.mp4").write_bytes(clip_rows(1)[0]["videos"][0]["bytes"])
    rows = [{"conversations": [{"from": "human", "value": "<video>\nWhich way does it move?"},
                               {"from": "gpt", "value": "up"}], "video": "clips/move.mp4"}]
    (batch,) = list(loader_of(labeller, ChatCollator(0, dummy), write(tmp_path / "video.json", rows)))
    assert not batch["data_counts"].any() and len(batch["video_grid_thw"]) == 1


def explained(loader) -> str:
    assert list(loader) == []  # every row skipped
    return str(no_rows_error(loader, 1, True))


def test_an_empty_stream_says_why_with_an_example_and_the_fix(llava, tmp_path):
    """Each cause that drops every row: the error names the reason, the row, what was tried and what to change."""
    _, labeller, collator = llava
    turn = [{"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "red"}]
    wrong_folder = write(tmp_path / "llava.json", [{"id": "r1", "image": "red.png", "conversations": turn}])
    message = explained(loader_of(labeller, collator, wrong_folder, image_folder=str(tmp_path / "elsewhere")))
    assert "1 of 1 rows read were skipped" in message and "undecodable: 1" in message
    assert f"row 'r1' of {wrong_folder}" in message and "red.png (no such file)" in message
    assert "relative to --image_folder" in message

    outside = write(tmp_path / "abs.json", [{"image": "/etc/hostname", "conversations": turn}])
    message = explained(loader_of(labeller, collator, outside))
    assert "outside_folder: 1" in message and f"outside {tmp_path}" in message
    assert "--allow_images_outside_folder true" in message

    unknown = write(tmp_path / "unknown.json", [{"conversations": [{"speaker": "user", "text": "Hi"}]}])
    message = explained(loader_of(labeller, collator, unknown))
    assert "bad_row: 1" in message and "keys ['speaker', 'text']" in message and "from/value" in message

    video = write(tmp_path / "video.json", [{"conversations": [{"from": "human", "value": "<video>\nWhere?"},
                                                               {"from": "gpt", "value": "up"}], "video": "a.mp4"}])
    message = explained(loader_of(labeller, collator, video))
    assert "video: 1" in message and "takes no video" in message and "video processor" in message
    with pytest.raises(ValueError, match="'messages' .* or 'conversations'"):  # no conversation column at all
        loader_of(labeller, collator, write(tmp_path / "alpaca.json", [{"instruction": "Hi", "output": "Hello"}]))


def test_more_than_half_skipped_is_warned_once_with_the_report(caplog):
    drops = DropCounter(warn_after=10)
    with caplog.at_level(logging.WARNING, logger="mmrecipes.skips"):
        for index in range(30):
            drops.drop(Skip("too_long", "300 tokens, over 256"), f"row {index}") if index % 3 else drops.keep()
    (record,) = caplog.records
    assert "more than half of the first 10 rows" in record.getMessage() and "too_long: 6" in record.getMessage()
    assert "e.g. row 1, 300 tokens, over 256" in record.getMessage() and "raise --max_length" in record.getMessage()


SHORT = ["--max_steps", 2, "--logging_steps", 1, "--eval_steps", 2, "--per_device_train_batch_size", 2]
VLM_ARGS = [*SHORT, "--eval_generation_rows", 0]


@pytest.mark.launch
def test_own_data_is_never_evaluated_on_the_embedded_set_and_configs_run_from_anywhere(tmp_path, monkeypatch):
    """A run on the user's rows with no evaluation flags says evaluation is off in its first lines, logs no
    evaluation, and its model card says what was (not) evaluated; before, it reported the embedded questions'
    accuracy as the model's. The shipped YAML runs from another directory (it named data/ relative to the
    working directory), and DPO evaluates held-out pairs from --eval_data_files (it crashed looking for the
    embedded questions under those files' name)."""
    rows = layouts(tmp_path / "data")
    result = run_recipe(*VLM_ARGS, "--dataset_name", "json", "--data_files", rows["llama_factory"][0],
                        "--output_dir", tmp_path / "own", recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert "evaluation: --eval_dataset_name is off: you train on your own data" in result.log
    assert "eval step" not in result.log and "answer_accuracy" not in result.log
    card = (tmp_path / "own" / "README.md").read_text()
    assert "- evaluated: --eval_dataset_name is off" in card and "answer_accuracy" not in card
    assert "datasets:" not in card.split("---")[1]  # the builder 'json' is not a hub dataset

    monkeypatch.chdir(tmp_path)
    yaml_first = [str(REPO / "recipes" / "configs" / "vlm_tiny.yaml"), *QUICK, *map(str, VLM_ARGS)]
    result = _in_process(VLM_RECIPE, [*yaml_first, "--output_dir", str(tmp_path / "yaml")])
    assert result.returncode == 0, result.log[-3000:]
    assert "(the embedded held-out set, beside the embedded training data)" in result.log
    assert re.search(r"eval step 2 \| answer_accuracy [\d.]+", result.log)

    pair = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
            "images": ["images/red.png"]}
    pairs = write(tmp_path / "data" / "trl" / "pairs.jsonl", [pair] * 4)
    result = run_recipe(*SHORT, "--dataset_name", "json", "--data_files", pairs, "--eval_data_files", pairs,
                        "--output_dir", tmp_path / "dpo", recipe=REPO / "recipes" / "vlm_dpo.py")
    assert result.returncode == 0, result.log[-3000:]
    assert "--eval_dataset_name json (files" in result.log and "--eval_questions is off" in result.log
    assert re.search(r"eval step 2 \| eval_rewards/accuracies [\d.]+", result.log)
    assert "answer_accuracy" not in result.log


def test_off_words_mean_the_same_on_the_command_line_and_in_yaml(tmp_path):
    spec = importlib.util.spec_from_file_location("vlm_finetune", VLM_RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)

    (tmp_path / "off.yaml").write_text("eval_dataset_name: None\nmax_tokens_per_batch: none\ndataset_weights: ''\n")
    for argv in (["--eval_dataset_name", "None", "--max_tokens_per_batch", "none", "--dataset_weights", ""],
                 [str(tmp_path / "off.yaml")]):
        data_args = parse_args(recipe.ARGUMENTS, argv)[3]
        assert (data_args.eval_dataset_name, data_args.max_tokens_per_batch, data_args.dataset_weights) == (None,) * 3
        assert data_args.evaluation == "--eval_dataset_name is off"
