"""A saved thinking model asked to think and asked not to, on the embedded reasoning questions.

    accelerate launch recipes/vlm_finetune.py recipes/configs/vlm_reasoning.yaml   # writes outputs/vlm_reasoning
    python bench/reasoning_modes.py outputs/vlm_reasoning
    python bench/reasoning_modes.py --quick     # a smoke run (CI): the untrained tiny thinking model, 2 rows, 8 tokens

Each held-out question (data/vlm_reasoning's test split) through the model's own chat template with
`enable_thinking` true (Qwen3.5's generation prompt opens the think block) and false (it writes the block closed and
empty), greedy `generate` by transformers, as a user serves the model: the share of answers right (read after the
reasoning, as lmms-eval reads a benchmark's answers) and the share given after reasoning of the model's own. On CPU,
one row at a time. Appends a JSON line to bench/results/.
"""

import argparse
import json
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrecipes.benchmarks.scoring import reasoning_of, without_reasoning
from mmrecipes.paths import EMBEDDED

RESULTS = Path(__file__).resolve().parent / "results" / "reasoning_modes.jsonl"


@torch.no_grad()
def answers_in_mode(model, processor, rows, thinking: bool, max_new_tokens: int) -> dict:
    """The share of `rows` answered right, and the share answered after reasoning, with `enable_thinking`."""
    right = reasoned = 0
    for row in rows:
        question = next(part["text"] for part in row["messages"][0]["content"] if part["type"] == "text")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking)
        inputs = processor(text=text, images=[row["images"][0]], return_tensors="pt")
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        written = processor.tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        right += without_reasoning(written) == row["messages"][1]["content"][0]["text"]
        reasoned += bool(reasoning_of(written))
    return {"accuracy": right / len(rows), "with_reasoning": reasoned / len(rows)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="outputs/vlm_reasoning", help="a saved thinking VLM")
    parser.add_argument("--rows", type=int, default=256, help="held-out questions")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    options = parser.parse_args()
    path = str(EMBEDDED / "tiny_think_vlm") if options.quick else options.model
    max_new_tokens = 8 if options.quick else options.max_new_tokens
    rows = datasets.load_dataset(str(EMBEDDED / "vlm_reasoning"), split="test")
    rows = rows.select(range(2 if options.quick else min(options.rows, len(rows))))
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    result = {"bench": "reasoning_modes", "quick": options.quick, "model": path, "rows": len(rows)}
    print(f"{path}, {len(rows)} held-out questions, greedy generate")
    print("| enable_thinking | answers right | answered after reasoning |\n|---|---|---|")
    for thinking in (True, False):
        measured = answers_in_mode(model, processor, rows, thinking, max_new_tokens)
        result[f"thinking_{str(thinking).lower()}"] = measured
        print(f"| {str(thinking).lower()} | {measured['accuracy']:.3f} | {measured['with_reasoning']:.3f} |")
    with open(options.results, "a") as file:
        file.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
