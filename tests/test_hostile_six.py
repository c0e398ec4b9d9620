"""Hostile inputs, round six, in process: benchmark documents of another form than the task's, benchmark data that is
empty, mistyped, a FIFO or too long for the model, the saved-model command given what is no saved model, and a
resume under another learning rate. Each case failed raw, hung or scored silently otherwise before (the tests name
what it did)."""

import os
import re
import shutil
import time

import pytest
import torch

from helpers import documents, hostile_benchmarks, write_task
from launch import REPO, load_recipe
from mmrecipes.benchmarks.arguments import BenchmarkArgs
from mmrecipes.benchmarks.harness import Benchmarks
from mmrecipes.vlm.arguments import VLMModelArgs


def test_documents_of_another_form_are_counted_and_named_never_raised(tmp_path):
    said = []
    args = BenchmarkArgs(benchmarks=hostile_benchmarks(tmp_path), benchmark_data_dir=str(tmp_path))
    scores = Benchmarks(args, say=said.append).run(lambda request, _: "B")
    assert scores["bench/mmmu_val/documents"] == 0 and scores["bench/mmmu_val/missing_image_1"] == 12
    assert not [name for name in scores if name.startswith("bench/mmmu_val/mmmu_acc")]  # no number over nothing
    assert scores["bench/ai2d/unscorable"] == 13 and scores["bench/ai2d/documents"] == 0
    assert scores["bench/mmbench_en_dev_static/unscorable"] == 1
    assert scores["bench/mmbench_en_dev_static/documents"] == 11
    assert "bench/mmbench_en_dev_static/gpt_eval_score" in scores
    assert "benchmark mmmu_val: no document was scored (missing_image_1 12): no numbers" in said
    assert any(re.fullmatch(r"benchmark ai2d: 13 documents could not be scored \(unscorable\), left out of its "
                            r"numbers: document 0: ValueError: invalid literal for int\(\) .*'[A-D]'; document 1: .*",
                            line) for line in said), said
    assert any("benchmark mmbench_en_dev_static: 1 documents could not be scored (unscorable), left out of its "
               "numbers: document 0: ValueError: invalid literal for int() with base 10: 'q0'" in line
               for line in said), said


def test_benchmark_data_of_the_wrong_type_or_form_is_refused_before_the_first_step(tmp_path):
    """DocVQA answers as a string scored ANLS 1.0 for "B" (`list("blue")` holds "b"); AI2D options as a string
    listed their characters; a parquet without a row gave a raw DatasetGenerationError; a task named twice was
    answered twice."""
    docvqa = documents("docvqa_val")
    write_task(tmp_path, "docvqa_val", [doc | {"answers": doc["answers"][0]} for doc in docvqa])
    with pytest.raises(ValueError, match=r"--benchmarks docvqa_val: its answers column holds Value\('string'\), not "
                                         "a list"):
        Benchmarks(BenchmarkArgs(benchmarks="docvqa_val", benchmark_data_dir=str(tmp_path)))
    write_task(tmp_path, "ai2d", [doc | {"options": ", ".join(doc["options"])} for doc in documents("ai2d")])
    with pytest.raises(ValueError, match="--benchmarks ai2d: its options column holds .*, not a list"):
        Benchmarks(BenchmarkArgs(benchmarks="ai2d", benchmark_data_dir=str(tmp_path)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "chartqa").mkdir()
    pq.write_table(pa.table({}), tmp_path / "chartqa" / "test.parquet")
    with pytest.raises(ValueError, match=r"--benchmarks chartqa: no document to score \(DatasetGenerationError"):
        Benchmarks(BenchmarkArgs(benchmarks="chartqa", benchmark_data_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="--benchmarks: ai2d named twice; each task is answered once"):
        BenchmarkArgs(benchmarks="ai2d,chartqa,ai2d")


def test_a_fifo_image_and_a_question_longer_than_the_model_are_skipped_not_waited_for(tmp_path):
    """A FIFO as an image path blocked the harness forever (PIL opened it); a 1 MB question was decoded whole by
    the tiny model (512 positions) and never ended. Now `undecodable_image` and `too_long`, counted, and the filler
    keeps the ranks in step."""
    from types import SimpleNamespace

    from helpers import tiny
    from mmrecipes.vlm.model.evaluation import BenchmarkAnswers
    from mmrecipes.vlm.model.families import dummy_image_inputs, placeholder_token_ids
    from mmrecipes.vlm.model.loading import stop_token_ids
    from mmrecipes.vlm.model.step import VLMForTraining

    chartqa = documents("chartqa")
    fifo = tmp_path / "image.fifo"
    os.mkfifo(fifo)
    chartqa[0]["image"] = {"bytes": None, "path": str(fifo)}
    chartqa[1]["question"] = "What is this? " * 20_000  # 280 KB
    write_task(tmp_path, "chartqa", chartqa[:4])
    model, processor, _ = tiny()
    vlm = SimpleNamespace(model=model, processor=processor, dummy_inputs=dummy_image_inputs(model, processor),
                          stops=stop_token_ids(model, processor), placeholders=placeholder_token_ids(model, processor))
    started = time.monotonic()
    args = BenchmarkArgs(benchmarks="chartqa", benchmark_data_dir=str(tmp_path), benchmark_max_new_tokens=2)
    scores = Benchmarks(args).run(BenchmarkAnswers(VLMForTraining(model), vlm, "cpu"))
    assert scores["bench/chartqa/undecodable_image"] == 1 and scores["bench/chartqa/too_long"] == 1
    assert scores["bench/chartqa/documents"] == 2 and time.monotonic() - started < 60


def test_the_saved_model_command_names_a_checkpoint_and_an_unsafe_pickle(tmp_path):
    """It raised transformers' own errors (no config.json in a checkpoint-N; torch's weights-only traceback)."""
    from mmrecipes.benchmarks.__main__ import main
    from mmrecipes.checkpointing import MARKER

    flags = ["--benchmarks", "chartqa", "--benchmark_data_dir", "embedded:benchmarks"]
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / MARKER).write_text("{}")
    with pytest.raises(ValueError, match=f"--model {checkpoint} is a training checkpoint"):
        main(["--model", str(checkpoint), *flags])
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled"
    shutil.copytree(REPO / "data" / "tiny_sft_vlm", pickled)
    torch.save(load_file(pickled / "model.safetensors") | {"run": print}, pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=f"--model {pickled}: pytorch_model.bin is a pickle holding more than "
                                         "tensors.*save the model as safetensors"):
        main(["--model", str(pickled), *flags])


def test_a_resume_with_another_learning_rate_trains_at_it_and_says_so(tmp_path, capsys):
    """The restored scheduler and optimizer brought back the saved peak rate: a resume with --learning_rate doubled
    logged and trained at the old one, while its flags and card said the new one."""
    flags = ["--save_steps", 2, "--logging_steps", 1, "--eval_dataset_name", "", "--dataloader_num_workers", 0,
             "--per_device_train_batch_size", 4, "--max_steps", 4]
    recipe = load_recipe(REPO / "recipes" / "vlm_finetune.py")
    common = [*map(str, flags), "--report_to", "none", "--output_dir", str(tmp_path / "run")]
    recipe.main(common)
    straight = capsys.readouterr().out
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-2"
    recipe.main([*common, "--learning_rate", "2e-3", "--resume_from_checkpoint", str(checkpoint)])
    resumed = capsys.readouterr().out
    assert (f"resumed with --learning_rate 0.002 where {checkpoint} was saved with --learning_rate 0.001: the "
            "learning rate of the steps after 2 follows this run's schedule") in resumed

    def rate(log, step):
        return float(re.search(rf"step {step}/4 \|.* lr ([\d.e+-]+)", log)[1])

    assert rate(resumed, 3) == pytest.approx(2 * rate(straight, 3), rel=1e-2)


def test_an_assistant_turn_of_tool_calls_alone_trains_its_calls():
    """TRL's tool-calling rows write such a turn with `tool_calls` and no `content`: a bad_row ("content is NoneType,
    not list"), so a mix trained without every calling row (P(call) about 1e-6 after SFT). The call is a target."""
    from mmrecipes.vlm.arguments import ChatDataArgs
    from mmrecipes.vlm.model.loading import stop_token_ids
    from mmrecipes.vlm.model.parts import load_vlm
    from mmrecipes.vlm.rows.chat_data import ChatPreprocessor
    from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller

    model, processor = load_vlm(VLMModelArgs(model_name_or_path="embedded:tiny_zoom_vlm"))
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    call = {"type": "function", "function": {"name": "zoom", "arguments": {"quadrant": "top_left"}}}
    tools = [{"type": "function", "function": {"name": "zoom", "description": "Zoom into a quadrant.", "parameters": {
        "type": "object", "properties": {"quadrant": {"type": "string"}}, "required": ["quadrant"]}}}]
    for turn in ({"role": "assistant", "tool_calls": [call]}, {"role": "assistant", "content": None,
                                                                "tool_calls": [call]}):
        row = {"messages": [{"role": "user", "content": "Which shape is in the top left?"}, turn,
                            {"role": "tool", "name": "zoom", "content": "a red circle"},
                            {"role": "assistant", "content": "a red circle"}], "tools": tools}
        (input_ids, labels, _), _ = ChatPreprocessor(ChatDataArgs(), labeller, 512).example(row)
        targets = processor.tokenizer.decode(input_ids[labels != IGNORE_INDEX])
        assert '"name": "zoom"' in targets and "top_left" in targets and "a red circle" in targets, targets
