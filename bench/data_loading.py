"""Data loading: the CLIP loader alone against a per-row PIL + torchvision pipeline, and the default run's data_wait.

    python bench/data_loading.py              # about 3 minutes on 2 cores
    python bench/data_loading.py --quick      # a smoke run (CI): tiny sizes, the recipe with 1 worker only

1. Loader alone, samples/s over the embedded training rows (batch 64, 0 workers, median of
   --repeats after a warm-up round, taken round-robin): `mmrecipes.contrastive.data.build_dataloader`
   (streamed, batched decode + image processor + tokeniser, collated) against the pipeline the
   first version of the recipe had: a map-style Dataset whose `__getitem__` decodes one PIL image, builds a
   `transforms.Compose` and tokenises one caption with `padding="max_length"`, under the default
   collate (and the tokenizers library's default thread pool).
2. `data_wait` of the default recipe (`recipes/clip_pretrain.py`, mean over its log lines) with
   `--dataloader_num_workers 0` (the CPU default) against 1.
3. A worker's pixels at ViT-B/16 size (64 random 256 px images -> 224): `processed_pixels` finished in
   the worker (float32) against uint8 (what the loader ships since 2026-11-24; `images.to_device`
   rescales and normalises on the device): milliseconds per batch and bytes per batch.
4. A VLM worker's pixels: LLaVA-1.5's image processor (336 px) and Qwen2-VL's (its defaults, patches) on 8 random
   640 x 480 images, as the float32 they finish themselves and as the uint8 the VLM loader ships where the
   processor gives its own floats that way (`mmrecipes.images.uint8_normalization`, since 2026-11-25).
Prints the ratios and appends a JSON line to bench/results/data_loading.jsonl.
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from torchvision import transforms
from transformers import CLIPImageProcessor, Qwen2VLImageProcessor

from mmrecipes.contrastive.arguments import DataArgs, ModelArgs
from mmrecipes.contrastive.data import build_dataloader
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.distributed import Ranks
from mmrecipes.images import UINT8_PIXELS, decode_image, finish_pixels, processed_pixels, uint8_normalization
from mmrecipes.paths import SHAPES_DATA

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "data_loading.jsonl"


class PerRowPILPipeline(torch.utils.data.Dataset):
    """One row at a time, as a per-row PIL + torchvision pipeline does it (the baseline, not something to copy)."""

    def __init__(self, rows, tokenizer, image_processor, max_length):
        self.rows, self.tokenizer, self.max_length = rows, tokenizer, max_length
        self.size = image_processor.crop_size["height"]
        self.mean, self.std = image_processor.image_mean, image_processor.image_std

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        row = self.rows[index]
        transform = transforms.Compose([transforms.Resize(self.size), transforms.CenterCrop(self.size),
                                        transforms.ToTensor(), transforms.Normalize(self.mean, self.std)])
        text = self.tokenizer(row["text"] or "", padding="max_length", truncation=True, max_length=self.max_length,
                              return_tensors="pt")
        return {"pixel_values": transform(row["image"].convert("RGB")), "input_ids": text["input_ids"][0],
                "attention_mask": text["attention_mask"][0]}


def samples_per_second(loader, limit):
    start, samples = time.perf_counter(), 0
    for batch in loader:
        samples += len(batch["input_ids"])
        if samples >= limit:
            break
    return samples / (time.perf_counter() - start)


def recipe_data_wait(workers: int, steps: int, output_dir: str) -> tuple[float, float]:
    """(mean data_wait over the log lines, wall seconds) of the default recipe with `workers`."""
    start = time.perf_counter()
    log = subprocess.run([sys.executable, str(REPO / "recipes" / "clip_pretrain.py"), "--report_to", "none",
                          "--dataloader_num_workers", str(workers), "--max_steps", str(steps), "--eval_split", "",
                          "--output_dir", output_dir],
                         capture_output=True, text=True, check=True).stdout
    waits = [float(value) for value in re.findall(r"\| data_wait ([\d.]+) \|", log)]
    return statistics.mean(waits), time.perf_counter() - start


def vlm_worker_pixels(image_processor, rounds: int) -> dict:
    """{dtype: (median ms per call, bytes)} of one image processor call on 8 random 640 x 480 images, as float32 and
    as uint8 (`UINT8_PIXELS`); the uint8 values finished as `to_device` does equal the floats to the bit."""
    generator = torch.Generator().manual_seed(1)
    images = [transforms.functional.to_pil_image(torch.randint(0, 256, (3, 480, 640), dtype=torch.uint8,
                                                               generator=generator)) for _ in range(8)]
    normalization = uint8_normalization(image_processor)
    assert normalization is not None, type(image_processor).__name__
    times, sizes, outputs = {"float32": [], "uint8": []}, {}, {}
    for round_ in range(rounds + 1):
        for dtype, flags in (("float32", {}), ("uint8", UINT8_PIXELS)):
            start = time.perf_counter()
            outputs[dtype] = image_processor(images=images, return_tensors="pt", **flags)["pixel_values"]
            if round_:
                times[dtype].append((time.perf_counter() - start) * 1000)
            sizes[dtype] = outputs[dtype].numel() * outputs[dtype].element_size()
    assert torch.equal(finish_pixels(outputs["uint8"], normalization), outputs["float32"])
    return {dtype: (statistics.median(times[dtype]), sizes[dtype]) for dtype in times}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    limit, steps, repeats = (256, 4, 1) if args.quick else (4096, 300, args.repeats)

    _, tokenizer, image_processor = build_contrastive(ModelArgs())
    data_args = DataArgs(dataloader_num_workers=0)
    # The same rows less the deliberately broken ones, which the baseline cannot skip.
    rows = datasets.load_dataset(str(SHAPES_DATA), split="train").cast_column("image", datasets.Image(decode=False))
    rows = rows.filter(lambda row: bool(row["text"] and row["text"].strip())
                       and decode_image(row["image"], data_args.max_image_pixels)[0] is not None)
    rows = rows.cast_column("image", datasets.Image())

    def ours():
        return build_dataloader(data_args, "train", None, tokenizer, image_processor, batch_size=64,
                                ranks=Ranks(), shuffle_seed=0)

    def per_row_pil():
        pipeline = PerRowPILPipeline(rows, tokenizer, image_processor, tokenizer.model_max_length)
        return torch.utils.data.DataLoader(pipeline, batch_size=64, shuffle=True)

    # mmrecipes.contrastive.data turns the tokenizer's thread pool off (TOKENIZERS_PARALLELISM, read at every call);
    # the baseline runs with the tokenizers default, as the per-row pipeline would.
    tokenizer_parallelism = {"mmrecipes": "false", "per_row_pil": "true"}
    pipelines = (("mmrecipes", ours), ("per_row_pil", per_row_pil))
    measured = {name: [] for name, _ in pipelines}
    for round_ in range(repeats + 1):  # round 0 warms up: first-call costs are not the pipelines'
        for name, make in pipelines:
            os.environ["TOKENIZERS_PARALLELISM"] = tokenizer_parallelism[name]
            rate = samples_per_second(make(), limit)
            if round_:
                measured[name].append(rate)
    median = {name: statistics.median(values) for name, values in measured.items()}
    ratio = median["mmrecipes"] / median["per_row_pil"]
    print(f"loader alone, samples/s (batch 64, 0 workers, {limit} rows, median of {repeats}; min-max)")
    for name, values in measured.items():
        print(f"  {name:<10} {median[name]:8.0f}   ({min(values):.0f}-{max(values):.0f})")
    print(f"  mmrecipes / per_row_pil: {ratio:.2f}x")

    with tempfile.TemporaryDirectory() as output_dir:
        waits = {workers: recipe_data_wait(workers, steps, output_dir) for workers in ((1,) if args.quick else (0, 1))}
    print(f"\ndefault recipe, {steps} steps: data_wait (mean over log lines), wall s")
    for workers, (wait, wall) in waits.items():
        print(f"  --dataloader_num_workers {workers}: data_wait {wait:.3f}  wall {wall:.1f} s")

    vit_processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    generator = torch.Generator().manual_seed(0)
    images = [transforms.functional.to_pil_image(torch.randint(0, 256, (3, 256, 256), dtype=torch.uint8,
                                                               generator=generator)) for _ in range(64)]
    pixel_times, pixel_bytes = {"float32": [], "uint8": []}, {}
    for round_ in range(3 * repeats + 1):
        for name, times in pixel_times.items():
            start = time.perf_counter()
            batch = processed_pixels(vit_processor, images, normalize=name == "float32")
            if round_:
                times.append((time.perf_counter() - start) * 1000)
            pixel_bytes[name] = batch.numel() * batch.element_size()
    pixel_ms = {name: statistics.median(times) for name, times in pixel_times.items()}
    print("\nworker pixels, 64 images 256 -> 224 px (median ms per batch; MiB per batch):")
    for name, ms in pixel_ms.items():
        print(f"  {name:<8} {ms:7.1f} ms  {pixel_bytes[name] / 2**20:6.2f} MiB")
    print(f"  uint8 / float32: {pixel_ms['uint8'] / pixel_ms['float32']:.2f}x the time, "
          f"{pixel_bytes['uint8'] / pixel_bytes['float32']:.2f}x the bytes")

    vlm_pixels = {name: vlm_worker_pixels(processor, max(repeats, 3)) for name, processor in (
        ("llava_1_5_336px", CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})),
        ("qwen2_vl", Qwen2VLImageProcessor()))}
    print("\nVLM worker pixels, 8 images 640 x 480 (median ms per call; MiB):")
    for name, measured_pixels in vlm_pixels.items():
        for dtype, (ms, size) in measured_pixels.items():
            print(f"  {name:<16} {dtype:<8} {ms:7.1f} ms  {size / 2**20:6.2f} MiB")
        (float_ms, float_size), (uint8_ms, uint8_size) = measured_pixels.values()
        print(f"  {name:<16} uint8 / float32: {uint8_ms / float_ms:.2f}x the time, "
              f"{uint8_size / float_size:.2f}x the bytes")

    record = {"bench": "data_loading", "quick": args.quick, "machine": platform.node(), "processor": platform.machine(),
              "cpus": torch.get_num_threads(), "time": time.strftime("%Y-%m-%d %H:%M"),
              "loader_samples_per_s": {name: {"median": median[name], "all": values}
                                       for name, values in measured.items()},
              "loader_ratio": ratio,
              "recipe": {f"workers_{workers}": {"data_wait": wait, "wall_s": wall}
                         for workers, (wait, wall) in waits.items()},
              "worker_pixels_ms": pixel_ms,
              "worker_pixels_bytes": pixel_bytes,
              "vlm_worker_pixels": vlm_pixels}
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
