"""The built-in benchmark tasks: each as lmms-eval 0.7.3 defines it (its task YAML and utils), in
one small table.

A task names the hub dataset lmms-eval reads (or local files of the same columns), the columns it
needs, its prompt (lmms-eval's `doc_to_text` with the default pre- and post-prompt), its media, how
many tokens a greedy answer may take (its `generation_kwargs`, else the 1024 of lmms-eval's Hugging
Face models), how one answer is scored (its `process_results`, or its metric after its filters) and
how the scores of the documents make the task's numbers (its aggregation). Scores equal lmms-eval's
own functions on the same documents and answers (tests/test_benchmarks.py).
"""

import ast
import math
import random
import re
import string
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from ..skips import Skip
from .scoring import (
    anls,
    choice_letter,
    exact_match,
    leading_letter,
    mmbench_prefetch,
    mmmu_choice,
    mmmu_open_correct,
    mmmu_open_predictions,
    relaxed_correctness,
    without_reasoning,
    word_error_rate,
)
from .vqa_answers import vqa_accuracy

DEFAULT_MAX_NEW_TOKENS = 1024  # lmms-eval's Hugging Face models, where a task sets none
LMMS_EVAL = "0.7.3"  # the version whose tasks these reproduce


@dataclass(frozen=True)
class Scored:
    """One answer's scores ({metric: value}; MMStar's: {metric: (l2 category, value)}) and whether
    the parser read an answer in it (an unread answer scores 0, as in lmms-eval, and is counted)."""

    metrics: dict
    read: bool = True


@dataclass(frozen=True)
class Task:
    name: str
    dataset: str  # the hub dataset lmms-eval reads
    subset: str | None
    split: str
    version: str  # the task YAML's metadata version
    columns: tuple[str, ...]  # what the prompt and the scorer read, besides the image
    prompt: Callable[[dict], str]
    score: Callable[[dict, str], Scored]
    main: str  # the metric the log line shows first
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # by default, each metric's mean over the documents
    aggregate: Callable[[list[dict]], dict] | None = None
    until: tuple[str, ...] = ()  # the answer is cut at the first of these
    image_columns: tuple[str, ...] = ("image",)  # the image columns the dataset must have
    # the media columns a document shows, in order; its user turn (media and text) by default its media, then its
    # prompt (lmms-eval's turn of `doc_to_visual` and `doc_to_text`), else as `content` gives it (`doc_to_messages`)
    visuals: Callable[[dict], list[str]] = lambda doc: ["image"]
    # the clip columns the dataset must have (a visual named here is a clip)
    audio_columns: tuple[str, ...] = ()
    content: Callable[[dict], list] | None = None

    # columns that hold a list (of answers, of options): a string there is refused
    lists: tuple[str, ...] = ()

    @property
    def hears(self) -> bool:
        return bool(self.audio_columns)

    def read(self, doc, answer: str) -> Scored:
        """The answer scored as lmms-eval's pipeline scores it: cut at the first of `until`, its
        reasoning taken out (`without_reasoning`: its command line's default), then stripped (its
        `process_results` strips every answer before a task reads it)."""
        for stop in self.until:
            answer = answer.split(stop)[0]
        return self.score(doc, without_reasoning(answer))

    @property
    def reads(self) -> tuple[str, ...]:
        """Every column the dataset must have: its images and clips, then the columns."""
        return (*self.image_columns, *self.audio_columns, *self.columns)

    def turn(self, doc) -> list:
        """The document's user turn: {"type": "image"} and {"type": "audio"} blocks (its `visuals` in
        order) and text blocks."""
        if self.content is not None:
            return self.content(doc)
        kinds = ["audio" if column in self.audio_columns else "image" for column in self.visuals(doc)]
        return [{"type": kind} for kind in kinds] + [{"type": "text", "text": self.prompt(doc)}]

    @property
    def hub(self) -> str:
        """Where lmms-eval reads the documents: the dataset (its subset), the split."""
        return f"{self.dataset}{f' ({self.subset})' if self.subset else ''}, {self.split}"

    def numbers(self, scored: list[dict]) -> dict:
        """The task's metrics from its documents' scores (in document order); none without a
        document."""
        if not scored:
            return {}
        if self.aggregate is not None:
            return self.aggregate(scored)
        values = defaultdict(list)
        for metrics in scored:
            for name, value in metrics.items():
                values[name].append(value)
        return {name: sum(found) / len(found) for name, found in values.items()}


MMSTAR_YES_NO = " Please answer yes or no."


def mmstar_prompt(doc) -> str:
    question = doc["question"].strip().replace(MMSTAR_YES_NO, "")
    return f"{question}\nAnswer with the option's letter from the given choices directly"


def mmstar_score(doc, prediction: str) -> Scored:
    letter = choice_letter(prediction, "ABCD")
    score = float(letter == doc["answer"].strip().upper())
    return Scored({doc["category"]: (doc["l2_category"], score), "average": (doc["l2_category"], score)}, bool(letter))


def mean_of_l2_categories(scored: list[dict]) -> dict:
    """MMStar's aggregation: per metric, the mean over its l2 categories of their mean scores."""
    by_metric = defaultdict(lambda: defaultdict(list))
    for metrics in scored:
        for name, (l2_category, score) in metrics.items():
            by_metric[name][l2_category].append(score)
    return {name: sum(sum(scores) / len(scores) for scores in l2.values()) / len(l2) for name, l2 in by_metric.items()}


def chartqa_score(doc, prediction: str) -> Scored:
    score = 1.0 if relaxed_correctness(prediction, doc["answer"]) else 0.0
    split = "relaxed_human_split" if doc["type"] == "human_test" else "relaxed_augmented_split"
    return Scored({"relaxed_overall": score, split: score})


def anls_score(doc, prediction: str) -> Scored:
    return Scored({"anls": anls(list(doc["answers"]), prediction.strip())})


def ai2d_prompt(doc) -> str:
    options = "\n".join(f"{chr(ord('A') + index)}. {option}" for index, option in enumerate(doc["options"]))
    return f"{doc['question']}\n{options}\nAnswer with the option's letter from the given choices directly."


def ai2d_score(doc, prediction: str) -> Scored:
    target = chr(ord("A") + int(doc["answer"]))
    answer = leading_letter(prediction).strip()
    letters = {chr(ord("a") + index) for index in range(len(doc["options"]))}
    read = answer.lower().translate(str.maketrans("", "", string.punctuation)) in letters
    return Scored({"exact_match": exact_match(answer, target, ignore_case=True, ignore_punctuation=True)}, read)


def scienceqa_prompt(doc) -> str:
    context = f"Context: {doc['hint']}\n" if doc.get("hint") else ""
    options = "\n".join(f"{chr(ord('A') + index)}. {choice}" for index, choice in enumerate(doc["choices"]))
    return f"{context}{doc['question']}\n{options}\nAnswer with the option's letter from the given choices directly."


def scienceqa_score(doc, prediction: str) -> Scored:
    """LLaVA's parse: the letter itself (any case), or a capital letter and a period at the
    start."""
    target, answer = chr(ord("a") + doc["answer"]), prediction.strip()
    letters = {chr(ord("a") + index) for index in range(len(doc["choices"]))}
    if answer.lower() == target:
        return Scored({"exact_match": 1.0})
    if len(answer) >= 2 and answer[0].isupper() and answer[1] == ".":
        return Scored({"exact_match": float(answer[0].lower() == target)}, answer[0].lower() in letters)
    return Scored({"exact_match": 0.0}, answer.lower() in letters)


def fold_fullwidth(text: str) -> str:
    """Fullwidth ASCII (and the ideographic space) as ASCII, nothing else normalised
    (OCRBench's)."""
    return "".join(chr(ord(c) - 0xFEE0) if 0xFF01 <= ord(c) <= 0xFF5E else " " if c == "\u3000" else c for c in text)


def ocrbench_score(doc, prediction: str) -> Scored:
    """1 where an answer is inside the prediction: spaces and line breaks dropped for handwritten
    formulas (HME100k), else case and fullwidth characters folded."""
    answers = doc["answer"] if isinstance(doc["answer"], list) else [doc["answer"]]
    if doc["dataset"] == "HME100k":
        def normal(text):
            return text.strip().replace("\n", " ").replace(" ", "")
    else:
        def normal(text):
            return fold_fullwidth(text).lower().strip().replace("\n", " ")
    predicted = normal(prediction.strip())
    return Scored({"ocrbench_accuracy": (doc["question_type"], int(any(normal(a) in predicted for a in answers)))})


def per_thousand(scored: list[dict]) -> dict:
    """OCRBench's aggregation: the documents answered right over 1000, the size of the whole
    benchmark (with a --benchmark_limit too, as lmms-eval divides)."""
    return {"ocrbench_accuracy": sum(metrics["ocrbench_accuracy"][1] for metrics in scored) / 1000}


def textvqa_score(doc, prediction: str) -> Scored:
    return Scored({"exact_match": vqa_accuracy(list(doc["answers"]), prediction) if doc["answers"] else 0.0})


def mmmu_options(doc) -> list:
    """MMMU's options: a Python list written as a string."""
    try:
        options = ast.literal_eval(doc["options"])
    except (ValueError, SyntaxError):
        raise Skip("unreadable_options") from None
    if not isinstance(options, list):
        raise Skip("unreadable_options")
    return options


def mmmu_prompt(doc) -> str:
    if doc["question_type"] != "multiple-choice":
        return f"{doc['question']}\n\n{SINGLE_WORD_OR_PHRASE.strip()}"
    options = "\n".join(f"{chr(ord('A') + index)}. {option}" for index, option in enumerate(mmmu_options(doc)))
    return f"{doc['question']}\n{options}\n\nAnswer with the option's letter from the given choices directly."


def mmmu_visuals(doc) -> list[str]:
    """The images the question and options name (`<image 2>`), each once, in the order of their
    names."""
    prompt = f"{doc['question']} {doc['options'] if doc['question_type'] == 'multiple-choice' else ''}"
    return sorted({f"image_{number}" for number in re.findall(r"<image (\d+)>", prompt)})


def mmmu_content(doc) -> list:
    """lmms-eval's interleaved turn: the text before each `<image n>`, then the next image (in
    `mmmu_visuals`' order, whatever the number), then the text after the last; text beyond the
    images' count before the last is dropped."""
    pieces = re.sub(r"<image [1-7]>", "<image>", mmmu_prompt(doc)).split("<image>")
    content = []
    for index in range(len(mmmu_visuals(doc))):
        if index < len(pieces) - 1 and pieces[index].strip():
            content.append({"type": "text", "text": pieces[index].strip()})
        content.append({"type": "image"})
    return content + [{"type": "text", "text": pieces[-1].strip()}]


def mmmu_score(doc, prediction: str) -> Scored:
    """A choice's letter (a guess seeded by the document where none is read: lmms-eval guesses from
    the process's random state, which depends on the ranks; the guess is counted as unread) or an
    open answer's match."""
    if doc["question_type"] != "multiple-choice":
        return Scored({"mmmu_acc": float(mmmu_open_correct(doc["answer"], mmmu_open_predictions(prediction)))})
    options = mmmu_options(doc)
    letter = mmmu_choice(prediction, options)
    guess = letter or random.Random(doc["id"]).choice([chr(ord("A") + index) for index in range(len(options))])
    return Scored({"mmmu_acc": float(guess == doc["answer"])}, letter is not None)


def rounded_mean(scored: list[dict]) -> dict:
    """MMMU's accuracy over the documents, rounded to 5 places as lmms-eval reports it."""
    return {"mmmu_acc": round(sum(metrics["mmmu_acc"] for metrics in scored) / len(scored), 5)}


MMBENCH_OPTIONS = "There are several options:"
CIRCULAR = 1_000_000  # a circular copy's index: its question's plus a multiple of this


def given(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value)) and value != "nan"


def mmbench_prompt(doc) -> str:
    options = "\n".join(f"{letter}. {doc[letter]}" for letter in "ABCDE" if doc.get(letter) and given(doc[letter]))
    question = f"{doc['question']} {MMBENCH_OPTIONS}\n{options}".rstrip("\n")
    hint = f"{doc['hint']} " if given(doc.get("hint")) else ""
    return f"{hint}{question}\n\nAnswer with the option's letter from the given choices directly."


def mmbench_score(doc, prediction: str) -> Scored:
    """The letter of the rules before MMBench's judge, else of the multiple-choice extraction over
    the options given; scored per copy, a question right only where every circular copy of it is
    (`circular_accuracy`)."""
    # (a column the dataset lacks reads as the text "nan", an option, as in lmms-eval)
    options = {letter: doc.get(letter, "nan") for letter in "ABCD"}
    options = {letter: text for letter, text in options.items() if given(text) or text == "nan"}
    prediction = prediction.strip()
    letter = mmbench_prefetch(prediction, options) or choice_letter(prediction, sorted(options))
    return Scored({"gpt_eval_score": (int(doc["index"]), float(letter == doc["answer"]))}, bool(letter))


def circular_accuracy(scored: list[dict]) -> dict:
    """MMBench's circular evaluation: the percentage of questions (index under 10^6) whose copies
    among the documents are all right."""
    copies = [metrics["gpt_eval_score"] for metrics in scored]
    questions = {index for index, _ in copies if index < CIRCULAR}
    right = [all(score for index, score in copies if index % CIRCULAR == question) for question in questions]
    return {"gpt_eval_score": 100 * sum(right) / len(right) if right else math.nan}


def transcript_score(doc, prediction: str) -> Scored:
    """LibriSpeech's per-document result: the reference and the answer, scored together
    (`corpus_wer`)."""
    kept = {"gt": doc["gt"], "pred": prediction, "source": doc["source"], "task": doc["task"]}
    return Scored({"wer": kept})


def corpus_wer(scored: list[dict]) -> dict:
    """LibriSpeech's aggregation: the corpus WER in percent, every transcript normalised for the
    language of the last document's task ("asr_en": English), as lmms-eval's loop leaves it."""
    results = [metrics["wer"] for metrics in scored]
    references, predictions = [r["gt"] for r in results], [r["pred"] for r in results]
    return {"wer": 100 * word_error_rate(references, predictions, results[-1]["task"][4:])}


def question_then(post_prompt: str) -> Callable[[dict], str]:
    return lambda doc: f"{doc['question']}{post_prompt}"


SINGLE_WORD_OR_PHRASE = "\nAnswer the question using a single word or phrase."
TASKS = {task.name: task for task in [
    Task("mmstar", "Lin-Chen/MMStar", None, "val", "0.0", ("question", "answer", "category", "l2_category"),
         mmstar_prompt, mmstar_score, main="average", aggregate=mean_of_l2_categories),
    Task("chartqa", "lmms-lab-encoder/ChartQA", None, "test", "0.0", ("question", "answer", "type"),
         question_then("\nAnswer the question with a single word."), chartqa_score, main="relaxed_overall",
         max_new_tokens=16),
    Task("docvqa_val", "lmms-lab-encoder/DocVQA", "DocVQA", "validation", "0.0", ("question", "answers"),
         question_then(SINGLE_WORD_OR_PHRASE), anls_score, main="anls", max_new_tokens=32, lists=("answers",)),
    Task("infovqa_val", "lmms-lab-encoder/DocVQA", "InfographicVQA", "validation", "0.0", ("question", "answers"),
         question_then(SINGLE_WORD_OR_PHRASE), anls_score, main="anls", max_new_tokens=32, lists=("answers",)),
    Task("ai2d", "lmms-lab-encoder/ai2d", None, "test", "0.0", ("question", "options", "answer"), ai2d_prompt,
         ai2d_score, main="exact_match", max_new_tokens=16, lists=("options",)),
    Task("scienceqa_img", "lmms-lab-encoder/ScienceQA", "ScienceQA-IMG", "test", "0.0",
         ("question", "choices", "answer"), scienceqa_prompt, scienceqa_score, main="exact_match",
         max_new_tokens=16, lists=("choices",)),
    Task("textvqa_val", "lmms-lab-encoder/textvqa", None, "validation", "0.0", ("question", "answers"),
         lambda doc: doc["question"].capitalize() + SINGLE_WORD_OR_PHRASE, textvqa_score, main="exact_match",
         until=("ASSISTANT:",), lists=("answers",)),
    Task("ocrbench", "echo840/OCRBench", None, "test", "0.0", ("question", "answer", "dataset", "question_type"),
         lambda doc: doc["question"].strip(), ocrbench_score, main="ocrbench_accuracy", max_new_tokens=128,
         aggregate=per_thousand),
    Task("mmmu_val", "lmms-lab-encoder/MMMU", None, "validation", "0.0",
         ("id", "question", "options", "answer", "question_type"), mmmu_prompt, mmmu_score, main="mmmu_acc",
         max_new_tokens=128, aggregate=rounded_mean, image_columns=tuple(f"image_{n}" for n in range(1, 8)),
         visuals=mmmu_visuals, content=mmmu_content),
    Task("mmbench_en_dev_static", "lmms-lab-encoder/MMBench", "en", "dev", "0.0",
         ("index", "question", "A", "B", "answer"), mmbench_prompt, mmbench_score, main="gpt_eval_score",
         aggregate=circular_accuracy, until=("ASSISTANT:",)),
    Task("librispeech_test_clean", "lmms-lab-audio/librispeech", "librispeech_test_clean",
         "librispeech_test_clean", "0.0", ("gt", "source", "task"),
         lambda doc: "Please recognize the speech and only output the recognized content:",
         transcript_score, main="wer", max_new_tokens=256, aggregate=corpus_wer, image_columns=(),
         audio_columns=("audio",), visuals=lambda doc: ["audio"]),
]}
