"""What the VLM safety features cost, as ratios measured in one run at the recipe's default sizes.

    python bench/vlm_dummy.py            # CPU here; the same code runs on a GPU
    python bench/vlm_dummy.py --quick    # a smoke run: batch 4, 1 repeat

1. Dummy image: forward+backward of a text-only micro-batch through `VLMForTraining` (the
   vision step runs on the dummy and is sliced out) vs the plain LM on the same batch with no
   vision call at all (what skipping the tower would cost, if it did not hang other ranks).
2. Divergence guard (2 gloo processes, DDP): training step time with `DivergenceGuard` on vs off.
Timings alternate between the two sides and report the median and the spread (min-max) of
repeats, so drift of the machine hits both sides alike.
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from mmrecipes.distributed import Ranks
from mmrecipes.images import to_device
from mmrecipes.paths import VLM_SHAPES
from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.losses import token_cross_entropy_sum
from mmrecipes.vlm.model.module_groups import apply_train_modules, module_groups
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import build_chat_dataloader
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller

RESULTS = Path(__file__).resolve().parent / "results" / "vlm_dummy.jsonl"


def setup(batch_size, dataset):
    torch.manual_seed(0)
    model, processor = load_vlm(VLMModelArgs())
    dummy_inputs = dummy_image_inputs(model, processor)
    apply_train_modules(module_groups(model, dummy_inputs), "projector,language_model")  # the recipe's default
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_inputs)
    args = ChatDataArgs(dataset_name=dataset, dataset_weights=None, dataloader_num_workers=0)
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    loader = build_chat_dataloader(args, labeller, collator, batch_size=batch_size, ranks=Ranks(),
                                   shuffle_seed=0)
    return model, loader


def timed(step, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def dummy_overhead(batch_size, repeats):
    model, loader = setup(batch_size, str(VLM_SHAPES / "text_chat"))
    batch = next(iter(loader))
    assert batch["dummy_image"]
    wrapper, inputs = VLMForTraining(model), to_device(batch, "cpu")

    def with_dummy():
        wrapper(inputs, LossSum()).summed.backward()

    def without_vision():
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        token_cross_entropy_sum(logits, inputs["labels"]).backward()

    for step in (with_dummy, without_vision):  # warm-up
        timed(step, 3)
    dummy, plain = [], []
    for _ in range(repeats):  # alternate, 5 steps a side at a time
        dummy += timed(with_dummy, 5)
        plain += timed(without_vision, 5)
    return dummy, plain


def _guard_worker(rank, world, port, batch_size, repeats, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from mmrecipes.distributed import DivergenceGuard

    model, loader = setup(batch_size, ChatDataArgs.dataset_name)
    wrapper = VLMForTraining(model)
    ddp = torch.nn.parallel.DistributedDataParallel(wrapper)
    batches = [to_device(batch, "cpu") for _, batch in zip(range(10), loader)]

    def step():
        for batch in batches:
            ddp(batch, LossSum()).summed.backward()

    timed(step, 1)
    off, on = [], []
    for _ in range(repeats):
        off += timed(step, 1)
        guard = DivergenceGuard(wrapper)
        on += timed(step, 1)
        guard.remove()
    torch.save((off, on), os.path.join(out_dir, f"{rank}.pt"))
    torch.distributed.destroy_process_group()


def guard_cost(batch_size, repeats):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_guard_worker, args=(2, 29731, batch_size, repeats, out_dir), nprocs=2, start_method="spawn")
        return torch.load(os.path.join(out_dir, "0.pt"))


def summary(name, test, base) -> dict:
    ratios = sorted(t / b for t, b in zip(test, base))
    median = statistics.median(test) / statistics.median(base)
    print(f"{name:<44} {statistics.median(base) * 1e3:9.2f} ms {statistics.median(test) * 1e3:9.2f} ms "
          f"{median:7.3f}  ({ratios[0]:.3f}-{ratios[-1]:.3f})")
    return {"base_s": statistics.median(base), "test_s": statistics.median(test), "ratio": median,
            "ratio_spread": [ratios[0], ratios[-1]]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch_size", type=int, default=None, help="default: 16, the recipe's (--quick: 4)")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    repeats = 1 if args.quick else 20
    args.batch_size = args.batch_size or (4 if args.quick else 16)
    print(f"{'what (test vs base)':<44} {'base':>12} {'test':>12} {'ratio':>7}  (spread of paired ratios)")
    dummy, plain = dummy_overhead(args.batch_size, repeats)
    record = {"bench": "vlm_dummy", "quick": args.quick, "machine": platform.node(), "threads": torch.get_num_threads(),
              "time": time.strftime("%Y-%m-%d %H:%M"), "batch_size": args.batch_size,
              "dummy_vs_no_vision_call": summary("text-only step: dummy image vs no vision call", dummy, plain)}
    off, on = guard_cost(args.batch_size, max(1, repeats // 4))
    record["guard_on_vs_off"] = summary("DDP x2, 10 micro-steps: guard on vs off", on, off)
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
