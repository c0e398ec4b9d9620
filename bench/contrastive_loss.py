"""Per-rank peak memory and forward+backward time of the contrastive loss: mmrecipes (`clip_loss`,
tiled, and the SigLIP ring) vs open_clip's local loss (materialised [b, N] logits), for b rows per
rank and N = W*b rows over all ranks.

    python bench/contrastive_loss.py                  # CPU here; CUDA when a GPU is present
    python bench/contrastive_loss.py --quick          # a smoke run at toy sizes

W ranks are simulated in one process: the rank's own rows plus random rows standing in for the
other ranks' gathered features (the gather itself costs the same in every method; the SigLIP ring
receives them one [b, D] block per hand-over instead). Memory is
measured from the inputs' allocation to the end of backward, gathered rows included: CPU peak
RSS in a fresh subprocess per point, CUDA `max_memory_allocated`. Ratios are against the local
loss in the same run; times are medians over repeats with their spread, because single runs of
the CPU times moved by 15-30% between runs. Appends a JSON line to bench/results/contrastive_loss.jsonl.
"""

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mmrecipes.contrastive.losses import local_clip_loss, local_siglip_loss

RESULTS = Path(__file__).resolve().parent / "results" / "contrastive_loss.jsonl"

DIM = 512  # ViT-B embedding width


def open_clip_local_loss(images, texts, scale, *, gather, offset):
    """open_clip ClipLoss(local_loss=True, gather_with_grad=True): gather both, logits of this rank's rows vs all."""
    all_images, all_texts = gather(images), gather(texts)
    labels = torch.arange(len(images), device=images.device) + offset
    return (F.cross_entropy(scale * images @ all_texts.T, labels) + F.cross_entropy(scale * texts @ all_images.T,
                                                                                    labels)) / 2


METHODS = {
    "local": lambda *a, gather, world, tile: open_clip_local_loss(*a, gather=gather, offset=0),
    "mmrecipes": lambda *a, gather, world, tile: local_clip_loss(*a, gather=gather, offset=0, world=world),
    "mmrecipes_tiled": lambda *a, gather, world, tile: local_clip_loss(*a, gather=gather, offset=0, world=world,
                                                                       tile_size=tile),
    "siglip": None,  # run() hands it the other ranks' text blocks one at a time, as the ring does
}


def inputs(rows, world, device):
    generator = torch.Generator(device).manual_seed(0)

    def make(n):
        return F.normalize(torch.randn(n, DIM, device=device, generator=generator), dim=-1)

    images, texts = make(rows).requires_grad_(), make(rows).requires_grad_()
    others = [make(rows * (world - 1)), make(rows * (world - 1))]
    return images, texts, others, torch.tensor([14.3], device=device, requires_grad=True)


def run(method, rows, world, tile, images, texts, others, scale):
    """Loss forward + backward; the gather is torch.cat with the other ranks' rows (the same buffer
    and autograd shape as the collective, whose backward would reduce-scatter instead of slice)."""
    def gather(local):
        return torch.cat([local, others[0] if local is images else others[1]])

    if method == "siglip":
        blocks = iter(others[1].split(rows))
        loss = local_siglip_loss(images, texts, scale, torch.tensor([-10.0], device=scale.device),
                                 sizes=[rows] * world, rank=0, pass_block=lambda block: next(blocks))
    else:
        loss = METHODS[method](images, texts, scale, gather=gather, world=world, tile=tile)
    loss.backward()
    images.grad = texts.grad = scale.grad = None


def peak_bytes(method, rows, world, tile, device, fresh=True):
    if device.type == "cuda":
        tensors = inputs(rows, world, device)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(method, rows, world, tile, *tensors)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    if not fresh:  # --quick: a smoke run in this process (the high-water mark is not this point's)
        return child_peak(method, rows, world, tile)
    # CPU: a fresh process, so the high-water mark belongs to this point alone.
    out = subprocess.run([sys.executable, __file__, "--child", method, str(rows), str(world), str(tile)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def child(method, rows, world, tile):
    print(json.dumps({"peak_bytes": child_peak(method, rows, world, tile)}))


def child_peak(method, rows, world, tile) -> int:
    tensors = inputs(rows, world, torch.device("cpu"))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(method, rows, world, tile, *tensors)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024


def seconds(method, rows, world, tile, device, repeats):
    """Forward+backward times of `repeats` runs after one warm-up."""
    tensors = inputs(rows, world, device)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(method, rows, world, tile, *tensors)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run at toy sizes")
    parser.add_argument("--tile_size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, rows, world, tile = args.child
        return child(method, int(rows), int(world), int(tile))

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    grid = [(128, 2), (256, 4)] if args.quick else [(1024, 8), (2048, 8), (4096, 2), (4096, 4), (4096, 8), (8192, 8)]
    tile = 64 if args.quick else args.tile_size
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), D={DIM}, "
          f"tile_size={tile}, threads={torch.get_num_threads()}")
    header = (f"{'b':>6} {'W':>3} {'N':>7} | {'local':>9} {'mmrecipes':>10} {'tiled':>9} {'siglip':>9} | "
              f"{'ours/local':>10} {'tiled/local':>11} {'siglip/ours':>11}")
    print("\npeak memory per rank (MB), loss forward+backward incl. gathered rows")
    print(header)
    record = {"bench": "contrastive_loss", "quick": args.quick, "device": str(device), "machine": platform.node(),
              "threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%d %H:%M"), "dim": DIM,
              "tile_size": tile, "points": []}
    for rows, world in grid:
        peak = {m: peak_bytes(m, rows, world, tile, device, fresh=not args.quick) / 2**20 for m in METHODS}
        print(row(rows, world, peak, ".1f"))
        record["points"].append({"b": rows, "W": world, "peak_mb": peak})
    print(f"\nforward+backward time per rank (s, median of {args.repeats} after a warm-up, taken round-robin over the "
          "methods); spread: the largest (max-min)/median of the four")
    print(header + f" {'spread':>7}")
    # The largest CPU point takes minutes: not timed there.
    for point, (rows, world) in zip(record["points"], grid[:-1] if device.type == "cpu" else grid):
        times = {m: [] for m in METHODS}
        for _ in range(args.repeats):
            for method in METHODS:
                times[method] += seconds(method, rows, world, tile, device, repeats=1)
        median = {m: statistics.median(values) for m, values in times.items()}
        spread = max((max(values) - min(values)) / median[m] for m, values in times.items())
        print(row(rows, world, median, ".3f") + f" {spread:>7.0%}")
        point |= {"seconds": times, "median_s": median}
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


def row(rows, world, value, spec):
    """One table line: the four methods' values, then the ratios (siglip against `clip_loss`)."""
    return (f"{rows:>6} {world:>3} {rows * world:>7} | {value['local']:>9{spec}} {value['mmrecipes']:>10{spec}} "
            f"{value['mmrecipes_tiled']:>9{spec}} {value['siglip']:>9{spec}} | "
            f"{ratio(value['mmrecipes'], value['local']):>10} {ratio(value['mmrecipes_tiled'], value['local']):>11} "
            f"{ratio(value['siglip'], value['mmrecipes']):>11}")


def ratio(value, base) -> str:
    """n/a where the base is 0: at toy sizes a loss can fit in memory the process already had (no RSS growth)."""
    return f"{value / base:.3f}" if base else "n/a"


if __name__ == "__main__":
    main()
