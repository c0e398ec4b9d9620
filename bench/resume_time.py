"""How long a resume takes to deliver its first batch, at an early and a late step, as ratios measured in one run.

    python bench/resume_time.py               # 160k rows, up to step 2000, 4 DataLoader workers (a few minutes)
    python bench/resume_time.py --quick       # a smoke run: 6400 rows, up to step 50
    python bench/resume_time.py --workers 0   # the loop's own process reads

The CLIP training stream (`mmrecipes.contrastive.data.build_dataloader`, batch 64, shuffled) over a parquet
stream of small rows (8x8 PNG + caption) written to a temporary directory:
- saved position (what the recipes do): a new loader, `load_state_dict` of the state the
  checkpoint saved after step S (each worker's position, through JSON as a checkpoint holds it),
  until the first batch arrives;
- re-read (what they did before with more than one worker): a new loader, reading and discarding
  S batches, until batch S+1 arrives.
Goal: saved-position resume at step 2000 within 1.2x of step 10. Saved-position timings are the
median of --repeats taken round-robin over the steps (so drift hits every step alike), with the
spread (min-max) beside it; re-read, 100x slower at step 2000, runs once. Appends a JSON line to
bench/results/.
"""

import argparse
import io
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from mmrecipes.contrastive.arguments import DataArgs, ModelArgs
from mmrecipes.contrastive.data import build_dataloader
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.distributed import Ranks

RESULTS = Path(__file__).resolve().parent / "results" / "resume_time.jsonl"


def write_stream(directory: Path, rows: int, shards: int):
    colours = [(i * 37 % 256, i * 91 % 256, i * 53 % 256) for i in range(256)]
    pngs = []
    for colour in colours:
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8), colour).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    per_shard = rows // shards
    for shard in range(shards):
        ids = range(shard * per_shard, (shard + 1) * per_shard)
        table = pa.table({"image": [{"bytes": pngs[i % 256], "path": None} for i in ids],
                          "text": [f"row {i} a colour {i % 256}" for i in ids]})
        pq.write_table(table, directory / f"train-{shard:05d}.parquet")


def first_batch_seconds(make_loader, state=None, skip=0):
    start = time.perf_counter()
    loader = make_loader()
    if state is not None:
        loader.load_state_dict(json.loads(state))
    batches = iter(loader)
    for _ in range(skip + 1):
        next(batches)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--workers", type=int, default=4, help="DataLoader workers")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    options = parser.parse_args()
    rows, steps = (6_400, (5, 20, 50)) if options.quick else (160_000, (10, 500, 1000, 2000))
    _, tokenizer, image_processor = build_contrastive(ModelArgs())
    with tempfile.TemporaryDirectory() as directory:
        write_stream(Path(directory), rows, shards=10)
        args = DataArgs(dataset_name="parquet", data_files=f"{directory}/*.parquet",
                        dataloader_num_workers=options.workers)

        def make_loader():
            return build_dataloader(args, "train", args.data_files, tokenizer, image_processor, batch_size=64,
                                    ranks=Ranks(), shuffle_seed=0)

        states, loader = {}, make_loader()
        for step, _ in enumerate(loader, start=1):
            if step in steps:
                states[step] = json.dumps(loader.state_dict())
            if step == max(steps):
                break
        del loader
        times = {("saved position", step): [] for step in steps}
        for _ in range(options.repeats):
            for step in steps:
                times["saved position", step].append(first_batch_seconds(make_loader, state=states[step]))
        for step in steps:
            times["re-read", step] = [first_batch_seconds(make_loader, skip=step)]
        table = {key: (statistics.median(values), min(values), max(values)) for key, values in times.items()}
    early, late = steps[0], steps[-1]
    print(f"resume to the first batch, {rows} rows of 8x8 PNG + caption, batch 64, {options.workers} DataLoader "
          "workers (seconds: median [min-max])")
    print(f"{'method':<16}" + "".join(f"{'step ' + str(step):>24}" for step in steps) + f"{'late/early':>12}")
    record = {"bench": "resume_time", "quick": options.quick, "rows": rows, "steps": list(steps),
              "workers": options.workers, "machine": platform.node(),
              "processor": platform.processor() or platform.machine(), "time": time.strftime("%Y-%m-%d %H:%M")}
    for method in ("saved position", "re-read"):
        cells = "".join(f"{table[method, step][0]:>9.2f} [{table[method, step][1]:.2f}-{table[method, step][2]:.2f}]"
                        .rjust(24) for step in steps)
        ratio = table[method, late][0] / table[method, early][0]
        print(f"{method:<16}{cells}{ratio:>12.2f}")
        record[method.replace(" ", "_")] = {"seconds": [table[method, step][0] for step in steps], "ratio": ratio}
    with open(options.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
