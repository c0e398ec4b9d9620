"""The built-in benchmarks (mmrecipes.benchmarks) against lmms-eval 0.7.3, and sharded over ranks.

- Parity: on the embedded documents of each task, our prompts, each answer's scores and the task's numbers equal
  what lmms-eval itself gives for the same answers (tests/fixtures/lmms_eval_parity.json, written by
  data_prep/lmms_eval_parity.py running lmms-eval end to end: it does not install beside this repository's
  packages, see that script). Where lmms-eval is importable, its own scorers are compared too.
- Documents strided over 2 gloo ranks (13 over 2: uneven) give one process's numbers; every rank answers as often.
- What cannot be scored is counted and named: an image that does not decode, a missing value, an answer the parser
  cannot read; an unknown task, a missing column or no document stops before the first step.
"""

import importlib.util
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy
import pytest

from gloo import run_on_ranks
from helpers import documents, write_task
from mmrecipes.benchmarks.arguments import BenchmarkArgs
from mmrecipes.benchmarks.harness import Benchmark, Benchmarks
from mmrecipes.benchmarks.scoring import (
    anls,
    choice_letter,
    mmbench_prefetch,
    mmmu_choice,
    mmmu_open_correct,
    mmmu_open_predictions,
    relaxed_correctness,
    transcript_words,
    without_reasoning,
    word_error_rate,
)
from mmrecipes.benchmarks.tasks import TASKS
from test_audio_rows import wav_bytes

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "lmms_eval_parity.json").read_text())
EMBEDDED = BenchmarkArgs(benchmark_data_dir="embedded:benchmarks")


def categorised(score):
    """lmms-eval's per-document score as ours: MMStar's and OCRBench's dicts as (category, score), MMBench's pair as
    (question index, score)."""
    if isinstance(score, list):
        return tuple(score)
    if isinstance(score, dict) and "score" in score:
        return score.get("l2_category", score.get("question_type")), score["score"]
    return score  # LibriSpeech's: the reference and the answer, as they are


def turn_of(bench, doc, request) -> list:
    """The request's user turn as the fixture writes lmms-eval's: text, and each image as its column."""
    columns = iter(bench.task.visuals(doc))
    return [block["text"] if block["type"] == "text" else next(columns) for block in request.messages[0]["content"]]


# a reasoning model's block before its answer, whose letters and numbers would be read as the answer if kept
REASONING = "<think>\nMaybe (A), or 12%? The answer is D.\n</think>\n\n"


@pytest.mark.parametrize("answers", ["tasks", "padded", "reasoned"])
@pytest.mark.parametrize("name", sorted(FIXTURE["tasks"]))
def test_prompts_scores_and_numbers_equal_lmms_evals(name, answers):
    """`tasks`: the answers as written; `padded`: within whitespace, which lmms-eval's pipeline strips before any
    task scores (ChartQA's "12% " and MMMU's "C\n" scored otherwise here before); `reasoned`: after a think block,
    which lmms-eval's command line takes out before any task scores (its default --reasoning_tags): the answers'
    scores (before, the block's letters were read as the answer)."""
    expected = FIXTURE["tasks" if answers == "reasoned" else answers][name]
    bench = Benchmark.load(TASKS[name], EMBEDDED, 0, 1)
    assert len(bench.docs) == len(expected["documents"])
    scored, read = [], Counter()
    for document in expected["documents"]:
        doc, request = bench.request(document["doc_id"], sampling_rate=16_000)
        assert len(request.clips) == bench.task.hears  # LibriSpeech: its clip, decoded (1 s at 16 kHz)
        assert all(len(clip) == 16_000 for clip in request.clips)
        if "turn" in document:  # MMMU's interleaved turn (lmms-eval's doc_to_messages)
            assert turn_of(bench, doc, request) == document["turn"], document
            assert len(request.images) == len(bench.task.visuals(doc))
        elif answers == "tasks":
            assert request.messages[0]["content"][-1]["text"] == document["prompt"]
        result = bench.task.read(doc, (REASONING if answers == "reasoned" else "") + document["answer"])
        theirs = {metric: categorised(score) for metric, score in document["scores"].items() if metric != "parsed"}
        if name == "mmmu_val" and not result.read:
            # no letter read: lmms-eval guesses from its process's random state, we from the document's; both are a
            # choice, and lmms-eval's numbers are compared with its guess
            assert document["scores"]["parsed"][0] in "ABCD" and result.metrics["mmmu_acc"] in (0.0, 1.0)
            scored.append(theirs)
        else:
            assert result.metrics == theirs, (name, document)  # the same arithmetic: equal to the bit
            scored.append(result.metrics)
        read[result.read] += 1
    assert bench.task.numbers(scored) == pytest.approx(expected["numbers"], rel=1e-12)
    # every answer is read
    free_form = ("chartqa", "docvqa_val", "infovqa_val", "ocrbench", "textvqa_val", "librispeech_test_clean")
    assert read[True] and (read[False] or name in free_form), read


@pytest.mark.skipif(importlib.util.find_spec("lmms_eval") is None, reason="lmms-eval is not installed here (it "
                    "pins av<16; the fixture holds its results)")
def test_the_scorers_equal_lmms_evals_own_where_it_is_installed():
    from lmms_eval.api.metrics import anls as their_anls
    from lmms_eval.tasks._task_utils.mcq_extract import extract_mcq_answer
    from lmms_eval.tasks._task_utils.vqa_eval_metric import EvalAIAnswerProcessor
    from lmms_eval.tasks.chartqa.utils import relaxed_correctness as their_relaxed

    from mmrecipes.benchmarks.vqa_answers import normalise_answer

    answers = ["A", "(b)", "the answer is C", "A and B", "", " D.", "x", "I pick B", "E", "2", "2%", "Blue", " red "]
    for answer in answers:
        assert choice_letter(answer) == extract_mcq_answer(answer)
        assert relaxed_correctness(answer, "2") == their_relaxed(answer, "2")
        assert anls(["red", "blue"], answer.strip()) == their_anls(["red", "blue"], [answer.strip()])["anls"]
        assert normalise_answer(answer) == EvalAIAnswerProcessor()(answer)
    for answer in ["Two dogs", "dont know", "1,000 people", "e.g. x. y.", "Red-blue", "it's john's", "end." * 40]:
        assert normalise_answer(answer) == EvalAIAnswerProcessor()(answer)
    # MMMU's and MMBench's parsers, on answers of every path they take
    from lmms_eval.tasks._task_utils.mmmu_mcq_utils import parse_mmmu_multi_choice_response
    from lmms_eval.tasks.mmbench.en_utils import mmbench_evaluator
    from lmms_eval.tasks.mmmu.utils import eval_open, parse_open_response

    options = ["red circle", "blue", "<image 2>", "3"]
    answers += ["(A) or (C)", "B. blue", "it is the red circle, not blue at all", "I think the blue one is it here",
                "A: red", "so the result is 3.14159\nthus 2,000", "x = 7", "The answer is 1e3.", "A B", "C)",
                "(D).", ":B", "a red circle", "A big one", "Final answer: blue", "answer is ."]
    for answer in answers:
        letter = mmmu_choice(answer, options)
        theirs = parse_mmmu_multi_choice_response(answer, list("ABCD"), dict(zip("ABCD", options)))
        assert letter == theirs or (letter is None and theirs in "ABCD"), answer  # unread: it guesses
        assert sorted(map(str, mmmu_open_predictions(answer))) == sorted(map(str, parse_open_response(answer)))
        for gold in ["2", "3.14", "blue", "a", "2000", "1,000"]:
            assert mmmu_open_correct(gold, mmmu_open_predictions(answer)) == eval_open(gold, parse_open_response(
                answer)), (answer, gold)
        choices = dict(zip("ABCD", options))
        assert mmbench_prefetch(answer, choices) == (mmbench_evaluator.can_infer(answer, dict(choices)) or "")
    # LibriSpeech's corpus WER over transcripts of every normaliser path, for English and another language
    from lmms_eval.tasks.librispeech.utils import librispeech_wer

    transcripts = ["MISTER SMITH PAID TWENTY DOLLARS", "Mr. Smith paid $20.", "<|en|>the colour , is grey !",
                   "the color is gray", "one oh one", "101", "it's", "it is", "Café [noise] (um) naïve", "", "x y"]
    for language in ("en", "fr"):
        rows = [{"gt": gt, "pred": pred, "task": f"asr_{language}"} for gt in transcripts[:-2] for pred in transcripts]
        expected = librispeech_wer(rows, None)
        assert 100 * word_error_rate([r["gt"] for r in rows], [r["pred"] for r in rows], language) == expected


def test_reasoning_is_taken_out_as_lmms_evals_command_line_takes_it_out():
    """lmms-eval's `strip_reasoning_tags` with its default tags, on closed, repeated, prefilled (only the closing
    tag: the template opened the block) and unclosed blocks; equal to its own where it is installed."""
    answers = ["<think>\nIt is red.\n</think>\n\nred", "It is red.\n</think>\n\nred", "<think>unclosed red", "red",
               "<think>a</think> B <think>b</think> C", "<analysis>x</analysis>final: 2", " </think> </think>x ",
               "<think>x</think></analysis>y"]
    expected = ["red", "red", "<think>unclosed red", "red", "B  C", "final: 2", "x", "y"]
    assert [without_reasoning(answer) for answer in answers] == expected
    if importlib.util.find_spec("lmms_eval") is not None:
        from lmms_eval.api.reasoning import strip_reasoning_tags

        tags = json.loads('[["<think>", "</think>"], ["<analysis>", "</analysis>"]]')  # its --reasoning_tags default
        assert [strip_reasoning_tags(answer, tags) for answer in answers] == expected


def test_parsers_on_the_forms_they_must_read():
    # Whisper's normalisers as lmms-eval runs them for English: numbers, currency, spellings, titles, tokens
    assert transcript_words("<|en|> Mr. Smith paid $20 for the colour grey!", "en") == [
        "mister", "smith", "paid", "20", "for", "the", "color", "gray"]
    assert transcript_words("Mr. Smith, the colour", "fr") == ["mr", "smith", "the", "colour"]
    assert word_error_rate(["the red cat", "dog"], ["the cat", "dog house"], "en") == 2 / 4
    assert word_error_rate(["one two three"], ["one three"], "en") == 1.0  # one word to it: "123"
    with pytest.raises(ValueError, match="Chinese normaliser"):
        transcript_words("你好", "zh")
    assert [choice_letter(text, "ABCD") for text in ["B", "(C)", "The answer is D.", "a", "Options A or B: B",
                                                       "A cat", "no letter"]] == ["B", "C", "D", "", "B", "A", ""]
    assert relaxed_correctness("10.4", "10") and not relaxed_correctness("10.6", "10")
    assert relaxed_correctness("5%", "0.05") and relaxed_correctness("Yes", "yes")
    assert anls(["red"], "red") == 1.0 and anls(["red"], "blue") == 0.0 and anls(["purple"], "purplx") == 1 - 1 / 6


def _sharded(rank, world_size, limit):
    """{task: numbers and counts} of the embedded tasks answered on `world_size` ranks, and how often this rank
    answered (fillers included)."""
    args = BenchmarkArgs(benchmarks="mmstar,ai2d,chartqa,mmbench_en_dev_static",
                         benchmark_data_dir="embedded:benchmarks", benchmark_limit=limit)
    benchmarks = Benchmarks(args, rank, world_size)
    calls = []

    def answer(request, max_new_tokens):  # a deterministic answer per document: the same on any rank
        calls.append(not request.filler)
        return ["A", "B", "C", "D", "2", "(A)", "x"][request.index % 7]

    return benchmarks.run(answer), calls, benchmarks.card_lines()


def test_two_ranks_give_one_process_numbers_over_uneven_documents():
    one = _sharded(0, 1, 0)
    ranks = run_on_ranks(_sharded, 2, 0)
    for scores, calls, _ in ranks:
        assert scores == one[0]
    # ai2d's 13 documents: 7 answered on rank 0, 6 and a filler on rank 1; every rank answered as often; MMBench's
    # circular copies of a question are answered on both ranks
    assert [len(calls) for _, calls, _ in ranks] == [6 + 7 + 6 + 6, 6 + 7 + 6 + 6]
    assert [sum(calls) for _, calls, _ in ranks] == [6 + 7 + 6 + 6, 6 + 6 + 6 + 6]
    assert one[0]["bench/ai2d/documents"] == 13 and one[0]["bench/mmstar/unread"] == 3  # "2", "x", "2"
    assert any(line.startswith("- ai2d (lmms-eval 0.7.3's task, version 0.0; ") for line in one[2])


def test_what_cannot_be_scored_is_counted_and_named(tmp_path):
    docs = datasets.load_dataset("parquet", data_files="data/benchmarks/chartqa/*.parquet", split="train")
    broken = docs.cast_column("image", datasets.Image(decode=False)).to_list()
    broken[0]["image"] = {"bytes": b"not an image", "path": None}
    broken[1]["answer"] = None
    (tmp_path / "chartqa").mkdir()
    datasets.Dataset.from_list(broken).to_parquet(tmp_path / "chartqa" / "test.parquet")
    args = BenchmarkArgs(benchmarks="chartqa", benchmark_data_dir=str(tmp_path))
    scores = Benchmarks(args).run(lambda request, _: "2")
    assert scores["bench/chartqa/undecodable_image"] == 1 and scores["bench/chartqa/missing_answer"] == 1
    assert scores["bench/chartqa/documents"] == 10
    with pytest.raises(ValueError, match="no built-in task nope; the tasks: mmstar, chartqa"):
        BenchmarkArgs(benchmarks="chartqa,nope").names()
    datasets.Dataset.from_list([{key: value for key, value in row.items() if key != "type"} for row in broken]
                               ).to_parquet(tmp_path / "chartqa" / "test.parquet")
    with pytest.raises(ValueError, match="--benchmarks chartqa: its documents have no type column"):
        Benchmarks(args)
    datasets.Dataset.from_list(broken).select([]).to_parquet(tmp_path / "chartqa" / "test.parquet")
    with pytest.raises(ValueError, match=r"--benchmarks chartqa: no document to score \(.*\): the benchmark"):
        Benchmarks(args)
    # MMMU: options that are no list, an image the question names but the document lacks, one that does not decode
    mmmu = datasets.load_dataset("parquet", data_files="data/benchmarks/mmmu_val/*.parquet", split="train")
    mmmu = mmmu.cast_column("image_1", datasets.Image(decode=False)).to_list()
    mmmu[0]["options"] = "['circle', 'square'"
    mmmu[1]["question"] += " And in <image 4>?"
    mmmu[5]["image_1"] = {"bytes": b"not an image", "path": None}
    (tmp_path / "mmmu_val").mkdir()
    datasets.Dataset.from_list(mmmu).to_parquet(tmp_path / "mmmu_val" / "test.parquet")
    args = BenchmarkArgs(benchmarks="mmmu_val,mmbench_en_dev_static", benchmark_data_dir=str(tmp_path))
    (tmp_path / "mmbench_en_dev_static").symlink_to(Path("data/benchmarks/mmbench_en_dev_static").resolve())
    answered = []
    scores = Benchmarks(args).run(lambda request, _: answered.append(request) or "ASSISTANT: B")
    assert [scores[f"bench/mmmu_val/{reason}"] for reason in ("unreadable_options", "missing_image_4",
                                                              "undecodable_image", "documents")] == [1, 1, 1, 9]
    assert [len(request.images) for request in answered if not request.filler][:2] == [2, 3]
    assert scores["bench/mmbench_en_dev_static/unread"] == 12  # cut at MMBench's stop, as lmms-eval: nothing left
    # LibriSpeech: a clip that does not decode, one with no sound, none; a model that does not hear is refused
    speech = documents("librispeech_test_clean")
    speech[0]["audio"] = {"bytes": b"not a clip", "path": None}
    speech[1]["audio"] = {"bytes": wav_bytes(numpy.zeros((0, 1), numpy.int16), 16_000), "path": None}
    speech[2]["audio"] = None
    write_task(tmp_path, "librispeech_test_clean", speech)
    benchmarks = Benchmarks(BenchmarkArgs(benchmarks="librispeech_test_clean", benchmark_data_dir=str(tmp_path)))

    def transcribe(request, _):
        answered.append(request)
        return "three beeps in one second"

    with pytest.raises(ValueError, match="librispeech_test_clean: its documents are audio clips, and the model does "
                                         "not hear"):
        benchmarks.evaluation(transcribe)
    with pytest.raises(ValueError, match="librispeech_test_clean: its documents are audio clips"):
        benchmarks.run(transcribe)  # (a TypeError in the clip decoder before)
    transcribe.sampling_rate = 16_000
    scores = benchmarks.run(transcribe)
    assert [scores[f"bench/librispeech_test_clean/{reason}"] for reason in (
        "audio_undecodable", "audio_empty", "missing_audio", "documents")] == [1, 1, 1, 9]
    assert [len(request.clips[0]) for request in answered[-9:]] == [16_000] * 9  # 1 s at 8 kHz, read at 16 kHz
    assert 0 < scores["bench/librispeech_test_clean/wer"] < 100


def test_a_saved_model_scores_by_generate_as_in_the_loop(tmp_path):
    """`python -m mmrecipes.benchmarks` (generate, a KV cache) and the recipes' answerer (whole-sequence forwards in
    step, `BenchmarkAnswers`) give the same greedy answers, so the same scores, on the tiny Llava (one image, and
    MMMU's several interleaved with text); the JSON holds them."""
    from helpers import tiny
    from mmrecipes.benchmarks.__main__ import main
    from mmrecipes.vlm.model.evaluation import BenchmarkAnswers
    from mmrecipes.vlm.model.families import dummy_image_inputs, placeholder_token_ids
    from mmrecipes.vlm.model.loading import stop_token_ids
    from mmrecipes.vlm.model.step import VLMForTraining

    model, processor, _ = tiny()
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    flags = ["--benchmarks", "docvqa_val,mmmu_val", "--benchmark_data_dir", "embedded:benchmarks", "--benchmark_limit",
             "4",
             "--benchmark_max_new_tokens", "6"]
    saved = main(["--model", str(tmp_path / "model"), "--output", str(tmp_path / "scores.json"), *flags])
    vlm = SimpleNamespace(model=model, processor=processor, dummy_inputs=dummy_image_inputs(model, processor),
                          stops=stop_token_ids(model, processor), placeholders=placeholder_token_ids(model, processor),
                          audio_window=None)
    args = BenchmarkArgs(benchmarks="docvqa_val,mmmu_val", benchmark_data_dir="embedded:benchmarks", benchmark_limit=4,
                         benchmark_max_new_tokens=6)
    in_the_loop = Benchmarks(args).run(BenchmarkAnswers(VLMForTraining(model), vlm, "cpu"))
    assert saved == in_the_loop == json.loads((tmp_path / "scores.json").read_text())
    # MMMU's turns interleave text and up to two images (tiny Llava's own template renders them)
    assert saved["bench/docvqa_val/documents"] == saved["bench/mmmu_val/documents"] == 4


def _lmms_eval_on_ranks(rank, world_size, data, saved=None):
    """lmms-eval's own `simple_evaluate` over the tiny Llava in memory (`LiveModel` around the recipes' answerer; or,
    given `saved`, the model saved there, as lmms-eval's command line builds it: `--model mmrecipes --model_args
    pretrained=...`) on the embedded ChartQA and AI2D documents (read locally instead of from the hub): {task: its
    numbers}."""
    import datasets as hf_datasets
    from lmms_eval import evaluator
    from lmms_eval.api.task import ConfigurableTask
    from lmms_eval.tasks import TaskManager

    from helpers import tiny
    from mmrecipes.benchmarks.lmms_eval_model import LiveModel
    from mmrecipes.vlm.model.evaluation import BenchmarkAnswers
    from mmrecipes.vlm.model.families import dummy_image_inputs, placeholder_token_ids
    from mmrecipes.vlm.model.loading import stop_token_ids
    from mmrecipes.vlm.model.step import VLMForTraining

    def local(self, dataset_kwargs=None):
        docs = hf_datasets.load_dataset("parquet", data_files=f"{data}/{self.config.task}/*.parquet", split="train")
        self.dataset = self.dataset_no_image = hf_datasets.DatasetDict({self.config.test_split: docs})

    ConfigurableTask.download = local
    evaluator._enable_reentrant_filelocks = lambda: None  # reads filelock 3's private module (filelock 4 here)
    model, processor, _ = tiny()
    vlm = SimpleNamespace(model=model, processor=processor, dummy_inputs=dummy_image_inputs(model, processor),
                          stops=stop_token_ids(model, processor), placeholders=placeholder_token_ids(model, processor),
                          audio_window=None)
    live = LiveModel(BenchmarkAnswers(VLMForTraining(model), vlm, "cpu"))
    if saved is not None:
        from lmms_eval.models import MODEL_REGISTRY_V2

        path = MODEL_REGISTRY_V2.get_manifest("mmrecipes").simple_class_path  # the entry point (pyproject.toml)
        assert path == "mmrecipes.benchmarks.lmms_eval_model.LiveModel", path
        live = LiveModel.create_from_arg_string(f"pretrained={saved}")
    results = evaluator.simple_evaluate(model=live, tasks=["chartqa", "ai2d"], limit=5, task_manager=TaskManager(),
                                        distributed_executor_backend="torchrun", bootstrap_iters=0,
                                        log_samples=False)
    return results and {task: {name: float(value) for name, value in numbers.items()  # rank 0's, as plain floats
                               if "stderr" not in name and isinstance(value, (int, float))}
                        for task, numbers in results["results"].items()}


@pytest.mark.skipif(importlib.util.find_spec("lmms_eval") is None, reason="lmms-eval is not installed here (the "
                    "[benchmarks] extra: it pins av<16)")
def test_lmms_evals_simple_evaluate_runs_the_live_model_on_two_ranks_as_on_one(tmp_path, monkeypatch):
    """The [benchmarks] extra: lmms-eval's harness on the model in memory, 5 documents of two tasks over 2 gloo ranks
    as in one process; its command line's model (the entry point, a saved model by generate) scores the same."""
    monkeypatch.chdir(tmp_path)  # its aggregations may write files where they run
    data = Path(__file__).resolve().parents[1] / "data" / "benchmarks"
    one = _lmms_eval_on_ranks(0, 1, data)
    two = run_on_ranks(_lmms_eval_on_ranks, 2, data)
    assert set(one) == {"chartqa", "ai2d"} and "relaxed_overall,none" in one["chartqa"] and two[0] == one, (one, two)
    assert "exact_match,flexible-extract" in one["ai2d"]
    from helpers import tiny

    model, processor, _ = tiny()
    model.save_pretrained(tmp_path / "saved")
    processor.save_pretrained(tmp_path / "saved")
    assert _lmms_eval_on_ranks(0, 1, data, tmp_path / "saved") == one  # by generate: the same greedy answers


@pytest.mark.skipif(importlib.util.find_spec("lmms_eval") is None, reason="lmms-eval is not installed here (the "
                    "[benchmarks] extra: it pins av<16)")
def test_lmms_evals_librispeech_hears_the_clips_the_harness_decodes(monkeypatch, tmp_path):
    """lmms-eval's own pipeline on the embedded LibriSpeech documents (its clips undecoded: datasets decodes audio
    with torchcodec, not installed) through `LiveModel`: the answerer gets the prompt and the clip `Benchmarks` gives
    it, and the WER equals ours for the same transcripts; a model that does not hear is refused, not answered
    deaf."""
    from lmms_eval import evaluator
    from lmms_eval.api.task import ConfigurableTask
    from lmms_eval.tasks import TaskManager

    from mmrecipes.benchmarks.lmms_eval_model import LiveModel

    monkeypatch.chdir(tmp_path)
    docs = datasets.Dataset.from_list(documents("librispeech_test_clean"))

    def local(self, dataset_kwargs=None):
        self.dataset = self.dataset_no_image = datasets.DatasetDict({self.config.test_split: docs})

    monkeypatch.setattr(ConfigurableTask, "download", local)
    monkeypatch.setattr(evaluator, "_enable_reentrant_filelocks", lambda: None)
    heard = {}

    def transcribe(request, _):
        heard[request.index] = (request.messages, request.clips[0].tolist())
        return ["three beeps in 1 second", "", "THE SECOND TONE"][request.index % 3]

    transcribe.sampling_rate = 16_000
    theirs = evaluator.simple_evaluate(model=LiveModel(transcribe), tasks=["librispeech_test_clean"],
                                       task_manager=TaskManager(), bootstrap_iters=0)["results"]
    ours_heard, heard = heard, {}
    ours = Benchmarks(BenchmarkArgs(benchmarks="librispeech_test_clean", benchmark_data_dir="embedded:benchmarks"))
    assert ours.run(transcribe)["bench/librispeech_test_clean/wer"] == theirs["librispeech_test_clean"]["wer,none"]
    assert heard == ours_heard and len(heard) == 12
    del transcribe.sampling_rate
    with pytest.raises(ValueError, match="a dict among the task's visuals"):
        evaluator.simple_evaluate(model=LiveModel(transcribe), tasks=["librispeech_test_clean"],
                                  task_manager=TaskManager(), bootstrap_iters=0)


@pytest.mark.skipif(None in (importlib.util.find_spec("lmms_eval"), importlib.util.find_spec("decord")),
                    reason="lmms-eval is not installed here, or decord, which its llava_hf model needs (it pins av<16)")
def test_our_answers_are_lmms_evals_own_models_answers(tmp_path):
    """bench/lmms_eval_agreement.py: lmms-eval's own Llava model class (its chat template rendering, `generate`,
    decoding) and ours answer the same text on every document, MMMU's interleaved turns included."""
    import subprocess
    import sys

    from helpers import tiny

    model, processor, _ = tiny()
    model.save_pretrained(tmp_path / "saved")
    processor.save_pretrained(tmp_path / "saved")
    run = subprocess.run([sys.executable, "bench/lmms_eval_agreement.py", "--model", str(tmp_path / "saved"),
                          "--lmms_model", "llava_hf", "--tasks", "chartqa,mmmu_val", "--data_dir",
                          "embedded:benchmarks", "--max_new_tokens", "6", "--device", "cpu"],
                         capture_output=True, text=True, check=True)
    for task in ("chartqa", "mmmu_val"):
        assert f"{task}: answers the same text 12/12" in run.stdout, run.stdout


def test_benchmark_steps_and_the_end_of_the_run_are_when_the_tasks_run():
    """--benchmark_steps K: every K optimizer steps and at the last; 0: at the last only; no task: never (as a run's
    evaluation, `reporting.Evaluation`, whatever --eval_steps; never before a step)."""
    def due(benchmarks):
        evaluation = benchmarks.evaluation(lambda request, tokens: "A")
        assert not evaluation.due(0, True, 2, 10)
        return [step for step in range(1, 11) if evaluation.due(step, False, 2, 10)]

    every_three = Benchmarks(BenchmarkArgs(benchmarks="ai2d", benchmark_data_dir="embedded:benchmarks",
                                           benchmark_steps=3))
    assert due(every_three) == [3, 6, 9, 10]
    at_the_end = Benchmarks(BenchmarkArgs(benchmarks="ai2d", benchmark_data_dir="embedded:benchmarks"))
    assert due(at_the_end) == [10]
    assert due(Benchmarks(BenchmarkArgs())) == []


def test_a_runs_evaluations_run_in_order_when_due_each_on_its_line():
    """`Report.evaluate`: the held-out evaluation every --eval_steps and at the last step (`evaluate_last`, which
    every recipe calls after its save), one at the start only before step 0's training (distillation's teacher), none
    without parts; each due one on an eval line of its own, in the order given."""
    from mmrecipes.reporting import Evaluation, Report

    lines, calls = [], []
    report = Report.__new__(Report)  # the evaluation path only: no accelerator, no window
    report.eval_steps, report.max_steps = 4, 10
    report.evaluating = lambda step: _Scores(step, lines)
    report.evaluations = [Evaluation([lambda filler: calls.append(("start", filler)) or {"teacher": 1.0}],
                                     at_start=True),
                          Evaluation([lambda filler: calls.append(("held_out", filler)) or {"answers": 0.5},
                                      lambda filler: {"generated": 0.25}]),
                          Evaluation([]), Evaluation([lambda filler: {"bench": 2.0}], every=0)]
    for step in range(10):
        report.evaluate(step, "filler", before_step=True)
        report.evaluate(step + 1, "filler")
    # the last step's wait for the save (a model error in them, out of memory in generation, cost the model)
    assert lines == [(0, {"teacher": 1.0}), (4, {"answers": 0.5, "generated": 0.25}),
                     (8, {"answers": 0.5, "generated": 0.25})]
    report.evaluate_last("filler")
    assert lines[3:] == [(10, {"answers": 0.5, "generated": 0.25}), (10, {"bench": 2.0})]
    assert calls[0] == ("start", "filler") and len(calls) == 4


class _Scores:
    def __init__(self, step, lines):
        self.step, self.lines, self.scores = step, lines, {}

    def __enter__(self):
        return self.scores

    def __exit__(self, *exc):
        self.lines.append((self.step, self.scores))


def test_the_benchmarks_line_says_what_the_prompts_are_rendered_with():
    """The answerer's --chat_template_kwargs (a think mode) are said beside the tasks, and so in the model card's
    lines."""
    said = []
    benchmarks = Benchmarks(BenchmarkArgs(benchmarks="ai2d", benchmark_data_dir="embedded:benchmarks",
                                          benchmark_limit=2))
    benchmarks.evaluation(SimpleNamespace(template_kwargs={"enable_thinking": False}), say=said.append)
    assert said[0].endswith('; prompts rendered with {"enable_thinking": false} (--chat_template_kwargs)'), said
    assert "each answer read after its reasoning" in said[0]


def test_the_saved_model_command_says_what_its_prompts_are_rendered_with(tiny_vlms, capsys):
    """`python -m mmrecipes.benchmarks --chat_template_kwargs ...` says them on its benchmarks line and each task's
    card line, as the recipes do (its line was printed before they were known)."""
    from mmrecipes.benchmarks.__main__ import main

    main(["--model", str(tiny_vlms["qwen3_5"]), "--chat_template_kwargs", '{"enable_thinking": false}', "--benchmarks",
          "ai2d", "--benchmark_data_dir", "embedded:benchmarks", "--benchmark_limit", "2",
          "--benchmark_max_new_tokens", "2"])
    lines = capsys.readouterr().out.splitlines()
    rendering = '; prompts rendered with {"enable_thinking": false} (--chat_template_kwargs)'
    said = [line for line in lines if line.startswith(("benchmarks, as lmms-eval", "- ai2d ("))]
    assert len(said) == 2 and all(line.endswith(rendering) for line in said), lines
