"""Make the embedded agentic task's data (mmrecipes/vlm/algorithms/zoom.py): a small shape in a 128-pixel picture,
and a tool that zooms into a quadrant.

    python data_prep/make_zoom.py      # writes data/vlm_zoom/{sft,prompts}/{train,test}-00000-of-00001.parquet

Deterministic (fixed seed).
- `sft`: conversations to fine-tune on (TRL's layout: `messages`, `images`, `tools` as JSON text). Half use the tool:
  the question, a call of zoom on the shape's quadrant, the tool's turn (the zoomed quadrant), the answer; half
  answer at once, without tools offered.
- `prompts`: GRPO's prompt rows: `prompt` (the question and the picture), `image`, `solution` (the shape) and
  `scene` (JSON: what the environment redraws at reset).
"""

import argparse
import json
import random
from pathlib import Path

import datasets
from transformers.utils import get_json_schema

from make_shapes import encode
from mmrecipes.vlm.algorithms.zoom import CANVAS, QUESTION, SHAPES, ZoomEnv, draw, quadrant_of, zoomed

ROOT = Path(__file__).resolve().parents[1]
COLOURS = [(220, 40, 40), (40, 200, 60), (60, 90, 230), (230, 210, 40), (230, 130, 30), (170, 60, 200),
           (240, 240, 240), (40, 200, 200)]
ROWS = {"train": 4000, "test": 200}


def scene(rng) -> dict:
    half = 10
    quadrant_x, quadrant_y = rng.randrange(2), rng.randrange(2)
    return {"background": [rng.randint(0, 50) for _ in range(3)], "colour": list(rng.choice(COLOURS)),
            "shape": rng.choice(SHAPES), "half": half,
            "x": quadrant_x * CANVAS // 2 + rng.randint(20, 44), "y": quadrant_y * CANVAS // 2 + rng.randint(20, 44)}


def png(image) -> dict:
    return {"bytes": encode(image), "path": None}


def text(words: str) -> list:
    return [{"type": "text", "text": words}]


def sft_row(rng, tool: bool) -> dict:
    drawn = scene(rng)
    picture, quadrant = draw(drawn), quadrant_of(drawn)
    question = {"role": "user", "content": [{"type": "image", "text": None}, *text(QUESTION)]}
    answer = {"role": "assistant", "content": text(drawn["shape"])}
    if not tool:
        return {"messages": [question, answer], "images": [png(picture)], "tools": None}
    call = {"role": "assistant", "content": text(""), "tool_calls": [
        {"type": "function", "function": {"name": "zoom", "arguments": json.dumps({"quadrant": quadrant})}}]}
    result = {"role": "tool", "name": "zoom", "content": [{"type": "image", "text": None}, *text(quadrant)]}
    return {"messages": [question, call, result, answer], "images": [png(picture), png(zoomed(picture, quadrant))],
            "tools": json.dumps([get_json_schema(ZoomEnv().zoom)])}


def prompt_row(rng) -> dict:
    drawn = scene(rng)
    return {"prompt": [{"role": "user", "content": [{"type": "image", "text": None}, *text(QUESTION)]}],
            "image": png(draw(drawn)), "solution": drawn["shape"], "scene": json.dumps(drawn)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(ROOT / "data" / "vlm_zoom"))
    args = parser.parse_args()
    rng = random.Random(2026)
    for split, count in ROWS.items():
        for name, rows in (("sft", [sft_row(rng, index % 2 == 0) for index in range(count)]),
                           ("prompts", [prompt_row(rng) for _ in range(count)])):
            table = datasets.Dataset.from_list(rows)
            for column in ("images", "image"):
                if column in table.column_names:
                    table = table.cast_column(column, [datasets.Image()] if column == "images" else datasets.Image())
            folder = Path(args.output_dir) / name
            folder.mkdir(parents=True, exist_ok=True)
            table.to_parquet(folder / f"{split}-00000-of-00001.parquet")
            print(f"{name}/{split}: {len(rows)} rows -> {folder}")


if __name__ == "__main__":
    main()
