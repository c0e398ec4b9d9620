"""The CLIP recipe on webdataset shards against its own compute-only step and open_clip's loop, in one run.

    python bench/gpu_recipe_throughput.py                       # on a GPU: ViT-B/16 shapes, bf16, batch 256
    python bench/gpu_recipe_throughput.py --toy                 # anywhere: a toy CLIP, 4 small shards
    python bench/gpu_recipe_throughput.py --toy --torch_compile false   # CI: no compile time
    python bench/gpu_recipe_throughput.py --recipe_args "--fused_adamw false"   # any recipe flag
    python bench/gpu_recipe_throughput.py --mode vlm            # vlm_finetune.py, a ~1B Llava at 336 px

1. Writes `--shards` tars of `--shard_size` samples in img2dataset's layout (`{key}.jpg` 256 px JPEG,
   `{key}.txt`, `{key}.json`): a shape of one colour on another, and its caption; `--workers` processes.
2. Saves a CLIP directory with openai/clip-vit-base-patch16's shapes (`gpu_clip_throughput.VIT_B_16`:
   vision 768x12 at 224 px / 16, text 512x12, 77 positions, vocab 49408, projection 512; `--toy`: its
   TOY sizes) and the embedded tokenizer, as `--model_name_or_path` reads it.
3. The compute-only step: `gpu_clip_throughput.measure` (the batch already on the device, captions
   padded to 77 tokens as open_clip pads them, where the recipe pads to each batch's longest; whole-model
   compile unless `--torch_compile false`).
4. `clip_pretrain.py --model_name_or_path DIR --dataset_name webdataset` on the shards (`--torch_compile`,
   `--dataloader_num_workers`): samples/s of its 10-step log windows after the first.
5. If `open_clip_train` is installed (open_clip_torch==3.3.0 with webdataset==0.2.86; not with `--toy`:
   open_clip has no toy model), its own loop on the same shards: `--model ViT-B-16 --precision amp_bf16
   --torchcompile`, samples/s of its log lines after the first.
Prints the ratios against issue 18's goals (recipe >= 0.9x the compute-only step and >= 1.3x open_clip,
windows within 1.2x of each other) and appends a JSON line to bench/results/gpu_recipe_throughput.jsonl.

`--mode vlm` does the same for `vlm_finetune.py` on the embedded conversations: a Llava saved from
config (`--toy`: the recipe's tiny one) with a CLIP-L/14-336-shaped tower (1024 x 24, 16 heads of 64)
and a Llama-shaped LM (2048 x 16, 16 heads of 128, 1.1B parameters in all); the compute-only step is
`VLMForTraining` on one of the recipe's own image batches already on the device (fused AdamW where CUDA is),
against the recipe's tokens/s windows; MFU from its log line. Both compute-only steps use the recipe's own
precision (`--mixed_precision auto`): bf16 autocast on a GPU that has it, fp32 elsewhere (bf16 on a CPU is
several times slower, which made the toy ratio meaningless).
"""

import argparse
import json
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from io import BytesIO
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

from gpu_clip_throughput import TOY, VIT_B_16, build, measure, timed_steps
from mmrecipes.contrastive.flops import clip_train_flops_per_sample
from mmrecipes.distributed import Ranks
from mmrecipes.images import to_device
from mmrecipes.paths import TINY_TOKENIZER
from mmrecipes.throughput import peak_flops
from mmrecipes.training import resolve_mixed_precision
from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.module_groups import apply_train_modules, module_groups
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import build_chat_dataloader
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "gpu_recipe_throughput.jsonl"
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
           "purple": (140, 60, 180), "orange": (240, 140, 30), "white": (245, 245, 245), "black": (15, 15, 15)}
SHAPES = ("square", "circle", "triangle")
WINDOW = re.compile(r"step (\d+)/\d+ \|.*?\| samples/s ([\d.]+) \|.*?\| data_wait ([\d.]+)")
VLM_WINDOW = re.compile(r"step (\d+)/\d+ \|.*?\| tokens/s ([\d.]+) \| MFU ([\d.]+%|n/a) \| data_wait ([\d.]+)")
# ~1.1B: a CLIP-L/14-336-shaped tower and a Llama-shaped LM, head dims 64 and 128 (VLMModelArgs + heads).
VLM_1B = dict(image_size=336, patch_size=14, vision_hidden_size=1024, vision_layers=24, text_hidden_size=2048,
              text_layers=16)
VLM_HEADS = 16
RECIPE_BF16 = resolve_mixed_precision("auto") == "bf16"
OPEN_CLIP_WINDOW = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/.*?([\d.]+)/s/gpu")


def write_shard(directory: str, index: int, size: int, pixels: int) -> None:
    """One img2dataset-layout tar of `size` samples: a coloured shape on a coloured background."""
    rng = random.Random(index)
    with tarfile.open(Path(directory) / f"train-{index:05d}.tar", "w") as tar:
        for row in range(size):
            key = f"{index:05d}{row:04d}"
            colour, background = rng.sample(sorted(COLOURS), 2)
            shape = rng.choice(SHAPES)
            image = Image.new("RGB", (pixels, pixels), COLOURS[background])
            box = sorted(rng.sample(range(pixels), 2)), sorted(rng.sample(range(pixels), 2))
            corners = [box[0][0], box[1][0], max(box[0][1], box[0][0] + 8), max(box[1][1], box[1][0] + 8)]
            draw = ImageDraw.Draw(image)
            if shape == "circle":
                draw.ellipse(corners, fill=COLOURS[colour])
            elif shape == "square":
                draw.rectangle(corners, fill=COLOURS[colour])
            else:
                apex = ((corners[0] + corners[2]) / 2, corners[1])
                draw.polygon([(corners[0], corners[3]), (corners[2], corners[3]), apex], fill=COLOURS[colour])
            jpeg = BytesIO()
            image.save(jpeg, format="JPEG", quality=90)
            caption = f"a {colour} {shape} on a {background} background"
            for suffix, data in (("jpg", jpeg.getvalue()), ("txt", caption.encode()),
                                 ("json", json.dumps({"key": key, "caption": caption}).encode())):
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, BytesIO(data))


def save_clip(sizes: dict, directory: Path) -> None:
    """A CLIP directory `--model_name_or_path` loads: config with these shapes, the embedded tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER, model_max_length=sizes["text"]["max_position_embeddings"])
    text = dict(sizes["text"], vocab_size=max(sizes["text"]["vocab_size"], len(tokenizer)),
                eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    config = CLIPConfig(text_config=text, vision_config=sizes["vision"], projection_dim=sizes["projection_dim"])
    CLIPModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    image_size = sizes["vision"]["image_size"]
    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size}).save_pretrained(directory)


def windows(log: str, pattern: re.Pattern) -> list[float]:
    """samples/s of each log window after the first (which holds start-up and compilation)."""
    return [float(match[1]) for match in pattern.findall(log)][1:]


def run(command: list[str], timeout: int) -> str:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log = (result.stdout + result.stderr).replace("\r", "\n")
    if result.returncode:
        raise RuntimeError(f"{shlex.join(command)} exited {result.returncode}:\n{log[-4000:]}")
    return log


def save_vlm_checkpoint(toy: bool, directory: Path) -> None:
    """A Llava directory `--model_name_or_path` loads: the recipe's tiny one, or ~1.1B from config."""
    model, processor = load_vlm(VLMModelArgs(**({} if toy else VLM_1B)))
    if not toy:
        config = model.config
        config.vision_config.num_attention_heads = config.text_config.num_attention_heads = VLM_HEADS
        config.text_config.num_key_value_heads = VLM_HEADS
        config.text_config.intermediate_size = 5632
        model = type(model)(config)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)


def vlm_compute_only(directory: Path, batch_size: int, max_length: int, steps: int, device) -> float:
    """LM tokens/s of the recipe's step on one of its own image batches, already on the device."""
    model, processor = load_vlm(VLMModelArgs(model_name_or_path=str(directory)))
    dummy = dummy_image_inputs(model, processor)
    trainable = apply_train_modules(module_groups(model, dummy), "projector,language_model")
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy)
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    loader = build_chat_dataloader(ChatDataArgs(max_length=max_length, dataloader_num_workers=0), labeller, collator,
                                   batch_size=batch_size, ranks=Ranks(), shuffle_seed=0)
    batch = next(batch for batch in loader if not batch["dummy_image"])
    tokens = int(batch["attention_mask"].sum())
    inputs = to_device(batch, device)
    step = VLMForTraining(model).to(device)
    optimizer = torch.optim.AdamW([p for params in trainable.values() for p in params], lr=1e-5,
                                  fused=device.type == "cuda")

    def train_step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=RECIPE_BF16):
            loss = step(inputs, LossSum()).summed
        loss.backward()
        torch.nn.utils.clip_grad_norm_(step.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return steps * tokens / timed_steps(train_step, steps=steps, warmup=2, device=device)


def clip_mode(args, scratch: Path, toy: bool, device) -> dict:
    start = time.perf_counter()
    with ProcessPoolExecutor(max(1, args.workers)) as pool:
        list(pool.map(write_shard, [str(scratch)] * args.shards, range(args.shards), [args.shard_size] * args.shards,
                      [256] * args.shards))
    print(f"wrote {args.shards} shards x {args.shard_size} samples of 256 px JPEG in {time.perf_counter() - start:.1f} "
          "s")
    sizes = TOY if toy else VIT_B_16
    save_clip(sizes, scratch / "clip")
    shards = f"{scratch}/train-{{00000..{args.shards - 1:05d}}}.tar"

    torch.manual_seed(0)
    text_len, image_size = sizes["text"]["max_position_embeddings"], sizes["vision"]["image_size"]
    batch = {"input_ids": torch.randint(3, sizes["text"]["vocab_size"], (args.batch_size, text_len), device=device),
             "attention_mask": torch.ones(args.batch_size, text_len, dtype=torch.long, device=device),
             "pixel_values": torch.randn(args.batch_size, 3, image_size, image_size, device=device)}
    model = build(sizes, device)
    flops = clip_train_flops_per_sample(model, text_len)
    compute_only, _ = measure(model, batch, steps=5 if toy else 20, warmup=2 if toy else 5,
                              compile_model=args.torch_compile == "true", device=device, bf16=RECIPE_BF16)
    del model, batch

    log = run([sys.executable, "recipes/clip_pretrain.py", "--model_name_or_path", str(scratch / "clip"),
               "--dataset_name", "webdataset", "--data_files", shards, "--image_column", "jpg", "--caption_column",
               "txt",
               "--eval_split", "", "--zeroshot_dataset", "", "--per_device_train_batch_size", str(args.batch_size),
               "--max_steps", str(args.max_steps), "--logging_steps", "10", "--warmup_steps", "10",
               "--torch_compile", args.torch_compile, "--dataloader_num_workers", str(args.workers), "--report_to",
               "none",
               "--output_dir", str(scratch / "recipe"), *shlex.split(args.recipe_args)], timeout=3600)
    recipe = windows(log, WINDOW)
    result = {"unit": "samples/s", "compute_only": compute_only, "recipe_windows": recipe,
              "data_wait": [float(match[2]) for match in WINDOW.findall(log)][1:],
              "mfu": lambda value: f"{value * flops / peak_flops():.1%}" if peak_flops() else "n/a"}
    if not toy and _installed("open_clip_train"):
        log = run([sys.executable, "-m", "open_clip_train.main", "--train-data", shards, "--dataset-type", "webdataset",
                   "--train-num-samples", str(args.shards * args.shard_size), "--batch-size", str(args.batch_size),
                   "--model", "ViT-B-16", "--precision", "amp_bf16", "--torchcompile", "--workers", str(args.workers),
                   "--epochs", "1", "--warmup", "10", "--log-every-n-steps", "10", "--save-frequency", "0",
                   "--report-to", "", "--logs", str(scratch / "open_clip")], timeout=3600)
        result["open_clip_windows"] = windows(log, OPEN_CLIP_WINDOW)
    return result


def vlm_mode(args, scratch: Path, toy: bool, device) -> dict:
    save_vlm_checkpoint(toy, scratch / "vlm")
    max_length = 256 if toy else 1024  # 576 image tokens at 336 px / 14
    compute_only = vlm_compute_only(scratch / "vlm", args.batch_size, max_length, 3 if toy else 20, device)
    log = run([sys.executable, "recipes/vlm_finetune.py", "--model_name_or_path", str(scratch / "vlm"),
               "--max_length", str(max_length), "--per_device_train_batch_size", str(args.batch_size),
               "--max_steps", str(args.max_steps), "--logging_steps", "10", "--warmup_steps", "10",
               "--eval_dataset_name", "", "--torch_compile", args.torch_compile,
               "--dataloader_num_workers", str(args.workers), "--report_to", "none",
               "--output_dir", str(scratch / "recipe"), *shlex.split(args.recipe_args)], timeout=3600)
    matches = VLM_WINDOW.findall(log)[1:]
    return {"unit": "tokens/s", "compute_only": compute_only, "recipe_windows": [float(m[1]) for m in matches],
            "data_wait": [float(m[3]) for m in matches], "recipe_mfu": [m[2] for m in matches],
            "mfu": lambda value: "n/a"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["clip", "vlm"], default="clip")
    parser.add_argument("--toy", action="store_true", help="toy models and data (the default without a GPU)")
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--shard_size", type=int, default=800)
    parser.add_argument("--batch_size", type=int, default=None, help="default: 256 (clip), 16 (vlm)")
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="DataLoader workers")
    parser.add_argument("--torch_compile", choices=["true", "false"], default="true",
                        help="compute-only step and recipe")
    parser.add_argument("--recipe_args", default="", help="more recipe flags, one string")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    toy = args.toy or device.type != "cuda"
    args.batch_size = args.batch_size or (256 if args.mode == "clip" else 16)
    if toy:
        args.shards, args.shard_size, args.batch_size, args.max_steps = 4, 48, 8, 20
        args.workers = min(args.workers, 1)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "CPU"
    with tempfile.TemporaryDirectory() as scratch:
        result = (clip_mode if args.mode == "clip" else vlm_mode)(args, Path(scratch), toy, device)

    unit, compute_only, recipe = result["unit"], result["compute_only"], result["recipe_windows"]
    median = statistics.median(recipe)
    print(f"{name}, torch {torch.__version__}, {args.mode}{' (toy)' if toy else ''}, batch {args.batch_size}, "
          f"{args.workers} workers, compile {args.torch_compile}")
    print(f"compute-only step (batch on the device): {compute_only:.1f} {unit}, MFU {result['mfu'](compute_only)}")
    print(f"recipe windows: {', '.join(f'{value:.0f}' for value in recipe)} {unit}; median {median:.1f} "
          f"(MFU {', '.join(result['recipe_mfu']) if 'recipe_mfu' in result else result['mfu'](median)}), "
          f"data_wait median {statistics.median(result['data_wait']):.3f}")
    ratios = {"recipe_vs_compute_only": median / compute_only, "window_spread": max(recipe) / min(recipe)}
    if result.get("open_clip_windows"):
        open_clip = result["open_clip_windows"]
        ratios["recipe_vs_open_clip"] = median / statistics.median(open_clip)
        print(f"open_clip windows: {', '.join(f'{value:.0f}' for value in open_clip)} {unit}; "
              f"median {statistics.median(open_clip):.1f}")
    goals = {"recipe_vs_compute_only": ">= 0.9", "recipe_vs_open_clip": ">= 1.3", "window_spread": "<= 1.2"}
    for ratio, value in ratios.items():
        print(f"{ratio} {value:.2f} (goal {goals[ratio]})")
    record = {"bench": "gpu_recipe_throughput", "mode": args.mode, "quick": toy, "device": name,
              "torch": torch.__version__, "batch_size": args.batch_size, "workers": args.workers,
              "torch_compile": args.torch_compile, "recipe_args": args.recipe_args, "ratios": ratios,
              "time": time.strftime("%Y-%m-%d %H:%M")} | {key: value for key, value in result.items() if key != "mfu"}
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


def _installed(module: str) -> bool:
    from importlib.util import find_spec
    return find_spec(module) is not None


if __name__ == "__main__":
    main()
