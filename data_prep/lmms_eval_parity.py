"""Write what lmms-eval itself gives on the embedded benchmark documents: each task's prompts, per-document scores
and aggregated numbers for fixed answers (tests/fixtures/lmms_eval_parity.json, which tests/test_benchmarks.py
compares mmrecipes.benchmarks against).

    pip install --no-deps --target /tmp/lmms lmms-eval==0.7.3 loguru pytz tenacity evaluate sacrebleu portalocker \
        tabulate colorama lxml aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist
    PYTHONPATH=/tmp/lmms python data_prep/lmms_eval_parity.py

lmms-eval runs end to end (`simple_evaluate`, its task YAML, filters, `process_results` and aggregations) with a
model that gives fixed answers and each task's data read from data/benchmarks/ instead of the hub. It installs beside
this repository's packages only with `--no-deps` into a folder of its own: its requirements pin `av<16` (the video
decoding here runs av 18) and add 52 packages (a pinned wandb, pre-commit, yt-dlp), so the tests read this file.
"""

import json
import os
import tempfile
from pathlib import Path

import datasets
from lmms_eval import evaluator
from lmms_eval.api.model import lmms
from lmms_eval.api.task import ConfigurableTask
from lmms_eval.tasks import TaskManager

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "benchmarks"
OUTPUT = ROOT / "tests" / "fixtures" / "lmms_eval_parity.json"
TASKS = ["mmstar", "chartqa", "docvqa_val", "infovqa_val", "ai2d", "scienceqa_img", "ocrbench", "textvqa_val"]
# answers the documents get in turn, from each document's right and a wrong answer: the forms each parser must read,
# and some it must not
FORMS = {
    "mmstar": ["{right}", "({right})", "The answer is {right}.", "{right_lower}", "", "  {right} ", "{right} cat",
               "I choose {wrong} because", "None", "{right}: blue", "Answer: {right}", "{wrong}) square"],
    "chartqa": ["{right}", "{right}.05", "{right}00%", "two", " {right}", "{right} ", "{wrong}", "{right}.0",
                "{right}%", "{wrong}.0", "0", "{right}.2"],
    "docvqa_val": ["{right}", "{right_title} ", "{right_prefix}", "{wrong}", "", "{right}d", "the {right} one",
                   "{right_upper}", "  {right}", "{right_typo}", "{wrong_title}", "x"],
    "ai2d": ["{right}.", "{right_lower}", "{right}) foo", "{right} cat", "{wrong_lower}", "{right}. square",
             " {right}.", "({right})", "{right}", "{right_lower}.", "", "{wrong}", "{wrong_lower}."],
    "scienceqa_img": ["{right}", "{right_lower}", "{right}. a shape", "({right})", "{wrong}.", " {right} ",
                      "{wrong_lower}", "{right}) x", "The answer is {right}", "", "{right}.", "{wrong}"],
    "ocrbench": ["{right}", "it is {right}", "{right_upper}", "{wrong}", "", "{right_prefix}", "{right} shape",
                 "Ｒ{right}", "{right}\nshape", "x", " {right} ", "{right_title}"],
    "textvqa_val": ["{right}", "a {right}", "The {right}.", "{right_upper}!", "", "{wrong}", "{right} one",
                    "({right})", "{right}-ish", "two", "{right}\n", "an {right}"],
}
FORMS["infovqa_val"] = FORMS["docvqa_val"]


def right_and_wrong(task: str, doc: dict) -> tuple[str, str]:
    if task == "mmstar":
        return doc["answer"], "ABCD"[("ABCD".index(doc["answer"]) + 1) % 4]
    if task == "chartqa":
        return doc["answer"], str(int(doc["answer"]) + 1)
    if task == "ai2d":
        return "ABCD"[int(doc["answer"])], "ABCD"[(int(doc["answer"]) + 1) % 4]
    if task == "scienceqa_img":
        return "ABCD"[doc["answer"]], "ABCD"[(doc["answer"] + 1) % len(doc["choices"])]
    if task == "ocrbench":
        return doc["answer"][0], "purple"
    if task == "textvqa_val":
        return doc["answers"][0], doc["answers"][-1]
    return doc["answers"][0], "purple"


def fixed_answer(task: str, doc: dict, doc_id: int) -> str:
    right, wrong = right_and_wrong(task, doc)
    form = FORMS[task][doc_id % len(FORMS[task])]
    return form.format(right=right, wrong=wrong, right_lower=right.lower(), wrong_lower=wrong.lower(),
                       right_title=right.title(), wrong_title=wrong.title(), right_upper=right.upper(),
                       right_prefix=right[:2], right_typo=right[:-1] + "x")


class FixedAnswers(lmms):
    """Answers each document with its form of `FORMS` (its doc_id's turn)."""

    def generate_until(self, requests):
        return [fixed_answer(request.task_name, documents(request.task_name)[int(request.doc_id)], int(request.doc_id))
                for request in requests]

    def loglikelihood(self, requests):
        raise NotImplementedError

    def generate_until_multi_round(self, requests):
        raise NotImplementedError


def documents(task: str):
    return datasets.load_dataset("parquet", data_files=str(DATA / task / "*.parquet"), split="train")


def local_download(self, dataset_kwargs=None):
    """The embedded documents instead of the hub's, under the task's test split."""
    docs = documents(self.config.task)
    self.dataset = self.dataset_no_image = datasets.DatasetDict({self.config.test_split: docs})


def main():
    ConfigurableTask.download = local_download
    # its reentrant-lock patch reads filelock 3's private module; filelock 4 here has none, and one process needs none
    evaluator._enable_reentrant_filelocks = lambda: None
    with tempfile.TemporaryDirectory() as scratch:  # its aggregations write files (OCRBench's) where they run
        os.chdir(scratch)
        results = evaluator.simple_evaluate(model=FixedAnswers(), tasks=TASKS, task_manager=TaskManager(),
                                            log_samples=True, bootstrap_iters=0)
        os.chdir(ROOT)
    fixture = {"lmms_eval": "0.7.3", "tasks": {}}
    for task in TASKS:
        samples = sorted(results["samples"][task], key=lambda sample: int(sample["doc_id"]))
        # "<metric>,<filter>": each metric after the task's filter ("none", or AI2D's "flexible-extract")
        numbers = {name.split(",")[0]: value for name, value in results["results"][task].items()
                   if "," in name and "_stderr" not in name and isinstance(value, (int, float))}
        fixture["tasks"][task] = {
            "documents": [{"doc_id": int(sample["doc_id"]), "prompt": sample["arguments"][0],
                           "answer": sample["resps"][0][0], "filtered": sample["filtered_resps"][0],
                           "scores": {name: sample[name] for name in numbers if name in sample}}
                          for sample in samples],
            "numbers": numbers,
        }
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(json.dumps(fixture, indent=1, ensure_ascii=False, default=str) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
