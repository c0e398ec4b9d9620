"""CLIP training throughput and MFU on one GPU: a ViT-B/16-sized CLIP built from its config, bf16
autocast, synthetic data already on the device, `torch.compile` off and on.

    python bench/gpu_clip_throughput.py                  # on a GPU (ViT-B/16: 224 px, 77 tokens)
    python bench/gpu_clip_throughput.py --toy            # anywhere, CPU included: a toy model, to know it starts

The step is the recipe's: `CLIPForContrastiveTraining` (sdpa attention), `clip_loss`, AdamW (fused
on CUDA), gradient clipping. FLOPs per sample are the recipe's estimate
(`mmrecipes.contrastive.flops.clip_train_flops_per_sample`: 6 N per token plus attention, both towers);
MFU divides the achieved FLOP/s by the card's dense bf16 peak (`mmrecipes.throughput.peak_flops`).
Anchors: open_clip ViT-B/16 trains at about 330 samples/s per A100 (11-13% MFU); NeMo's CLIP
reports about 21% MFU on H100. Prints a table and appends a JSON line to
bench/results/gpu_clip_throughput.jsonl.
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers import CLIPConfig

from mmrecipes.contrastive.flops import clip_train_flops_per_sample
from mmrecipes.contrastive.losses import clip_loss
from mmrecipes.contrastive.models import CLIPForContrastiveTraining
from mmrecipes.throughput import peak_flops

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_clip_throughput.jsonl"
VIT_B_16 = dict(text=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                          max_position_embeddings=77, vocab_size=49408),
                vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                            image_size=224, patch_size=16),
                projection_dim=512)
TOY = dict(text=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                     max_position_embeddings=16, vocab_size=512, bos_token_id=510, eos_token_id=511),
           vision=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                       image_size=32, patch_size=8),
           projection_dim=64)


def build(sizes, device):
    config = CLIPConfig(text_config=sizes["text"], vision_config=sizes["vision"],
                        projection_dim=sizes["projection_dim"])
    config._attn_implementation = "sdpa"
    for tower in (config.text_config, config.vision_config):
        tower._attn_implementation = "sdpa"
    model = CLIPForContrastiveTraining(config).to(device)
    model.logit_scale = torch.nn.Parameter(model.logit_scale.detach().reshape(1))  # as build_contrastive does
    return model


def measure(model, batch, *, steps, warmup, compile_model, device, bf16=True):
    """(samples/s, peak GiB) of full training steps after `warmup` untimed ones, under bf16 autocast unless
    `bf16=False`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    forward = torch.compile(model) if compile_model else model

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = clip_loss(*forward(**batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = timed_steps(step, steps=steps, warmup=warmup, device=device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return steps * len(batch["input_ids"]) / seconds, peak


def timed_steps(step, *, steps, warmup, device) -> float:
    """Seconds of `steps` calls of `step` after `warmup` untimed ones; the device synchronised at
    both ends, its peak memory counted from the first timed call."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy", action="store_true", help="a toy model (the default without a GPU)")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", choices=["off", "on", "both"], default="both")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    toy = args.toy or device.type != "cuda"
    sizes = TOY if toy else VIT_B_16
    batch_size = min(args.batch_size, 8) if toy else args.batch_size
    torch.manual_seed(0)
    text_len, image_size = sizes["text"]["max_position_embeddings"], sizes["vision"]["image_size"]
    batch = {"input_ids": torch.randint(3, sizes["text"]["vocab_size"], (batch_size, text_len), device=device),
             "attention_mask": torch.ones(batch_size, text_len, dtype=torch.long, device=device),
             "pixel_values": torch.randn(batch_size, 3, image_size, image_size, device=device)}
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = peak_flops()
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "CPU"
    record = {"bench": "gpu_clip_throughput", "quick": toy, "device": name, "torch": torch.__version__,
              "model": "toy" if toy else "ViT-B/16", "batch_size": batch_size, "time": time.strftime("%Y-%m-%d %H:%M"),
              "runs": {}}
    print(f"{name}, {'toy CLIP' if toy else 'CLIP ViT-B/16'}, batch {batch_size}, bf16 autocast, "
          f"{args.steps} timed steps after {args.warmup}")
    print(f"{'compile':>7} {'samples/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
    for compile_model in {"off": [False], "on": [True], "both": [False, True]}[args.compile]:
        model = build(sizes, device)
        flops = clip_train_flops_per_sample(model, text_len)
        samples_per_s, memory = measure(model, batch, steps=args.steps, warmup=args.warmup,
                                        compile_model=compile_model, device=device)
        mfu = samples_per_s * flops / peak if peak else None
        print(f"{'on' if compile_model else 'off':>7} {samples_per_s:>10.1f} {samples_per_s * flops / 1e12:>8.1f} "
              f"{f'{mfu:.1%}' if mfu else 'n/a':>6} {memory:>9.1f}")
        record["runs"]["compile_" + ("on" if compile_model else "off")] = {
            "samples_per_s": samples_per_s, "flops_per_sample": flops, "mfu": mfu, "peak_gib": memory}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
