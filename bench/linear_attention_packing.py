"""Packing through linear attention, on the tiny Qwen3.5 (data_prep/tiny_vlm_2026.py), in one run:

    python bench/linear_attention_packing.py
    python bench/linear_attention_packing.py --quick
    python bench/linear_attention_packing.py --device cuda   # on a GPU: the kernels, where installed

One row of `--tokens` tokens holding N text samples of random lengths (N = 4, 16, 64), a training step of the
language model (forward and backward of its summed last hidden states) three ways:
- `segmented`: packed, each token's segment passed to the Gated DeltaNet layers (`model/segments.py`): exact;
- `leaky`: packed, transformers' torch path without boundaries (the samples mix: what packing gave before);
- `padded`: the samples as rows padded to the longest, with an attention mask.
Prints tokens/s of each and the ratios packed (segmented) / padded and segmented / leaky, and appends a JSON line to
bench/results/linear_attention_packing.jsonl. Goals: packed >= 1.5x padded, segmented >= 0.9x leaky. Each row also
says how far the packed hidden states are from each sample's alone (`max_diff_alone`) and, on a GPU, whether the
kernels (flash-linear-attention, causal-conv1d) ran them (`kernels`: each one's probe verdict; none where neither is
installed).
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data_prep"))

RESULTS = Path(__file__).resolve().parent / "results" / "linear_attention_packing.jsonl"


def language_model(device):
    import tiny_vlm_2026
    from mmrecipes.vlm.model.segments import apply_segment_aware_mixers

    torch.manual_seed(0)
    model, _ = tiny_vlm_2026.FAMILIES["qwen3_5"]()
    apply_segment_aware_mixers(model)
    return model.model.language_model.to(device).train()


def inputs(lengths: list[int], mode: str, width: int, device) -> dict:
    from mmrecipes.vlm.model.segments import segment_ids

    generator = torch.Generator().manual_seed(len(lengths))
    if mode == "padded":
        longest = max(lengths)
        embeds = torch.randn(len(lengths), longest, width, generator=generator)
        mask = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None]).long()
        kwargs = dict(inputs_embeds=embeds, attention_mask=mask)
    else:
        embeds = torch.randn(1, sum(lengths), width, generator=generator)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        kwargs = dict(inputs_embeds=embeds, position_ids=positions)
        if mode == "segmented":
            kwargs["seq_idx"] = segment_ids(torch.tensor(lengths), (1, sum(lengths)))
    return {name: value.to(device) for name, value in kwargs.items()}


def step(model, lengths: list[int], mode: str, width: int, device) -> float:
    """Seconds of one forward and backward; `lengths`: the samples' tokens."""
    kwargs = inputs(lengths, mode, width, device)
    kwargs["inputs_embeds"].requires_grad_()
    started = time.perf_counter()
    model(**kwargs, use_cache=False).last_hidden_state.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


@torch.no_grad()
def difference_from_alone(model, lengths: list[int], width: int, device) -> float:
    """The largest difference of the packed (segmented) hidden states from each sample's run alone."""
    kwargs = inputs(lengths, "segmented", width, device)
    packed = model(**kwargs, use_cache=False).last_hidden_state[0]
    alone = torch.cat([model(inputs_embeds=part[None], use_cache=False).last_hidden_state[0]
                       for part in kwargs["inputs_embeds"][0].split(lengths)])
    return (packed - alone).abs().max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cuda: the kernels, where installed")
    parser.add_argument("--quick", action="store_true", help="256 tokens, 4 and 16 samples, one repeat (CI)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON lines file to append to")
    args = parser.parse_args()
    tokens, counts, repeats = (256, (4, 16), 1) if args.quick else (args.tokens, (4, 16, 64), args.repeats)
    from mmrecipes.vlm.model import segments

    device = torch.device(args.device)
    model = language_model(device)
    width = model.config.hidden_size
    rows = []
    for count in counts:
        generator = torch.Generator().manual_seed(count)
        cuts = sorted(torch.randperm(tokens - 1, generator=generator)[:count - 1].add(1).tolist())
        lengths = [end - start for start, end in zip([0, *cuts], [*cuts, tokens])]
        step(model, lengths, "segmented", width, device)  # warm up (and the kernels' probes)
        seconds = {mode: min(step(model, lengths, mode, width, device) for _ in range(repeats))
                   for mode in ("segmented", "leaky", "padded")}
        speed = {mode: tokens / value for mode, value in seconds.items()}
        waste = count * max(lengths) / tokens  # the padded batch's tokens per real token
        row = {"samples": count, "tokens": tokens, "padded_tokens_per_token": round(waste, 2),
               "tokens_per_s": {k: round(v) for k, v in speed.items()},
               "packed_over_padded": round(speed["segmented"] / speed["padded"], 2),
               "segmented_over_leaky": round(speed["segmented"] / speed["leaky"], 2),
               "max_diff_alone": float(f"{difference_from_alone(model, lengths, width, device):.3g}"),
               "kernels": segments.kernel_verdicts()}
        rows.append(row)
        print(f"{count} samples in {tokens} tokens (padded: {waste:.2f} tokens a token): tokens/s segmented "
              f"{speed['segmented']:.0f}, leaky {speed['leaky']:.0f}, padded {speed['padded']:.0f}; packed/padded "
              f"{row['packed_over_padded']:.2f}x, segmented/leaky {row['segmented_over_leaky']:.2f}x; packed against "
              f"alone {row['max_diff_alone']:.3g}; kernels {row['kernels'] or 'none (the torch path)'}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as file:
        file.write(json.dumps({"bench": "linear_attention_packing", "machine": platform.node(),
                               "processor": platform.machine(), "device": args.device, "threads":
                               torch.get_num_threads(), "torch": torch.__version__, "quick": args.quick,
                               "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
