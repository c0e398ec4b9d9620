"""The embedded agentic task (mmrecipes/vlm/algorithms/zoom.py): a model's accuracy with the zoom tool offered and
without it, and how often it calls the tool, on the held-out prompts (data/vlm_zoom/prompts, test split).

    python bench/zoom_task.py --model embedded:tiny_zoom_vlm            # the SFT'd start
    python bench/zoom_task.py --model outputs/vlm_grpo_zoom             # after vlm_grpo.py with the environment
    python bench/zoom_task.py --quick                                   # 8 prompts (CI)

Each prompt is answered nearly greedily (temperature 0.01, the recipe's samplers): with the tool, over as many turns
as it calls (the environment redraws the prompt's scene); without, in one turn from a prompt that offers no tool. An
answer is right where it is the shape (the recipe's accuracy reward on the last turn). Appends a JSON line to
bench/results/.
"""

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import datasets
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrecipes.images import readable_source
from mmrecipes.paths import resolve_name
from mmrecipes.vlm.algorithms.grpo import GroupLayout
from mmrecipes.vlm.algorithms.rewards import accuracy
from mmrecipes.vlm.algorithms.sampling import Sampler, generate_group
from mmrecipes.vlm.algorithms.tools import Tools
from mmrecipes.vlm.algorithms.trajectory import prompt_seed
from mmrecipes.vlm.arguments import GRPOArgs
from mmrecipes.vlm.model.families import dummy_image_inputs, placeholder_token_ids
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import prompt_row
from mmrecipes.vlm.rows.collate import ChatCollator

RESULTS = Path(__file__).resolve().parent / "results" / "zoom_task.jsonl"


def answers(model, processor, rows, tools) -> tuple[list, list]:
    """(each prompt's answer text, its tool calls and how many of them ran), with `tools` offered (None: without)."""
    stops = stop_token_ids(model, processor)
    args = GRPOArgs(environment_factory="mmrecipes.vlm.algorithms.zoom:ZoomEnv", temperature=0.01,
                    max_completion_length=160)
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    sampler = Sampler(SimpleNamespace(device=torch.device("cpu")), collator, args, stops,
                      placeholder_token_ids(model, processor), tools)
    step, texts, calls = VLMForTraining(model).eval(), [], []
    for row in rows:
        image = Image.open(readable_source(row["image"])).convert("RGB")
        prompt = prompt_row(processor, row["prompt"], [image], tools.schemas() if tools else None)
        prompt |= {"prompt": row["prompt"], "columns": {"scene": row["scene"], "solution": row["solution"]}}
        if tools is None:
            (ids, _), = generate_group(step, prompt, collator, args, stops, prompt_seed(0, prompt), "cpu",
                                       sampler.suppressed, [0])
            texts.append(processor.tokenizer.decode([t for t in ids if t not in stops], skip_special_tokens=True))
            continue
        # the recipe's sampler: the environment, the first turn, then the tool turns
        draw = sampler.drawing(step, True, prompt)
        trajectory, = sampler.tools.environment_turns(draw, [prompt], GroupLayout(1, 1, 1, 0, 1), 0)
        sampler.tools.read(trajectory, trajectory.ids)
        sampler.tools.tool_turns(draw, [trajectory])
        texts.append(trajectory.messages[-1]["content"])
        counts = tools.take_counts()
        calls.append((counts["tool_calls"], counts["tool_calls"] - counts["tool_failures"]))
    return texts, calls


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded:tiny_zoom_vlm")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    path = resolve_name(args.model)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    files = str(Path(resolve_name("embedded:vlm_zoom/prompts")) / "test-*.parquet")
    rows = datasets.load_dataset("parquet", data_files=files, split="train")
    rows = rows.cast_column("image", datasets.Image(decode=False)).select(range(8 if args.quick else args.prompts))
    tools = Tools.of(GRPOArgs(environment_factory="mmrecipes.vlm.algorithms.zoom:ZoomEnv"), processor,
                     stop_token_ids(model, processor))
    started = time.perf_counter()
    record = {"bench": "zoom_task", "quick": args.quick, "model": args.model, "prompts": len(rows)}
    solutions = [row["solution"] for row in rows]
    for name, offered in (("with_tool", tools), ("without_tool", None)):
        texts, calls = answers(model, processor, rows, offered)
        right = accuracy(None, texts, solution=solutions)
        record |= {f"accuracy_{name}": sum(right) / len(right)}
        if offered:  # calls written, and those that parse and name the tool
            record |= {"calls_per_prompt": sum(made for made, _ in calls) / len(calls),
                       "readable_calls_per_prompt": sum(readable for _, readable in calls) / len(calls)}
    record |= {"seconds": round(time.perf_counter() - started, 1), "torch": torch.__version__}
    print(json.dumps(record))
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
