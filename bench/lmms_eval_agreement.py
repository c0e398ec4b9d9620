"""Our benchmark scores of a saved model against lmms-eval's own run of it, on the same documents.

    pip install --no-deps --target /tmp/lmms lmms-eval==0.7.3 loguru pytz tenacity evaluate sacrebleu portalocker \
        tabulate colorama lxml aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist \
        openpyxl et_xmlfile
    PYTHONPATH=/tmp/lmms python bench/lmms_eval_agreement.py --model llava-hf/llava-1.5-7b-hf \
        --lmms_model llava_hf --tasks mmstar,chartqa --limit 200
    PYTHONPATH=/tmp/lmms python bench/lmms_eval_agreement.py --model outputs/tiny --lmms_model llava_hf \
        --tasks chartqa,mmmu_val --data_dir embedded:benchmarks --max_new_tokens 8 --device cpu

lmms-eval runs the tasks end to end with its own model class for the family (`--lmms_model`: its chat variant, as its
command line picks; its prompt rendering, `generate` and decoding), `python -m mmrecipes.benchmarks`'s answerer runs
ours. Prints each task's numbers from both and how many answers are the same text: the same answers give the same
numbers (the scorers are equal, tests/test_benchmarks.py), so a difference is in the rendering or the decoding; except
MMMU's guesses for answers without a letter, which lmms-eval draws from its process's random state.
`--data_dir` reads `DIR/<task>/*.parquet` instead of the hub in both.
"""

import argparse
import os
import tempfile
from pathlib import Path

import datasets
import torch
from lmms_eval import evaluator
from lmms_eval.api.task import ConfigurableTask
from lmms_eval.tasks import TaskManager
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrecipes.benchmarks.__main__ import GeneratedAnswers
from mmrecipes.benchmarks.arguments import BenchmarkArgs
from mmrecipes.benchmarks.harness import Benchmarks
from mmrecipes.paths import resolve_name


def ours(args, device) -> tuple[dict, dict]:
    """(our scores, {(task, document): answer})."""
    model = AutoModelForImageTextToText.from_pretrained(args.model).to(device).eval()
    answer = GeneratedAnswers(model, AutoProcessor.from_pretrained(args.model), device)
    scores, answers = {}, {}
    for task in args.tasks.split(","):
        benchmarks = Benchmarks(BenchmarkArgs(benchmarks=task, benchmark_limit=args.limit,
                                              benchmark_data_dir=args.data_dir,
                                              benchmark_max_new_tokens=args.max_new_tokens))

        def recorded(request, max_new_tokens, task=task):
            answers[task, request.index] = answer(request, max_new_tokens)
            return answers[task, request.index]

        scores |= benchmarks.run(recorded)
    return scores, answers


def theirs(args, device) -> tuple[dict, dict]:
    """(lmms-eval's numbers per task, {(task, document): answer})."""
    if args.data_dir:
        folder = Path(resolve_name(args.data_dir))

        def local(self, dataset_kwargs=None):
            docs = datasets.load_dataset("parquet", data_files=str(folder / self.config.task / "*.parquet"),
                                         split="train")
            self.dataset = self.dataset_no_image = datasets.DatasetDict({self.config.test_split: docs})

        ConfigurableTask.download = local
    evaluator._enable_reentrant_filelocks = lambda: None  # reads filelock 3's private module
    generation = f"max_new_tokens={args.max_new_tokens}" if args.max_new_tokens else None
    with tempfile.TemporaryDirectory() as scratch:  # its aggregations write files where they run
        here = os.getcwd()
        os.chdir(scratch)
        results = evaluator.simple_evaluate(
            model=args.lmms_model, model_args=f"pretrained={args.model},device={device},device_map={device}",
            tasks=args.tasks.split(","), limit=args.limit or None, task_manager=TaskManager(), log_samples=True,
            bootstrap_iters=0, gen_kwargs=generation)
        os.chdir(here)
    answers = {(task, int(sample["doc_id"])): sample["resps"][0][0] for task, samples in results["samples"].items()
               for sample in samples}
    return results["results"], answers


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a saved model directory or a hub id")
    parser.add_argument("--lmms_model", required=True, help="lmms-eval's model class for the family: llava_hf, ...")
    parser.add_argument("--tasks", default="mmstar,chartqa")
    parser.add_argument("--limit", type=int, default=0, help="the first N documents of each task (0: all)")
    parser.add_argument("--data_dir", default="", help="DIR/<task>/*.parquet instead of the hub")
    parser.add_argument("--max_new_tokens", type=int, default=0, help="a cap on answer tokens in both (0: each task's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.model = resolve_name(args.model)
    our_scores, our_answers = ours(args, args.device)
    their_numbers, their_answers = theirs(args, args.device)
    print(f"model {args.model}, lmms-eval's {args.lmms_model}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'CPU'}")
    for task in args.tasks.split(","):
        keys = sorted(key for key in their_answers if key[0] == task)
        same = sum(our_answers.get(key) == their_answers[key] for key in keys)
        numbers = {name.split(",")[0]: value for name, value in their_numbers[task].items()
                   if "," in name and "_stderr" not in name and isinstance(value, (int, float))}
        mine = {name: our_scores[f"bench/{task}/{name.replace(' ', '_')}"] for name in numbers}
        unread = our_scores[f"bench/{task}/unread"]
        print(f"{task}: answers the same text {same}/{len(keys)}; lmms-eval {numbers}; ours {mine} ({unread} answers "
              "unread: scored 0, MMMU's guessed as its own random state would not)")
        for key in [key for key in keys if our_answers.get(key) != their_answers[key]][:3]:
            print(f"  document {key[1]}: lmms-eval {their_answers[key]!r}, ours {our_answers.get(key)!r}")


if __name__ == "__main__":
    main()
