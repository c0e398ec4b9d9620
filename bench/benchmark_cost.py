"""What the benchmarks in the loop cost: seconds per 100 documents of the embedded benchmark tasks, answered by the
recipes' path (whole-sequence forwards in step over the ranks, `BenchmarkAnswers`) and by `generate` (a KV cache:
`python -m mmrecipes.benchmarks`), the same answers both ways.

    python bench/benchmark_cost.py             # the tiny SFT'd Llava, every embedded image task, answers <= 32 tokens
    python bench/benchmark_cost.py --quick     # 3 documents a task (CI)

One process on the CPU. Appends a JSON line to bench/results/.
"""

import argparse
import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrecipes.benchmarks.__main__ import GeneratedAnswers
from mmrecipes.benchmarks.arguments import BenchmarkArgs
from mmrecipes.benchmarks.harness import Benchmarks
from mmrecipes.benchmarks.tasks import TASKS
from mmrecipes.paths import EMBEDDED
from mmrecipes.vlm.model.evaluation import BenchmarkAnswers
from mmrecipes.vlm.model.families import dummy_image_inputs, placeholder_token_ids
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.step import VLMForTraining

RESULTS = Path(__file__).resolve().parent / "results" / "benchmark_cost.jsonl"


def timed(benchmarks: Benchmarks, answer) -> tuple[float, dict]:
    start = time.perf_counter()
    scores = benchmarks.run(answer)
    return time.perf_counter() - start, scores


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    torch.manual_seed(0)
    directory = EMBEDDED / "tiny_sft_vlm"
    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    processor = AutoProcessor.from_pretrained(directory)
    image_tasks = [name for name, task in TASKS.items() if not task.hears]  # the tiny Llava does not hear
    bench_args = BenchmarkArgs(benchmarks=",".join(image_tasks), benchmark_data_dir="embedded:benchmarks",
                               benchmark_limit=3 if args.quick else 0, benchmark_max_new_tokens=args.max_new_tokens)
    benchmarks = Benchmarks(bench_args)
    documents = sum(len(bench.docs) for bench in benchmarks.tasks)
    vlm = SimpleNamespace(model=model, processor=processor, dummy_inputs=dummy_image_inputs(model, processor),
                          stops=stop_token_ids(model, processor), placeholders=placeholder_token_ids(model, processor),
                          audio_window=None)
    with torch.no_grad():
        in_step, loop_scores = timed(benchmarks, BenchmarkAnswers(VLMForTraining(model), vlm, "cpu"))
        cached, generate_scores = timed(benchmarks, GeneratedAnswers(model, processor, "cpu"))
    print(f"{documents} documents of {len(benchmarks.tasks)} tasks, answers of up to {args.max_new_tokens} tokens, "
          f"the tiny SFT'd Llava, 1 process, {torch.get_num_threads()} threads")
    print(f"recipes' path (in step, no cache): {100 * in_step / documents:.2f} s per 100 documents")
    print(f"generate (KV cache):               {100 * cached / documents:.2f} s per 100 documents "
          f"({in_step / cached:.2f}x faster)")
    print(f"the same scores both ways: {loop_scores == generate_scores}")
    record = {"bench": "benchmark_cost", "quick": args.quick, "documents": documents,
              "max_new_tokens": args.max_new_tokens, "in_step_seconds": in_step, "generate_seconds": cached,
              "same_scores": loop_scores == generate_scores, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine()}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
