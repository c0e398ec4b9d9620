"""Labelling a long repetitive row: the labeller's alignment of the text's tokens with the processor's ids (the image
expanded), against a sequence diff of the whole row, which the labeller ran before and whose cost grows with the square
of the length on repetitive text.

    python bench/label_alignment.py                 # 2,000 to 32,000 words (one token each), the tiny Llava
    python bench/label_alignment.py --quick         # a smoke run (CI): 500 and 1,000 words

Two rows at each length: an image before the text, and the text between two images (its middle aligned by a walk).
Prints the seconds to label each row with `ChatPreprocessor` (render, tokenise, align) and of the whole-row diff on
the same tokens (skipped over --max_diff_words: 32,000 words took about a minute), and their ratio, measured in one
run, on this machine's CPU; appends a JSON line to bench/results/.
"""

import argparse
import difflib
import json
import time
from pathlib import Path

from PIL import Image

from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.rows.chat_data import ChatPreprocessor
from mmrecipes.vlm.rows.labels import AnswerLabeller

RESULTS = Path(__file__).resolve().parent / "results" / "label_alignment.jsonl"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max_diff_words", type=int, default=10_000, help="the longest row the whole diff is run on")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    options = parser.parse_args()
    model, processor = load_vlm(VLMModelArgs())
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    preprocess = ChatPreprocessor(ChatDataArgs(max_length=65536), labeller, 65536)
    red = Image.new("RGB", (32, 32), (220, 40, 40))
    record = {"bench": "label_alignment", "quick": options.quick, "rows": []}
    print(f"{'words':>7} {'row':>14} {'tokens':>7} {'labelled s':>11} {'whole diff s':>13} {'ratio':>7}")
    for words in (500, 1000) if options.quick else (2000, 5000, 10_000, 32_000):
        text = " ".join(["red"] * words)
        for name, content, images in (("image first", f"<image>{text}", [red]),
                                      ("text between", f"<image>{text}<image>", [red, red])):
            row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "yes"}],
                   "images": images}
            started = time.perf_counter()
            (input_ids, _, _), _ = preprocess.example(row)
            labelled = time.perf_counter() - started
            diffed = None
            if words <= options.max_diff_words:
                plain = labeller.tokenizer(labeller.render(row["messages"])[0])["input_ids"]
                started = time.perf_counter()
                difflib.SequenceMatcher(None, plain, input_ids.tolist(), autojunk=False).get_matching_blocks()
                diffed = time.perf_counter() - started
            ratio = f"{diffed / labelled:7.1f}" if diffed else "      -"
            print(f"{words:>7} {name:>14} {len(input_ids):>7} {labelled:>11.3f} "
                  f"{diffed if diffed is not None else float('nan'):>13.3f} {ratio}")
            record["rows"].append({"words": words, "row": name, "tokens": len(input_ids), "labelled_s": labelled,
                                   "whole_diff_s": diffed})
    with open(options.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
