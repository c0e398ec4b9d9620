"""Hostile inputs, round six, in process (one test on 2 gloo ranks, one on 2 processes of a script): benchmark
documents of another form than the task's, benchmark data that is empty, mistyped, a FIFO or too long for the model,
the saved-model command given what is no saved model, a resume under another learning rate, TRL's tool-calling rows,
tools and environments that block, flood, return what cannot be shown or raise what is no Exception, and a rank that
ends inside a reward. Each case failed raw, hung or scored silently before (the tests name what it did)."""

import os
import re
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from gloo import run_on_ranks
from helpers import documents, ended_by_the_watchdog, hostile_benchmarks, ranks_of_a_script, write_task
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
                          stops=stop_token_ids(model, processor), placeholders=placeholder_token_ids(model, processor),
                          audio_window=None)
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


def test_a_tool_that_manages_sigalrm_itself_ends_the_process_naming_it():
    """It ignored SIGALRM, cancelled the timer and blocked: --tool_timeout and the 30 s watchdog (raised from the
    same timer) never fired, and SIGTERM waited for it too. A watchdog thread ends the process STUCK_S past the
    limit."""
    # the guard `ToolBox.run` puts around every call, in a process that imports no torch (seconds, not tens)
    stderr = ended_by_the_watchdog([
        "from tools_for_tests import sandboxed",
        "with user_code.time_limit(0.5, 'tool sandboxed', '--tool_timeout', user_code.ToolTimeout):",
        "    sandboxed(60)"])
    assert re.search(r"tool sandboxed ran \d s past --tool_timeout 0.5 s, catching every timeout raised in it: "
                     "ending the process", stderr), stderr


def test_async_tools_are_awaited_and_hostile_results_fail_their_call_only():
    """An `async def` tool failed every call ("gave a coroutine"); a 0 x 0 image (ZeroDivisionError in the
    processor), text holding the image placeholder ("Found 1 <image> tokens ... but no images"), a CancelledError
    (a BaseException) and JSON nested 5000 deep (RecursionError) crashed the run. A 16-bit image came out 99.5% white
    and a transparent one black: tool images now decode as training images do. Ctrl-C still ends the run."""
    import numpy as np

    from mmrecipes.images import decode_image
    from mmrecipes.vlm.algorithms.tools import ToolBox
    from test_grpo_tools import setup
    from tools_for_tests import doubled, hostile

    def interrupted() -> str:
        """Interrupted."""
        raise KeyboardInterrupt

    box = ToolBox([doubled, hostile, interrupted], timeout=5, placeholders=("<image>", "<|image_pad|>"))
    assert box.run("doubled", {"a": 3}) == [{"type": "text", "text": "6"}]
    said = {kind: box.run("hostile", {"kind": kind})[0]["text"] for kind in ("empty", "placeholder", "cancelled")}
    assert box.failures == {"hostile/image": 1, "hostile/placeholder": 1, "hostile/raised": 1}, box.failures
    assert "does not decode (undecodable" in said["empty"] and "placeholder '<image>'" in said["placeholder"]
    assert "CancelledError: the task was cancelled" in said["cancelled"]
    for kind, grey in (("deep", 1000 // 257), ("transparent", 255)):  # 16-bit values scaled; a white background
        image = box.run("hostile", {"kind": kind})[0]["image"]
        expected, _ = decode_image(hostile(kind)[0]["image"], 10**8)
        assert np.array_equal(np.asarray(image), np.asarray(expected)) and image.mode == "RGB"
        assert abs(np.asarray(image).astype(float).mean() - grey) <= 1, (kind, np.asarray(image).mean())
    with pytest.raises(KeyboardInterrupt):
        box.run("interrupted", {})
    _, processor, sampler, prompt = setup()
    deep = processor.tokenizer("<tool_call>" + '{"a": ' * 5000 + "1" + "}" * 5000 + "</tool_call>",
                               add_special_tokens=False)["input_ids"]
    message, calls = sampler.tools.format.parse(deep, prompt["input_ids"].tolist())
    assert calls[0][0] is None and "RecursionError" in calls[0][1] and "tool_calls" not in message


def test_a_huge_tool_result_ends_its_completion_without_being_tokenised(monkeypatch):
    """10 MB of text was tokenised whole (155 s), outside any time limit, before it was found too long."""
    from mmrecipes.vlm.algorithms.tools import ToolBox, ToolFormat
    from test_grpo_tools import calling_turn, setup
    from tools_for_tests import hostile

    step, processor, sampler, prompt = setup()
    sampler.tools.box = ToolBox([hostile], timeout=5)
    call = '<tool_call>\n{"name": "hostile", "arguments": {"kind": "huge"}}\n</tool_call>'
    trajectory = calling_turn(processor, sampler, prompt, call=call)
    rendered = []
    monkeypatch.setattr(ToolFormat, "suffix", lambda self, results: rendered.append(results))
    started = time.monotonic()
    sampler.tools.tool_turns(sampler.drawing(step, True, prompt), [trajectory])
    assert not rendered and not trajectory.pending and time.monotonic() - started < 10


def test_environments_are_timed_and_their_observations_held_to_the_prompt_length():
    """A reset that blocked hung the run silently; a reset returning 100 KB of text made a 100,279-token prompt that
    was still sampling after 7 minutes. Each is a counted failure of that completion's environment."""
    from mmrecipes.vlm.algorithms.tools import Tools
    from mmrecipes.vlm.arguments import GRPOArgs
    from test_grpo_tools import qwen3_vl, setup

    _, _, _, prompt = setup()
    model, processor, stops = qwen3_vl()
    started = time.monotonic()
    blocking = Tools.of(GRPOArgs(environment_factory="tools_for_tests:BlockingEnv", tool_timeout=0.5), processor,
                        stops)
    assert blocking.environment(prompt) == (None, prompt) and time.monotonic() - started < 10
    flooding = Tools.of(GRPOArgs(environment_factory="tools_for_tests:FloodingEnv", max_completion_length=200),
                        processor, stops, max_length=1024)
    assert flooding.environment(prompt) == (None, prompt)
    said = []
    blocking.take_counts(say=said.append)
    flooding.take_counts(say=said.append)
    assert said[0].startswith("tool calls failed (reset/EnvironmentTimeout) on rank 0: the environment's reset: "
                              "EnvironmentTimeout: an environment's construction and reset ran past --tool_timeout")
    assert said[1].startswith("tool calls failed (reset/PromptTooLong) on rank 0: the environment's reset: "
                              "PromptTooLong: its observation's 100,000 characters cannot fit a prompt of 824 tokens")


def test_tool_imports_names_and_flags_are_checked_before_the_first_step(tmp_path, monkeypatch, capsys):
    """A tool module whose import blocked was neither timed nor named; `a=mod:Class` (TRL's dict of one entry) gave
    `KeyError: None`; two tools of one name, a tool and an environment method of one name, or a name given twice
    shadowed each other silently; --max_tool_calling_iterations and --tool_timeout without tools did nothing."""
    from mmrecipes.vlm.algorithms.tools import Tools, environment_factories, load_tools
    from mmrecipes.vlm.arguments import GRPOArgs
    from test_grpo_tools import qwen3_vl, setup

    (tmp_path / "blocking_tool.py").write_text("import time\ntime.sleep(120)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"importing blocking_tool \(--tools blocking_tool:f\) ran past --tool_timeout "
                                         "1 s: its module blocks while it is imported"):
        load_tools("blocking_tool:f", 1)
    assert time.monotonic() - started < 10
    assert "importing blocking_tool (--tools blocking_tool:f)" in capsys.readouterr().out  # said before it blocked
    with pytest.raises(ValueError, match="--tools .*: more than one tool named multiply"):
        load_tools("tools_for_tests:multiply,tools_for_tests:multiply")
    with pytest.raises(ValueError, match="--environment_factory: a named twice"):
        environment_factories("a=tools_for_tests:CounterEnv,a=tools_for_tests:ObservedCounterEnv")
    _, _, _, prompt = setup()
    _, processor, stops = qwen3_vl()
    with pytest.raises(ValueError, match="ShadowingEnv has a method named multiply, as a tool is"):
        Tools.of(GRPOArgs(tools="tools_for_tests:multiply", environment_factory="tools_for_tests:ShadowingEnv"),
                 processor, stops)
    for factory in ("a=tools_for_tests:CounterEnv", "tools_for_tests:make_counter"):
        tools = Tools.of(GRPOArgs(environment_factory=factory), processor, stops)
        environment, _ = tools.environment(prompt)
        assert type(environment).__name__ == "CounterEnv" and Tools.prompt_settings(tools)["tools"]
    for flag in ({"max_tool_calling_iterations": 2}, {"tool_timeout": 5.0}):
        with pytest.raises(ValueError, match=f"--{next(iter(flag))} without --tools or --environment_factory"):
            GRPOArgs(**flag)


def _tool_failing_on_rank_1(rank, world_size):
    from accelerate import PartialState

    from mmrecipes.vlm.algorithms.tools import ToolBox, Tools
    from tools_for_tests import broken

    state = PartialState(cpu=True)
    tools = Tools(None, ToolBox([broken], timeout=5), {}, {None: []}, None, None)
    if rank == 1:
        tools.box.run("broken", {"kind": "raise"})
    said = []
    counts = tools.take_counts(SimpleNamespace(process_index=state.process_index, num_processes=2,
                                               print=said.append))
    return said, counts


def test_a_tool_failing_on_another_rank_is_said_with_its_reason():
    """Said as "on another rank", the reason lost (rewards gathered theirs since round five; tools did not)."""
    (said, counts), (_, failed) = run_on_ranks(_tool_failing_on_rank_1, 2)
    assert said == ["tool calls failed (broken/raised) on rank 1: RuntimeError: the tool broke"]
    assert counts == {"tool_calls": 0, "tool_failures": 0} and failed == {"tool_calls": 1, "tool_failures": 1}


def test_a_rank_ended_inside_a_reward_is_named_by_the_rank_that_loses_it():
    """`os._exit` in a reward on rank 1 ended rank 0 with gloo's "Connection reset by peer" alone, the reward
    unnamed."""
    rank_0, rank_1 = ranks_of_a_script([
        "import os, torch, torch.distributed as dist",
        "from mmrecipes.vlm.algorithms.rewards import RewardScorer",
        "dist.init_process_group('gloo')",
        "def ends_on_rank_1(prompts, completions, **columns):",
        "    if dist.get_rank() == 1:",
        "        os._exit(0)",
        "    return [1.0] * len(completions)",
        "scores = RewardScorer({'ends_on_rank_1': ends_on_rank_1}, [1.0])(['2 + 2?'], ['4'], [[19]], {})",
        "dist.all_reduce(scores)  # the recipe's next collective"])
    assert rank_1.returncode == 0 and rank_0.returncode == 1, rank_0.stderr
    assert ("rank 1 ended without a word while it ran user code: reward function ends_on_rank_1 (os._exit or a "
            "crash in native code ends a process before any guard can speak") in rank_0.stderr, rank_0.stderr
