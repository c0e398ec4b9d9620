"""Hostile inputs, round four, in process: an evaluation that would read no row stops the run before its first step
with the counts by reason (it ran silently never, and the model card named it); roles no chat template knows are
bad rows; a CSV's malformed line is a counted bad row; a long repetitive row is labelled in bounded time; DPO's string
prompt with an `<image>` placeholder is read; loss weights that train nothing are refused. (GRPO's rewards:
test_grpo_rewards.py; composing from the wrong parts: test_compose.py.)"""

import difflib
import json
import time

import pytest
from PIL import Image

from launch import REPO, load_recipe
from mmrecipes.skips import Skip
from mmrecipes.sources import PROBLEM, load_stream, read_files
from mmrecipes.vlm.algorithms.preference import PreferencePreprocessor
from mmrecipes.vlm.arguments import ChatDataArgs, DPOArgs, PreferenceDataArgs, VLMModelArgs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.rows import labels
from mmrecipes.vlm.rows.chat_data import ChatPreprocessor
from mmrecipes.vlm.rows.labels import AnswerLabeller

RECIPES = REPO / "recipes"
RED = Image.new("RGB", (32, 32), (220, 40, 40))


@pytest.fixture(scope="module")
def labeller():
    model, processor = load_vlm(VLMModelArgs())
    return AnswerLabeller(processor, stop_token_ids(model, processor))


def conversation(user, answer, role="assistant"):
    return {"messages": [{"role": "user", "content": user}, {"role": role, "content": answer}]}


@pytest.mark.parametrize("recipe, flags, message", [
    ("vlm_finetune.py", ["--eval_dataset_name", "json", "--eval_data_files", "{empty}"],
     "(?s)No data rank has a usable held-out row of json.*bad_shard: 1, e.g. a row of .*empty.json"),
    ("vlm_finetune.py", ["--eval_dataset_name", "json", "--eval_data_files", "{bad}"],
     "(?s)No data rank has a usable held-out row of json.*: 2 of 2 rows read were skipped.*bad_row: 2"),
    ("vlm_dpo.py", ["--eval_dataset_name", "json", "--eval_data_files", "{bad_pairs}"],
     "(?s)held-out row of json.*: 2 of 2 rows read were skipped.*bad_row: 2"),
    ("vlm_grpo.py", ["--eval_dataset_name", "json", "--eval_data_files", "{bad}"],
     "No data rank has a held-out question of json to answer by generation.*left out: bad_row 2"),
    ("vlm_distill.py", ["--eval_dataset_name", "json", "--eval_data_files", "{bad}"],
     "(?s)No data rank has a usable held-out row of json.*: 2 of 2 rows read were skipped.*bad_row: 2"),
    ("clip_pretrain.py", ["--dataset_name", "parquet", "--data_files", "{captions}", "--eval_data_files", "{bad}"],
     "(?s)No data rank has a usable held-out row of test.*bad_shard: 1"),
])
def test_an_evaluation_that_reads_no_row_stops_the_run_before_its_first_step(recipe, flags, message, tmp_path):
    """An empty JSON array or rows that are all bad: no eval line, no warning, and the model card said the run was
    evaluated on that file (SFT's teacher-forced and generated answers, DPO's pairs, GRPO's questions, CLIP's
    retrieval)."""
    files = {"empty": tmp_path / "empty.json", "bad": tmp_path / "bad.json", "bad_pairs": tmp_path / "pairs.json",
             "captions": REPO / "data" / "shapes" / "train-00000-of-00004.parquet"}
    files["empty"].write_text("[]")
    files["bad"].write_text(json.dumps([{"messages": "not a conversation", "prompt": 3, "image": 5}] * 2))
    files["bad_pairs"].write_text(json.dumps([{"prompt": 3, "chosen": "red", "rejected": "blue"}] * 2))
    flags = [flag.format(**files) for flag in flags]
    with pytest.raises(RuntimeError, match=message) as raised:
        load_recipe(RECIPES / recipe).main([*flags, "--max_steps", "2", "--report_to", "none",
                                            "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "README.md").exists(), raised.value  # no model card claims that evaluation


def test_roles_no_chat_template_knows_are_bad_rows(labeller):
    """`bot` and `ASSISTANT` before a real answer were kept and trained as context (only LLaVA's `from` was
    checked), where docs/data.md says such rows are bad_row. (`tool` turns are read: agentic conversations.)"""
    preprocess = ChatPreprocessor(ChatDataArgs(), labeller, 256)
    for role in ("bot", "ASSISTANT"):
        row = {"messages": [{"role": "user", "content": "Hi"}, {"role": role, "content": "hello"},
                            {"role": "user", "content": "What comes after one?"},
                            {"role": "assistant", "content": "two"}]}
        with pytest.raises(Skip) as skipped:
            preprocess.example(row)
        assert skipped.value.reason == "bad_row" and f"unknown role {role!r}" in skipped.value.detail
    preprocess.example(conversation("What comes after one?", "two"))  # read


def test_a_csv_line_with_the_wrong_fields_is_a_counted_bad_row(tmp_path):
    """pandas stopped the run on it with a raw ParserError that named neither the file nor the line."""
    (tmp_path / "pairs.csv").write_text('image,text\nred.png,a red square\nbad.png,one,two\n"blue.png","a, blue"\n')
    rows = list(read_files([str(tmp_path / "pairs.csv")], "csv", ["image", "text"]))
    assert [(row[PROBLEM], row["text"]) for row in rows] == [(None, "a red square"), ("bad_row", None),
                                                             (None, "a, blue")]
    stream, _ = load_stream("csv", None, "train", str(tmp_path / "pairs.csv"), ["image", "text"], data_rank=0,
                            data_world=1)
    assert [row[PROBLEM] for row in stream] == [None, "bad_row", None]


def test_a_long_repetitive_row_is_labelled_in_bounded_time(labeller, monkeypatch):
    """32,000 repetitive words (32k tokens) fit a raised --max_length 32768, and went through a sequence diff of the
    whole row, quadratic on such text: 9.8 s at 10,000 words, 102 s at 32k (bench/label_alignment.py). Now only what
    differs between the text and the processor's ids (the image's expansion) is diffed; long text between two images
    is aligned by a walk. The answer is labelled exactly either way."""
    sizes = []
    matcher = difflib.SequenceMatcher

    def counted(junk, a, b, **kwargs):
        sizes.append(len(a) * len(b))
        return matcher(junk, a, b, **kwargs)

    monkeypatch.setattr(labels.difflib, "SequenceMatcher", counted)
    preprocess = ChatPreprocessor(ChatDataArgs(max_length=32768), labeller, 32768)
    preprocess.example(conversation("<image>red square", "yes") | {"images": [RED]})  # first-call costs (15 s seen)
    text = " ".join(["red square"] * 16000)
    for content, images in (("<image>" + text, [RED]), ("<image>" + text + "<image>", [RED, RED])):
        started = time.perf_counter()
        (input_ids, target_labels, _), _ = preprocess.example(conversation(content, "yes") | {"images": images})
        seconds = time.perf_counter() - started
        assert len(input_ids) > 32000 and seconds < 5, seconds
        answer = labeller.tokenizer.decode(input_ids[target_labels != -100])
        assert answer.startswith(" yes") or answer.startswith("yes"), answer
    assert max(sizes) <= labels.MAX_DIFF_CELLS


def test_a_dpo_string_prompt_with_an_image_placeholder_is_read_and_weights_that_train_nothing_are_refused(labeller):
    """`"<image>What colour?"` with its image was dropped as bad_row with a wrong hint (GRPO's prompt alike:
    test_grpo_rewards.py); `--loss_weights 0,0` was accepted and trained nothing."""
    preprocess = PreferencePreprocessor(PreferenceDataArgs(), labeller, 256)
    rows = [{"prompt": "<image>What colour is it?", "images": [RED], "chosen": "red", "rejected": "blue"}]
    out = preprocess({key: [row[key] for row in rows] for key in rows[0]})
    assert len(out["chosen"]) == 1 and not preprocess.drops.totals
    tokens = labeller.tokenizer.convert_ids_to_tokens(out["chosen"][0]["input_ids"])
    assert tokens.count(labeller.processor.image_token) > 1 and "<image>" not in labeller.tokenizer.decode(
        out["chosen"][0]["input_ids"][out["chosen"][0]["labels"] != -100])
    with pytest.raises(ValueError, match="every loss weighs 0, so nothing would train"):
        DPOArgs(loss_type="sigmoid,sft", loss_weights="0,0")
    with pytest.raises(ValueError, match="every loss weighs 0"):
        DPOArgs(loss_type="sft", rpo_alpha=0)
