"""End-to-end training throughput of the CLIP recipe at 1 and 2 processes, with FLOPs per sample.

    python bench/recipe_throughput.py            # 200 steps each (about 2 minutes on 2 cores)
    python bench/recipe_throughput.py --quick    # a smoke run: 2 processes, 6 steps

Runs `recipes/clip_pretrain.py` as a user does (no config: 1 process; `accelerate_configs/ddp.yaml`
with 2 processes), without evaluation, and reads samples/s and data_wait from its log lines
after the first (which holds the start-up). FLOPs per sample are the recipe's own estimate
(`mmrecipes.contrastive.flops.clip_train_flops_per_sample`), so samples/s x FLOPs is the achieved
FLOP/s; MFU needs a device peak, which a CPU does not have. Prints the table and appends a JSON
line to bench/results/recipe_throughput.jsonl.
"""

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmrecipes.contrastive.arguments import DataArgs, ModelArgs
from mmrecipes.contrastive.data import caption_length
from mmrecipes.contrastive.flops import clip_train_flops_per_sample
from mmrecipes.contrastive.models import build_contrastive

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "recipe_throughput.jsonl"


def run(processes: int, steps: int, output_dir: str) -> dict:
    config = str(REPO / "accelerate_configs" / "ddp.yaml")
    launch = [] if processes == 1 else ["-m", "accelerate.commands.launch", "--config_file", config,
                                        "--num_processes", str(processes)]
    start = time.perf_counter()
    log = subprocess.run([sys.executable, *launch, str(REPO / "recipes" / "clip_pretrain.py"), "--report_to", "none",
                          "--max_steps", str(steps), "--logging_steps", str(max(1, steps // 10)), "--eval_split", "",
                          "--output_dir", output_dir],
                         capture_output=True, text=True, check=True).stdout
    lines = re.findall(r"\| samples/s ([\d.]+) \|.*\| data_wait ([\d.]+) \|", log)
    lines = lines[1:] or lines  # the first window holds the start-up
    return {"samples_per_s": statistics.median(float(s) for s, _ in lines),
            "data_wait": statistics.median(float(w) for _, w in lines), "wall_s": time.perf_counter() - start}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    steps = 6 if args.quick else 200
    model, tokenizer, _ = build_contrastive(ModelArgs())
    flops = clip_train_flops_per_sample(model, caption_length(DataArgs(), tokenizer))
    with tempfile.TemporaryDirectory() as directory:
        measured = {processes: run(processes, steps, f"{directory}/{processes}")
                    for processes in ((2,) if args.quick else (1, 2))}
    print(f"clip_pretrain.py defaults (batch 64 per process), {steps} steps, median over log lines after the first; "
          f"{flops / 1e6:.1f} MFLOPs per sample")
    print(f"{'processes':>9} {'samples/s':>10} {'GFLOP/s':>8} {'data_wait':>9} {'wall s':>7}")
    for processes, value in measured.items():
        print(f"{processes:>9} {value['samples_per_s']:>10.0f} {value['samples_per_s'] * flops / 1e9:>8.1f} "
              f"{value['data_wait']:>9.3f} {value['wall_s']:>7.1f}")
    if 1 in measured:
        print(f"2 processes / 1: {measured[2]['samples_per_s'] / measured[1]['samples_per_s']:.2f}x samples/s")
    record = {"bench": "recipe_throughput", "quick": args.quick, "machine": platform.node(),
              "time": time.strftime("%Y-%m-%d %H:%M"), "steps": steps, "flops_per_sample": flops,
              "processes": {str(processes): value for processes, value in measured.items()}}
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
