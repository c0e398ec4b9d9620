"""Make the embedded reasoning data and the tiny thinking model it trains.

    python data_prep/make_vlm_reasoning.py   # writes data/vlm_reasoning/ and data/tiny_think_vlm/

Deterministic (fixed seed). Questions about rendered shapes (make_vlm_data.py's scenes and questions), one per row;
half the rows carry the reasoning a thinking model writes first, in the assistant turn's `reasoning_content`
(the transformers / OpenAI field the reasoning templates read): what the image shows, then the answer. The other
half answer at once. Both splits mix the two kinds; the held-out rows' reasoning says how long a reasoned answer
runs, so that held-out generation leaves room for it.

data/tiny_think_vlm is the tiny Qwen3.5 of `data_prep/tiny_vlm_2026.py --family qwen3_5_think`, untrained: Qwen3.5's
hybrid layers with the template of Qwen3.5-4B and larger, whose generation prompt opens the think block
(`enable_thinking` false closes it empty). docs/reasoning.md trains it on this mix and measures both modes.
"""

import argparse
import random
from pathlib import Path

import datasets

from make_shapes import encode, make_scene
from make_vlm_data import questions_about
from tiny_vlm import save_family
from tiny_vlm_2026 import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
FEATURES = datasets.Features({
    "messages": [{"role": datasets.Value("string"),
                  "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}],
                  "reasoning_content": datasets.Value("string")}],
    "images": [datasets.Image()],
})


def scene_description(objects, relation) -> str:
    """What a careful look at the image finds, in words the answers use."""
    if relation is None:
        return f"The image shows one {' '.join(objects[0])}."
    (first, second) = (" ".join(item) for item in objects)
    return f"The image shows two shapes: a {first} {relation} a {second}."


def reasoning_rows(num_rows, seed, reasoning_share=0.5):
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        image, objects, relation = make_scene(rng)
        _, question, answer = rng.choice(questions_about(objects, relation))
        reasoning = scene_description(objects, relation) if rng.random() < reasoning_share else None
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": question}],
             "reasoning_content": None},
            {"role": "assistant", "content": [{"type": "text", "text": answer}], "reasoning_content": reasoning}],
            "images": [{"bytes": encode(image), "path": None}]})
    return rows


def write(rows, path):
    datasets.Dataset.from_list(rows, features=FEATURES).to_parquet(str(path))
    reasoned = sum(row["messages"][1]["reasoning_content"] is not None for row in rows)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB, {len(rows)} rows, {reasoned} with reasoning)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(ROOT / "data" / "vlm_reasoning"))
    parser.add_argument("--model_dir", default=str(ROOT / "data" / "tiny_think_vlm"))
    parser.add_argument("--train_rows", type=int, default=2048)
    parser.add_argument("--test_rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=300)
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write(reasoning_rows(args.train_rows, args.seed), out / "train-00000-of-00001.parquet")
    write(reasoning_rows(args.test_rows, args.seed + 1), out / "test-00000-of-00001.parquet")
    save_family(FAMILIES, "qwen3_5_think", Path(args.model_dir))
    print(f"wrote {args.model_dir}")


if __name__ == "__main__":
    main()
