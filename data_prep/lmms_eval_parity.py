"""Write what lmms-eval itself gives on the embedded benchmark documents: each task's prompts, per-document scores
and aggregated numbers for fixed answers, as written and within whitespace (tests/fixtures/lmms_eval_parity.json,
which tests/test_benchmarks.py compares mmrecipes.benchmarks against).

    pip install --no-deps --target /tmp/lmms lmms-eval==0.7.3 loguru pytz tenacity evaluate sacrebleu portalocker \
        tabulate colorama lxml aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist openpyxl \
        et_xmlfile editdistance more_itertools
    PYTHONPATH=/tmp/lmms python data_prep/lmms_eval_parity.py

lmms-eval runs end to end (`simple_evaluate`, its task YAML, filters, `process_results` and aggregations) with a
model that gives fixed answers and each task's data read from data/benchmarks/ instead of the hub. It installs beside
this repository's packages only with `--no-deps` into a folder of its own: its requirements pin `av<16` (the video
decoding here runs av 18) and add 52 packages (a pinned wandb, pre-commit, yt-dlp), so the tests read this file.
"""

import ast
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
TASKS = ["mmstar", "chartqa", "docvqa_val", "infovqa_val", "ai2d", "scienceqa_img", "ocrbench", "textvqa_val",
         "mmmu_val", "mmbench_en_dev_static", "librispeech_test_clean"]
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
    "mmmu_val": ["{right}", "({right})", "The answer is {right}.", "{right_lower}", "", "{right}. because",
                 "so the answer is {wrong}", "({wrong}) or ({right})", "I would say it is the {right_text} one",
                 "x = {right}", "I think it is {right}\nso {wrong}", "{right_upper}!"],
    "mmbench_en_dev_static": ["{right}", "({right})", "The answer is {right}.", "{right_lower}", "",
                              "{right}. {right_text}", "A {right_text}", "{wrong}", "I choose the {right_text} here",
                              "{right}: {wrong}", "{right_text}", "Option {right}) is it"],
}
FORMS["infovqa_val"] = FORMS["docvqa_val"]
# transcripts: as written, in another case, as a sentence, behind a language token, digits for number words, a word
# left out, one too many, two swapped, commas between words, nothing
FORMS["librispeech_test_clean"] = ["{right}", "{right_lower}", "{right_sentence}", "<|en|> {right_lower}",
                                   "{right_digits}", "{right_dropped}", "{right} and more", "{right_swapped}",
                                   "{right_commas}", "", "{wrong}", "{right_title}!"]
DIGITS = {"ONE": "1", "TWO": "2", "THREE": "3", "FOUR": "4", "FIVE": "5", "TWENTY": "20", "FORTY": "40"}


def right_and_wrong(task: str, doc: dict) -> tuple[str, str]:
    if task == "mmmu_val" and doc["question_type"] == "multiple-choice":
        count = len(ast.literal_eval(doc["options"]))
        return doc["answer"], "ABCD"[("ABCD".index(doc["answer"]) + 1) % count]
    if task == "mmmu_val":
        return doc["answer"], "purple"
    if task == "mmbench_en_dev_static":
        letters = [letter for letter in "ABCD" if doc[letter] is not None]
        return doc["answer"], letters[(letters.index(doc["answer"]) + 1) % len(letters)]
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
    if task == "librispeech_test_clean":
        return doc["gt"], "purple"
    if task == "textvqa_val":
        return doc["answers"][0], doc["answers"][-1]
    return doc["answers"][0], "purple"


def right_text(task: str, doc: dict, right: str) -> str:
    """The text of the right option (of an open answer, the answer)."""
    if task == "mmmu_val" and doc["question_type"] == "multiple-choice":
        return ast.literal_eval(doc["options"])["ABCD".index(right)]
    return doc[right] if task == "mmbench_en_dev_static" else right


def fixed_answer(task: str, doc: dict, doc_id: int) -> str:
    right, wrong = right_and_wrong(task, doc)
    form = FORMS[task][doc_id % len(FORMS[task])]
    words = right.split()
    return form.format(right_sentence=right.capitalize() + ".", right_digits=" ".join(DIGITS.get(w, w) for w in words),
                       right_dropped=" ".join(words[1:]), right_swapped=" ".join([*words[1::-1], *words[2:]]),
                       right_commas=", ".join(words), right=right, wrong=wrong, right_lower=right.lower(),
                       wrong_lower=wrong.lower(), right_title=right.title(), wrong_title=wrong.title(),
                       right_upper=right.upper(), right_prefix=right[:2], right_typo=right[:-1] + "x",
                       right_text=right_text(task, doc, right))


class Named(str):
    """An image column's name standing for its image: lmms-eval's MMMU functions call `.convert("RGB")` on it."""

    def convert(self, mode):
        return self


def mmmu_turns() -> list:
    """lmms-eval's MMMU user turn of each document (`doc_to_messages`, default arguments), images as their column."""
    from lmms_eval.tasks.mmmu import utils

    arguments = {"prompt_type": "format", "multiple_choice_prompt": "Answer with the option's letter from the given "
                 "choices directly.", "open_ended_prompt": "Answer the question using a single word or phrase."}
    turns = []
    for doc in documents("mmmu_val"):
        named = doc | {f"image_{n}": Named(f"image_{n}") for n in range(1, 8)}
        content = utils.mmmu_doc_to_messages(named, arguments)[0]["content"]
        turns.append([block.get("text", block.get("url")) for block in content])
    return turns


def per_document(task: str, sample: dict) -> dict:
    """Each document's score as lmms-eval's own functions give it (MMMU: its evaluation of one sample; MMBench: the
    letter of its rules, else of its static extraction, right or not, with the question's index)."""
    if task == "mmmu_val":
        from lmms_eval.tasks.mmmu.utils import evaluate_mmmu

        return {"mmmu_acc": evaluate_mmmu([sample["mmmu_acc"]])[1]["acc"],
                "parsed": sample["mmmu_acc"]["parsed_pred"]}
    from lmms_eval.tasks._task_utils.mcq_extract import extract_mcq_answer
    from lmms_eval.tasks.mmbench.en_utils import mmbench_evaluator

    item = sample["gpt_eval_score"]
    letter = mmbench_evaluator.prefetch_answer(item) or extract_mcq_answer(
        item["prediction"], choices=sorted(mmbench_evaluator.build_choices(item)))
    return {"gpt_eval_score": [item["index"], float(letter == item["answer"])], "parsed": letter}


# whitespace around an answer, as models write it (a trailing space or line break): lmms-eval strips every answer
# before a task scores it
PADDINGS = ["{} ", " {}", "{}\n", "\n{} "]


class FixedAnswers(lmms):
    """Answers each document with its form of `FORMS` (its doc_id's turn), `padded`: within its `PADDINGS`."""

    def __init__(self, padded: bool = False):
        super().__init__()
        self.padded = padded

    def generate_until(self, requests):
        answers = []
        for request in requests:
            doc_id = int(request.doc_id)
            answer = fixed_answer(request.task_name, documents(request.task_name)[doc_id], doc_id)
            answers.append(PADDINGS[doc_id % len(PADDINGS)].format(answer) if self.padded else answer)
        return answers

    def loglikelihood(self, requests):
        raise NotImplementedError

    def generate_until_multi_round(self, requests):
        raise NotImplementedError


def documents(task: str):
    """The embedded documents, clips undecoded (datasets decodes audio with torchcodec, not installed here)."""
    docs = datasets.load_dataset("parquet", data_files=str(DATA / task / "*.parquet"), split="train")
    return docs.cast_column("audio", datasets.Audio(decode=False)) if "audio" in docs.column_names else docs


def local_download(self, dataset_kwargs=None):
    """The embedded documents instead of the hub's, under the task's test split."""
    docs = documents(self.config.task)
    self.dataset = self.dataset_no_image = datasets.DatasetDict({self.config.test_split: docs})


def evaluated(model: FixedAnswers) -> dict:
    """{task: each document's prompt, answer and scores, and the task's numbers} as lmms-eval gives them."""
    with tempfile.TemporaryDirectory() as scratch:  # its aggregations write files (OCRBench's) where they run
        os.chdir(scratch)
        results = evaluator.simple_evaluate(model=model, tasks=TASKS, task_manager=TaskManager(), log_samples=True,
                                            bootstrap_iters=0)
        os.chdir(ROOT)
    tasks = {}
    for task in TASKS:
        samples = sorted(results["samples"][task], key=lambda sample: int(sample["doc_id"]))
        # "<metric>,<filter>": each metric after the task's filter ("none", or AI2D's "flexible-extract")
        numbers = {name.split(",")[0]: value for name, value in results["results"][task].items()
                   if "," in name and "_stderr" not in name and isinstance(value, (int, float))}
        tasks[task] = {
            "documents": [{"doc_id": int(sample["doc_id"]), "prompt": sample["arguments"][0],
                           "answer": sample["resps"][0][0], "filtered": sample["filtered_resps"][0],
                           "scores": per_document(task, sample) if task in ("mmmu_val", "mmbench_en_dev_static")
                           else {name: sample[name] for name in numbers if name in sample}}
                          for sample in samples],
            "numbers": numbers,
        }
    return tasks


def main():
    ConfigurableTask.download = local_download
    # its reentrant-lock patch reads filelock 3's private module; filelock 4 here has none, and one process needs none
    evaluator._enable_reentrant_filelocks = lambda: None
    # the same answers as written, and within whitespace (the whole pipeline: lmms-eval strips before it scores)
    fixture = {"lmms_eval": "0.7.3", "tasks": evaluated(FixedAnswers()), "padded": evaluated(FixedAnswers(True))}
    for document, turn in zip(fixture["tasks"]["mmmu_val"]["documents"], mmmu_turns()):
        document["turn"] = turn
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(json.dumps(fixture, indent=1, ensure_ascii=False, default=str) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
