"""Held-out answer accuracy of saved VLMs by question kind, on the embedded test conversations.

    python bench/answers_by_kind.py outputs/stage2 outputs/stage2_random_tower
    python bench/answers_by_kind.py --quick          # a smoke run (CI): the untrained tiny Llava, 16 rows

The recipe's `answer_accuracy` (teacher-forced exact match of each answer and its end-of-turn token: what greedy
decoding reproduces), split by what the question asks: colour, shape, size, count or relation (the kinds
data_prep/make_vlm_data.py writes). docs/vlm.md compares a VLM built on the pre-trained CLIP tower with one built on
a random tower with it. One row at a time, on CPU. Appends a JSON line to bench/results/.
"""

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrecipes.images import to_device
from mmrecipes.paths import VLM_SHAPES
from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.outputs import Logits
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import ChatPreprocessor
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller

RESULTS = Path(__file__).resolve().parent / "results" / "answers_by_kind.jsonl"

# The words that tell each kind's questions apart (data_prep/make_vlm_data.py's `questions_about`)
KINDS = {"colour": "What colour", "shape": "What shape", "size": "small or large", "count": "How many",
         "relation": "relative to"}


def kind_of(messages) -> str:
    question = " ".join(part["text"] or "" for part in messages[0]["content"])
    return next(kind for kind, words in KINDS.items() if words in question)


@torch.no_grad()
def accuracy_by_kind(path: str, rows) -> tuple[Counter, Counter]:
    """(correct answers, answers) per kind of `rows` (one question each) for the VLM saved at `path`."""
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    preprocess = ChatPreprocessor(ChatDataArgs(), AnswerLabeller(processor, stop_token_ids(model, processor)),
                                  max_length=processor.tokenizer.model_max_length)
    collate = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    step = VLMForTraining(model)
    correct, answers = Counter(), Counter()
    for row in rows:
        (input_ids, labels, media_inputs), _ = preprocess.example(row)
        batch = collate([{"input_ids": input_ids, "labels": labels, "media_inputs": media_inputs}])
        inputs = to_device(batch, "cpu")
        predicted = step(inputs, Logits())[:, :-1].argmax(-1)
        targets = inputs["labels"][:, 1:]
        scored = targets != IGNORE_INDEX
        kind = kind_of(row["messages"])
        correct[kind] += int(((predicted == targets) | ~scored).all())
        answers[kind] += 1
    return correct, answers


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="saved VLM directories")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    options = parser.parse_args()
    rows = datasets.load_dataset(str(VLM_SHAPES / "image_chat"), split="test")
    with tempfile.TemporaryDirectory() as scratch:
        if options.quick:
            rows = rows.select(range(16))
            model, processor = load_vlm(VLMModelArgs())
            model.save_pretrained(scratch)
            processor.save_pretrained(scratch)
        record = {"bench": "answers_by_kind", "quick": options.quick, "rows": len(rows), "models": {}}
        print(f"{'model':<48} " + " ".join(f"{kind:>9}" for kind in KINDS) + "       all")
        for path in options.models or [scratch]:
            correct, answers = accuracy_by_kind(path, rows)
            accuracy = {kind: correct[kind] / answers[kind] for kind in KINDS if answers[kind]}
            accuracy["all"] = sum(correct.values()) / sum(answers.values())
            record["models"][path] = {"accuracy": accuracy, "answers": dict(answers)}
            print(f"{path:<48} " + " ".join(f"{accuracy[kind]:9.4f}" if kind in accuracy else f"{'-':>9}"
                                            for kind in [*KINDS, "all"]))
    with open(options.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
