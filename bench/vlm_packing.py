"""Padded fixed-row micro-batches against token-budget batches against packing, in one run.

    python bench/vlm_packing.py          # CPU here (a GPU when there is one)
    python bench/vlm_packing.py --quick

Same model (the recipe's Llava at `--text_hidden_size 256 --text_layers 4`), same optimizer, each
variant in a fresh process on the same rows: real (non-padding) tokens per second of training
steps, the peak memory of those steps, and the mean loss of the last steps (the loss curve must
agree within noise). Two mixtures:
- `embedded`: the recipe's default (75% image questions of 1-3 turns, 25% text-only);
- `long_tail`: the same plus 10% conversations of 4 images (4 shapes questions joined), the rows of
  a few hundred tokens that make a padded batch mostly padding.
Variants: `padded` (--per_device_train_batch_size 16), `budget` (--max_tokens_per_batch set to 16
rows of the mixture's mean length, padded to the longest row), `packed` (the same budget, packed into
sequences of up to 256 tokens, the recipe's default --max_length).
"""

import argparse
import json
import platform
import resource
import tempfile
import time
from pathlib import Path

import datasets
import torch

from fresh_process import resident_bytes, run_in_fresh_process

RESULTS = Path(__file__).resolve().parent / "results" / "vlm_packing.jsonl"
SIZES = dict(text_hidden_size=256, text_layers=4)
PACK_LENGTH = 256  # the recipe's default --max_length, its sequence length when packing


def long_tail_source(directory: Path) -> str:
    """Conversations of 4 images: 4 consecutive embedded image conversations' first turns, joined."""
    from mmrecipes.paths import VLM_SHAPES

    rows = datasets.load_dataset(str(VLM_SHAPES / "image_chat"), split="train").select(range(800))
    rows = rows.cast_column("images", datasets.List(datasets.Image(decode=False)))
    joined = []
    for start in range(0, len(rows) - 3, 4):
        group = [rows[start + i] for i in range(4)]
        if not all(len(row["images"]) == 1 for row in group):
            continue
        joined.append({"messages": [message for row in group for message in row["messages"][:2]],
                       "images": [row["images"][0] for row in group]})
    datasets.Dataset.from_list(joined, features=rows.features).to_parquet(str(directory / "train.parquet"))
    return str(directory)


def _variant(mode, mixture, budget, steps, queue):
    from mmrecipes.distributed import Ranks
    from mmrecipes.images import to_device
    from mmrecipes.paths import VLM_SHAPES
    from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
    from mmrecipes.vlm.model.families import dummy_image_inputs
    from mmrecipes.vlm.model.loading import stop_token_ids
    from mmrecipes.vlm.model.module_groups import apply_train_modules, module_groups
    from mmrecipes.vlm.model.outputs import LossSum
    from mmrecipes.vlm.model.parts import load_vlm
    from mmrecipes.vlm.model.step import VLMForTraining
    from mmrecipes.vlm.rows.chat_data import build_chat_dataloader
    from mmrecipes.vlm.rows.collate import ChatCollator
    from mmrecipes.vlm.rows.labels import AnswerLabeller, count_target_tokens

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, processor = load_vlm(VLMModelArgs(**SIZES))
    dummy_inputs = dummy_image_inputs(model, processor)
    trainable = apply_train_modules(module_groups(model, dummy_inputs), "projector,language_model")
    params = [p for group in trainable.values() for p in group if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sources = f"{VLM_SHAPES / 'image_chat'},{VLM_SHAPES / 'text_chat'}" + (f",{mixture}" if mixture else "")
    weights = "0.75,0.25" if not mixture else "0.675,0.225,0.1"
    args = ChatDataArgs(dataset_name=sources, dataset_weights=weights, dataloader_num_workers=0, max_length=512,
                        max_tokens_per_batch=None if mode == "padded" else budget, packing=mode == "packed")
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_inputs, packing=mode == "packed",
                                  pack_length=PACK_LENGTH)
    loader = build_chat_dataloader(args, AnswerLabeller(processor, stop_token_ids(model, processor)), collator,
                                   batch_size=16, ranks=Ranks(), shuffle_seed=0)
    step = VLMForTraining(model).to(device)
    batches = iter(loader)
    tokens, seconds, losses = 0, 0.0, []
    before = torch.cuda.memory_allocated() if device == "cuda" else resident_bytes()
    for index in range(steps + 3):  # 3 warm-up steps
        batch = next(batches)
        inputs = to_device(batch, device)
        start = time.perf_counter()
        summed = step(inputs, LossSum()).summed
        (summed / max(1, count_target_tokens(batch["labels"]))).backward()
        optimizer.step()
        optimizer.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= 3:
            seconds += time.perf_counter() - start
            tokens += int(batch["attention_mask"].sum())
            losses.append(summed.item() / max(1, count_target_tokens(batch["labels"])))
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    last = losses[-max(1, steps // 4):]
    queue.put({"tokens_per_s": tokens / seconds, "peak_bytes": peak - before, "final_loss": sum(last) / len(last),
               "tokens": tokens, "device": device})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    steps = 2 if args.quick else args.steps
    record = {"bench": "vlm_packing", "quick": args.quick, "machine": platform.node(),
              "time": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(), "sizes": SIZES,
              "steps": steps}
    with tempfile.TemporaryDirectory() as directory:
        mixtures = {"embedded": None} if args.quick else {"embedded": None,
                                                          "long_tail": long_tail_source(Path(directory))}
        for name, mixture in mixtures.items():
            fresh = not args.quick
            padded = run_in_fresh_process(_variant, "padded", mixture, None, steps, fresh=fresh)
            budget = padded["tokens"] // steps  # the real tokens of 16 rows of this mixture, on average
            results = {"padded": padded,
                       "budget": run_in_fresh_process(_variant, "budget", mixture, budget, steps, fresh=fresh),
                       "packed": run_in_fresh_process(_variant, "packed", mixture, budget, steps, fresh=fresh)}
            print(f"{name} (budget {budget} tokens): {'tokens/s':>10} {'x padded':>9} {'peak MB':>9} "
                  f"{'final loss':>11}")
            for mode, result in results.items():
                ratio = result["tokens_per_s"] / padded["tokens_per_s"]
                print(f"  {mode:<8} {result['tokens_per_s']:>18.0f} {ratio:>9.2f} "
                      f"{result['peak_bytes'] / 2**20:>9.0f} {result['final_loss']:>11.3f}")
            record[name] = results | {"budget": budget}
    with open(args.results, "a") as file:
        file.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
