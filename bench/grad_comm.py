"""Gradient communication per optimizer step under accumulation: collective calls and bytes, per engine.

    python bench/grad_comm.py            # DDP, FSDP2, ZeRO-2 x GA 1, 4, 16 x accumulate/naive (2 CPU processes)
    python bench/grad_comm.py --quick    # a smoke run: DDP, GA 4, accumulate only (one launch)

Each point launches `accelerate launch --config_file accelerate_configs/<engine> --num_processes 2`
on this file, which trains the tiny CLIP (the recipe's model and optimizer, and the contrastive
loss on each rank's own rows, so that the loss adds no collective of its own) for two optimizer
steps of GA micro-batches and records the second one with `torch.profiler`: every collective
the process group runs (`gloo:*` / `nccl:*` events: DDP's gradient buckets, FSDP2's parameter
all-gathers and gradient reduce-scatters, DeepSpeed's reductions) with its size. `accumulate`
wraps each micro-batch in `accelerator.accumulate` (what the recipes do); `naive` calls
`accelerator.backward` on each one with no `no_sync`.
Prints the table and appends a JSON line to bench/results/grad_comm.jsonl.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "grad_comm.jsonl"
BYTES = 4  # fp32 everywhere on CPU


def worker(accumulation: int, mode: str, out: str):
    """Runs under `accelerate launch`: two optimizer steps, the second profiled."""
    import torch
    from accelerate.utils import set_seed
    from torch.profiler import ProfilerActivity, profile

    from mmrecipes.contrastive.arguments import ModelArgs
    from mmrecipes.contrastive.losses import local_clip_loss
    from mmrecipes.contrastive.models import build_contrastive
    from mmrecipes.distributed import make_accelerator, reconcile_deepspeed_config

    set_seed(0)
    model, _, _ = build_contrastive(ModelArgs())
    accelerator = make_accelerator(gradient_accumulation_steps=accumulation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reconcile_deepspeed_config(accelerator, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=accumulation,
                               gradient_clipping=1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = {"input_ids": torch.randint(3, 300, (8, 16)), "attention_mask": torch.ones(8, 16, dtype=torch.long),
             "pixel_values": torch.randn(8, 3, 32, 32)}

    def loss():  # this rank's rows only: every collective left in the step is the engine's
        return local_clip_loss(*model(**batch), gather=lambda rows: rows, offset=0, world=1)

    def optimizer_step():
        for _ in range(accumulation):
            if mode == "accumulate":
                with accelerator.accumulate(model):
                    accelerator.backward(loss())
            else:
                accelerator.backward(loss())
        optimizer.step()
        optimizer.zero_grad()

    optimizer_step()  # warm-up: lazy initialisation and first-step collectives
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        optimizer_step()
    collectives = {}  # op -> [calls, elements]
    for event in prof.events():
        backend, _, op = event.name.partition(":")
        if backend in ("gloo", "nccl") and op:
            entry = collectives.setdefault(op, [0, 0])
            entry[0] += 1
            entry[1] += sum(_numel(shape) for shape in event.input_shapes)
    if accelerator.is_main_process:
        Path(out).write_text(json.dumps({op: {"calls": calls, "bytes": elements * BYTES}
                                         for op, (calls, elements) in collectives.items()}))
    accelerator.end_training()


def _numel(shape):
    count = 1
    for dim in shape:
        count *= dim
    return count if shape else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        accumulation, mode, out = args.worker
        return worker(int(accumulation), mode, out)

    engines = ["ddp.yaml"] if args.quick else ["ddp.yaml", "fsdp2.yaml", "zero2.yaml"]
    windows = [4] if args.quick else [1, 4, 16]
    modes = ["accumulate"] if args.quick else ["accumulate", "naive"]
    record = {"bench": "grad_comm", "quick": args.quick, "machine": platform.node(),
              "time": time.strftime("%Y-%m-%d %H:%M"), "points": []}
    print("per optimizer step, 2 CPU processes, tiny CLIP (fp32), a loss with no collectives:")
    print("the process group's collectives, as op: calls / MB")
    with tempfile.TemporaryDirectory() as directory:
        for engine in engines:
            for accumulation in windows:
                for mode in modes:
                    out = Path(directory) / f"{engine}-{accumulation}-{mode}.json"
                    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               str(REPO / "accelerate_configs" / engine), "--num_processes", "2", __file__,
                               "--worker", str(accumulation), mode, str(out)]
                    run = subprocess.run(command, capture_output=True, text=True,
                                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
                    if run.returncode:
                        sys.exit(f"{engine} GA {accumulation} {mode} failed:\n{(run.stdout + run.stderr)[-3000:]}")
                    collectives = json.loads(out.read_text())
                    record["points"].append({"config": engine, "accumulation": accumulation, "mode": mode,
                                             "collectives": collectives})
                    cells = "  ".join(f"{op}: {value['calls']} / {value['bytes'] / 2**20:.2f}"
                                      for op, value in sorted(collectives.items()))
                    print(f"{engine.removesuffix('.yaml'):<6} GA {accumulation:>2} {mode:<10} | {cells}")
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
