"""What FLIP's patch dropout (`--patch_dropout`, mmrecipes.contrastive.patch_dropout) saves per training step, as a
ratio measured in one run on the same model and batch.

    python bench/patch_dropout.py            # a small ViT-B/16-shaped CLIP (224 px, 196 patches), CPU or GPU
    python bench/patch_dropout.py --quick    # the toy CLIP (16 patches), to know it starts

The step is `gpu_clip_throughput.py`'s (the recipe's model, clip_loss, AdamW, clipping; bf16 autocast on a GPU
that has it, fp32 elsewhere, as the recipe runs), timed after warm-up with every patch, then with the hook keeping
half of them. The text tower is the same in both, so the ratio is above what the image tower alone gains.
Appends a JSON line to bench/results/patch_dropout.jsonl.
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from gpu_clip_throughput import TOY, build, measure
from mmrecipes.contrastive.patch_dropout import add_patch_dropout
from mmrecipes.training import resolve_mixed_precision

RESULTS = Path(__file__).resolve().parent / "results" / "patch_dropout.jsonl"
SMALL_VIT = dict(text=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                           max_position_embeddings=32, vocab_size=512, bos_token_id=510, eos_token_id=511),
                 vision=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                             image_size=224, patch_size=16),
                 projection_dim=256)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--p", type=float, default=0.5, help="the share of patches dropped")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes, steps, warmup = (TOY, 2, 1) if args.quick else (SMALL_VIT, 10, 3)
    torch.manual_seed(0)
    text_len, image_size = sizes["text"]["max_position_embeddings"], sizes["vision"]["image_size"]
    batch = {"input_ids": torch.randint(3, 500, (args.batch_size, text_len), device=device),
             "attention_mask": torch.ones(args.batch_size, text_len, dtype=torch.long, device=device),
             "pixel_values": torch.randn(args.batch_size, 3, image_size, image_size, device=device)}
    model = build(sizes, device)
    options = dict(steps=steps, warmup=warmup, compile_model=False, device=device,
                   bf16=resolve_mixed_precision("auto") == "bf16")
    every_patch, _ = measure(model, batch, **options)
    print(add_patch_dropout(model, args.p))
    dropped, _ = measure(model, batch, **options)
    ratio = dropped / every_patch
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "CPU"
    print(f"{name}, torch {torch.__version__}, batch {args.batch_size}, {steps} timed steps after {warmup}")
    print(f"samples/s: every patch {every_patch:.1f}, patch dropout {args.p} {dropped:.1f}; speed-up {ratio:.2f}x")
    record = {"bench": "patch_dropout", "quick": args.quick, "machine": platform.node(), "device": name,
              "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M"), "p": args.p,
              "batch_size": args.batch_size, "samples_per_s": {"every_patch": every_patch, "dropped": dropped},
              "speedup": ratio}
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
