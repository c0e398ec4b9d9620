"""The answer parsers and scorers of lmms-eval 0.7.3's rule-scored tasks, reproduced in behaviour
(their quirks included: a harness that scores otherwise reports other numbers for the same answers).

- `choice_letter`: its multiple-choice extraction (`_task_utils.mcq_extract.extract_mcq_answer`):
  every place a choice letter stands in a recognised form, the most telling form first, the last
  place within a form;
- `leading_letter`: AI2D's filter (a letter and a period at the start, else the answer as it is);
- `exact_match`: its `exact_match` metric (the `evaluate` library's, case and punctuation optionally
  ignored);
- `relaxed_correctness`: ChartQA's (a number within 5% of the target, else the same text ignoring
  case);
- `anls`: DocVQA's and InfoVQA's average normalised Levenshtein similarity (0 under 0.5), with its
  length from the answers before normalising;
- `mmmu_choice`, `mmmu_open_predictions`, `mmmu_open_correct`: MMMU's parsers (the MMMU authors'
  `eval_utils`, as lmms-eval runs them);
- `mmbench_prefetch`: MMBench's rule extraction before its judge (VLMEvalKit's `can_infer`, as
  lmms-eval's static evaluation runs it);
- `without_reasoning`: its reasoning blocks taken out of every answer before a task scores it
  (`api.reasoning.strip_reasoning_tags` with the command line's default `--reasoning_tags`);
- `word_error_rate`: its speech recognition tasks' corpus WER (`tasks.asr_wer_utils`: special
  tokens taken out, Whisper's English and basic text normalisers, sacrebleu's "none" tokenizer
  lower-cased without punctuation, word edit distances summed over the references' words).
"""

import functools
import json
import re
import string
import unicodedata
from pathlib import Path

from transformers.models.whisper import english_normalizer as whisper

CHOICES = "ABCDEFGH"
# lmms-eval's default --reasoning_tags: the blocks a reasoning model writes before its answer
REASONING_TAGS = (("<think>", "</think>"), ("<analysis>", "</analysis>"))
# phrases after which a letter is the answer ("the answer is B"), in lmms-eval's order
ANSWER_PHRASES = ("the answer is", "answer is", "the correct answer is", "correct answer is", "the best answer is",
                  "best answer is", "the correct option is", "correct option is", "the best option is",
                  "best option is", "the choice is", "choice is", "the correct choice is", "correct choice is",
                  "i choose", "i select", "i pick", "my answer is", "my choice is", "옵션", "정답은", "답은", "답:",
                  "答案是", "答案为", "选", "答えは")
# how telling each form is: a letter alone at the start, at the end, after a phrase, "(B)", "B.", "B:", "B)", "B "
FORMS = {"start": 10, "end": 9, "phrase": 7, "parentheses": 6, "period": 5, "colon": 4, "right_paren": 3, "space": 2,
         "anywhere": 0}
AROUND = {"parentheses": ("(", ")"), "period": ("", "."), "colon": ("", ":"), "right_paren": ("", ")"),
          "space": ("", " ")}


def without_reasoning(response: str, tags=REASONING_TAGS) -> str:
    """The answer after its reasoning, stripped: each closed block of a pair of `tags` taken out, and
    where only a closing tag is left (the template opened the block in the generation prompt) the
    text after the last one; an unclosed opening tag stays."""
    for start_tag, end_tag in tags:
        while start_tag in response and end_tag in response:
            start = response.find(start_tag)
            end = response.find(end_tag, start)
            if end == -1:
                break
            response = response[:start] + response[end + len(end_tag):]
        if end_tag in response and start_tag not in response:
            response = response.rsplit(end_tag, 1)[-1]
    return response.strip()


def reasoning_of(response: str, tags=REASONING_TAGS) -> str:
    """What `without_reasoning` takes out of `response`, its tags left out and stripped: the text before the
    last closing tag ("" for an empty block, or none)."""
    for start_tag, end_tag in tags:
        if end_tag in response:
            return response.rsplit(end_tag, 1)[0].replace(start_tag, "").replace(end_tag, "").strip()
    return ""


def choice_letter(response: str, choices=CHOICES) -> str:
    """The choice letter `response` gives, or "" where it gives none."""
    if not response or not response.strip():
        return ""
    text = response.strip()
    for mark in ",.!?;:'\"":
        text = text.strip(mark)
    text = f" {text} "
    found = []  # (how telling the form is, position, letter)
    for form, (before, after) in AROUND.items():
        found += [(FORMS[form], text.rfind(f"{before}{letter}{after}"), letter) for letter in choices
                  if f"{before}{letter}{after}" in text]
    lowered = text.lower()
    for phrase in ANSWER_PHRASES:
        if (start := lowered.find(phrase)) != -1:
            found += [(FORMS["phrase"], position, letter) for letter in choices
                      if (position := text.find(letter, start + len(phrase))) != -1]
    alone = text.strip()
    for letter in choices:
        if alone.startswith(letter) and (len(alone) == 1 or not alone[1].isalpha()):
            found.append((FORMS["start"], 0, letter))
        if alone.endswith(letter) and (len(alone) == 1 or not alone[-2].isalpha()):
            found.append((FORMS["end"], len(text) - 1, letter))
    if not found:
        found = [(FORMS["anywhere"], text.rfind(letter), letter) for letter in choices if letter in text]
    # the most telling form, then the latest position; equal ones keep their order (a stable sort, as lmms-eval's)
    return sorted(found, key=lambda item: item[:2], reverse=True)[0][2] if found else ""


def leading_letter(response: str) -> str:
    """AI2D's filter: the letter of a response that starts with one and a period ("B. a cat"), else
    the response."""
    stripped = response.lstrip()
    if len(stripped) > 1 and stripped[0] in string.ascii_uppercase and stripped[1] == ".":
        return stripped[0]
    return response


def exact_match(prediction: str, reference: str, ignore_case=False, ignore_punctuation=False) -> float:
    if ignore_case:
        prediction, reference = prediction.lower(), reference.lower()
    if ignore_punctuation:
        table = str.maketrans("", "", string.punctuation)
        prediction, reference = prediction.translate(table), reference.translate(table)
    return float(prediction == reference)


def relaxed_correctness(prediction: str, target: str, max_relative_change: float = 0.05) -> bool:
    """ChartQA's relaxed accuracy: a number within `max_relative_change` of a non-zero numeric
    target (a trailing % divides by 100), else the same text ignoring case."""
    def number(text: str):
        try:
            return float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
        except ValueError:
            return None

    predicted, expected = number(prediction), number(target)
    if predicted is not None and expected:
        return abs(predicted - expected) / abs(expected) <= max_relative_change
    return prediction.lower() == target.lower()


def levenshtein(one, other) -> int:
    """The edit distance of two strings, or of two lists of words."""
    if len(one) > len(other):
        one, other = other, one
    distances = list(range(len(one) + 1))
    for row, character in enumerate(other):
        previous, distances = distances, [row + 1]
        for column, mine in enumerate(one):
            distances.append(previous[column] if mine == character
                             else 1 + min(previous[column], previous[column + 1], distances[-1]))
    return distances[-1]


def anls(answers: list[str], prediction: str, threshold: float = 0.5) -> float:
    """1 - the smallest normalised edit distance to an answer (lower-cased, spaces collapsed), 0
    below `threshold`; normalised by the longer of the answer and the prediction as given
    (lmms-eval's, Qwen-VL's)."""
    def normal(text):
        return " ".join(text.strip().lower().split())

    distances = []
    for answer in answers:
        length = max(len(answer.upper()), len(prediction.upper()))
        distances.append(0.0 if length == 0 else levenshtein(normal(answer), normal(prediction)) / length)
    score = 1 - min(distances)
    return 0.0 if score < threshold else score


def mmmu_choice(response: str, options: list) -> str | None:
    """The letter of MMMU's multiple-choice parse: "(B)", then "B ", then "B." (the last place where
    several), then, in an answer of more than five words, an option's text (the last one named);
    None where none is found (lmms-eval then guesses)."""
    letters = [chr(ord("A") + index) for index in range(len(options))]
    for mark in ",.!?;:'":  # one mark after the other, as the original strips them
        response = response.strip(mark)
    text = f" {response} "
    candidates = [letter for letter in letters if f"({letter})" in text]
    bracketed = bool(candidates)
    for form in ("{} ", "{}."):
        candidates = candidates or [letter for letter in letters if form.format(letter) in text]
    by_text = not candidates and len(text.split()) > 5
    if by_text:
        candidates = [letter for letter, option in zip(letters, options) if str(option).lower() in text.lower()]
    if len(candidates) <= 1:
        return candidates[0] if candidates else None

    def where(letter):
        if by_text:
            return text.lower().rfind(str(options[letters.index(letter)]).lower())
        return text.rfind(f"({letter})" if bracketed else f" {letter} ")

    return max(candidates, key=where)  # the first of equals, as numpy's argmax


NUMBER_FORMS = (r"-?\b\d{1,3}(?:,\d{3})+\b", r"-?\d+(?:\.\d+)?[eE][+-]?\d+",
                # with commas, scientific, simple
                r"-?(?:\d+\.\d+|\.\d+|\d+\b)(?![eE][+-]?\d+)(?![,\d])")
KEY_INDICATORS = ("could be ", "so ", "is ", "thus ", "therefore ", "final ", "answer ", "result ")


def mmmu_normal(text: str) -> list:
    """A number rounded to 2 places, else the lower-cased text (a single character padded by a space
    on either side, so that it matches no longer word)."""
    text = text.strip()
    try:
        return [round(float(text.replace(",", "")), 2)]
    except ValueError:
        text = text.lower()
        return [f" {text}", f"{text} "] if len(text) == 1 else [text]


def mmmu_open_predictions(response: str) -> list:
    """MMMU's open-answer parse: of each line, the shortest tail after a key phrase ("so ", "is ",
    "answer ", "=" on the last line), and the numbers in them, normalised (`mmmu_normal`); the whole
    answer where no line has one."""
    response = response.strip().strip(".").lower()
    lines = re.split(r"\.\s(?=[A-Z])|\n", response)  # (lower-cased: only the line breaks split)
    keys = []
    for index, line in enumerate(lines):
        indicators = KEY_INDICATORS + (("=",) if index == len(lines) - 1 else ())
        shortest = None
        for indicator in indicators:
            if indicator in line:
                tail = line.split(indicator)[-1].strip()
                if not shortest or len(tail) < len(shortest):
                    shortest = tail
        if shortest and shortest.strip() not in (":", ",", ".", "!", "?", ";", "'"):
            keys.append(shortest)
    keys = keys or [response]
    found = keys + [number for key in keys for form in NUMBER_FORMS for number in re.findall(form, key)]
    return list({value: None for text in found for value in mmmu_normal(text)})


def mmmu_open_correct(answer: str, predictions: list) -> bool:
    """Whether a normalised answer is inside a predicted text, or equals a predicted number."""
    answers = mmmu_normal(answer)
    return any(any(isinstance(expected, str) and expected in predicted for expected in answers)
               if isinstance(predicted, str) else predicted in answers for predicted in predictions)


LETTER_FORMS = (("", "."), ("", ","), ("", ":"), ("", ")"), ("", ")."), ("(", ")"), ("(", ")."), (":", ""), (":", ","),
                (":", "."), (":", ")"), (":", ")."))


def mmbench_prefetch(response: str, options: dict) -> str:
    """MMBench's letter without a judge: one of A-E alone as a word (not where an "A" may be an
    article, in more than three words), else one letter in a single form ("B.", "(B)", ":B", ...),
    else the one option whose text the answer contains; "" where none."""
    words = [word.strip() for word in response.split()]

    def alone(before="", after=""):
        return [letter for letter in "ABCDE" if f"{before}{letter}{after}" in words]

    if len(alone()) == 1 and not ("A" in words and len(words) > 3):
        return alone()[0]
    for before, after in LETTER_FORMS:
        if len(found := alone(before, after)) == 1:
            return found[0]
    named = [letter for letter, option in options.items() if str(option).lower() in response.lower()]
    return named[0] if len(named) == 1 else ""


@functools.cache
def english_normalizer() -> whisper.EnglishTextNormalizer:
    """Whisper's English normaliser with its British-to-American spellings (english_spellings.json:
    Whisper's english.json, as lmms-eval ships it)."""
    spellings = (Path(__file__).parent / "english_spellings.json").read_text()
    return whisper.EnglishTextNormalizer(json.loads(spellings))


def punctuation(word: str) -> bool:
    return all(unicodedata.category(character)[0] == "P" for character in word)


def transcript_words(text: str, language: str) -> list[str]:
    """The words WER compares of a transcript: `<|..|>` tokens out and no space before punctuation
    (lmms-eval's `remove_sp`), Whisper's English normaliser then its basic one (for any other
    language, the basic one: lmms-eval's order, both for English), lower-cased words without the
    all-punctuation ones."""
    if language in ("zh", "yue"):
        raise ValueError(f"lmms-eval normalises {language} transcripts with its Chinese normaliser "
                         "(cn_tn), which is not reproduced here")
    text = re.sub(r"\s+", " ", re.sub(r"<\|.*?\|>", " ", text))
    text = re.sub(r" ?([!,.?;:])", r"\1", text).lstrip(" ")
    if language == "en":
        text = english_normalizer()(text)
    text = whisper.BasicTextNormalizer()(text)
    return " ".join(word for word in text.split(" ") if not punctuation(word)).lower().split()


def word_error_rate(references: list[str], predictions: list[str], language: str) -> float:
    """The corpus word error rate: word edits summed over the pairs, over the references' words
    (none: an error, as in lmms-eval)."""
    edits = words = 0
    for reference, prediction in zip(references, predictions, strict=True):
        expected = transcript_words(reference, language)
        edits += levenshtein(expected, transcript_words(prediction, language))
        words += len(expected)
    return edits / words
