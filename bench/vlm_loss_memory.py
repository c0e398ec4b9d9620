"""Peak memory of the VLM token loss at a real vocabulary: whole logits against the chunked head loss.

    python bench/vlm_loss_memory.py                  # Qwen2.5's vocabulary (151936), 2 x 1000 tokens
    python bench/vlm_loss_memory.py --vocab 262208   # Gemma 3's
    python bench/vlm_loss_memory.py --quick          # a smoke run (CI)
    python bench/vlm_loss_memory.py --loss jsd       # distillation: a student (1536) and a teacher (2048)

Each variant runs forward + backward of the loss alone, from the LM's last hidden states and its
output layer (float32 on CPU), in a fresh process, and reports the peak resident memory above the
inputs, the loss and the largest gradient difference against the whole-logits path:
- whole logits: `head(hidden)` -> `token_cross_entropy_sum` (what the recipe computed before: the
  `[batch, tokens, vocab]` logits, their fp32 copy and its gradient; what evaluation still does);
- chunked: `head_cross_entropy_sum` (what `VLMForTraining` trains with: the positions in
  `--num_chunks` slices, each recomputed in backward).
`--loss jsd`: the generalised JSD of distillation (beta 0.5, temperature 0.9) between a student's and a frozen
teacher's heads: whole logits of both through the dense formula, against `head_generalized_jsd_sum` (both heads in
slices, neither model's logits of the whole batch at once).
Appends a JSON line to bench/results/.
"""

import argparse
import json
import math
import platform
import resource
import time
from pathlib import Path

import torch

from fresh_process import resident_bytes, run_in_fresh_process
from mmrecipes.vlm.model.losses import head_cross_entropy_sum, head_generalized_jsd_sum, token_cross_entropy_sum
from mmrecipes.vlm.rows.labels import IGNORE_INDEX

RESULTS = Path(__file__).resolve().parent / "results" / "vlm_loss_memory.jsonl"


def inputs(options):
    torch.manual_seed(0)
    hidden = torch.randn(options.batch, options.tokens, options.hidden_size) * 0.02
    head = torch.nn.Linear(options.hidden_size, options.vocab, bias=False)
    labels = torch.randint(0, options.vocab, (options.batch, options.tokens))
    labels[:, :options.tokens // 5] = IGNORE_INDEX  # the prompt and image tokens are not targets
    return hidden.requires_grad_(), head, labels


def dense_jsd(student_logits, teacher_logits, mask, beta, temperature):
    log_ps = torch.log_softmax(student_logits.float() / temperature, -1)
    log_pt = torch.log_softmax(teacher_logits.float() / temperature, -1)
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    per_token = (beta * log_pt.exp() * (log_pt - log_m) + (1 - beta) * log_ps.exp() * (log_ps - log_m)).sum(-1)
    return (per_token * mask).sum()


def measure(variant, options, queue):
    hidden, head, labels = inputs(options)
    if options.loss == "jsd":  # the teacher: wider, frozen, its hidden states without a graph
        teacher_head = torch.nn.Linear(options.teacher_hidden_size, options.vocab, bias=False).requires_grad_(False)
        teacher = torch.randn(options.batch, options.tokens, options.teacher_hidden_size)
        mask = labels != IGNORE_INDEX
    before = resident_bytes()
    start = time.perf_counter()
    if options.loss == "jsd" and variant == "whole logits":
        loss = dense_jsd(head(hidden), teacher_head(teacher), mask, beta=0.5, temperature=0.9)
    elif options.loss == "jsd":
        loss = head_generalized_jsd_sum(hidden, head, teacher, teacher_head, mask, beta=0.5, temperature=0.9,
                                        num_chunks=options.num_chunks)
    elif variant == "whole logits":
        loss = token_cross_entropy_sum(head(hidden), labels)
    else:
        loss = head_cross_entropy_sum(hidden, head, labels, num_chunks=options.num_chunks)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's high-water mark (KiB)
    queue.put({"loss": loss.item(), "peak_bytes": peak - before, "seconds": time.perf_counter() - start,
               "grad": hidden.grad.numpy()})  # numpy: pickled whole (a tensor would go through shared memory)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden_size", type=int, default=1536)
    parser.add_argument("--teacher_hidden_size", type=int, default=2048)
    parser.add_argument("--loss", choices=("ce", "jsd"), default="ce")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--num_chunks", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    options = parser.parse_args()
    if options.quick:
        options.vocab, options.hidden_size, options.teacher_hidden_size, options.tokens = 4096, 64, 96, 200
    runs = {variant: run_in_fresh_process(measure, variant, options, fresh=not options.quick)
            for variant in ("whole logits", "chunked")}
    whole, chunked = runs["whole logits"], runs["chunked"]
    name = "distillation JSD" if options.loss == "jsd" else "token loss"
    print(f"{name}, vocabulary {options.vocab}, hidden {options.hidden_size}, {options.batch} x {options.tokens} "
          f"tokens, {options.num_chunks} slices (CPU, float32, peak RSS above the inputs)")
    for variant, run in runs.items():
        print(f"{variant:<14} loss {run['loss']:.4f}  peak {run['peak_bytes'] / 2**30:.2f} GiB  {run['seconds']:.2f} s")
    ratio = chunked["peak_bytes"] / max(whole["peak_bytes"], 1)
    grad_difference = float(abs(chunked["grad"] - whole["grad"]).max())
    print(f"chunked / whole peak memory {ratio:.3f}; largest hidden-state gradient difference {grad_difference:.2e}")
    record = {"bench": "vlm_loss_memory", "quick": options.quick, "loss": options.loss, "vocab": options.vocab,
              "hidden_size": options.hidden_size, "tokens": options.batch * options.tokens,
              "num_chunks": options.num_chunks,
              "peak_bytes": {variant: run["peak_bytes"] for variant, run in runs.items()},
              "ratio": ratio, "grad_difference": grad_difference, "machine": platform.node(),
              "time": time.strftime("%Y-%m-%d %H:%M")}
    with open(options.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
