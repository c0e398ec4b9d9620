"""Activation memory per rank of one long clip's conversation, whole (sp=1) and split over 2 ranks (sp=2).

    python bench/sequence_parallel_memory.py            # the tiny Qwen2.5-VL, a 128-frame clip: about 4.1k tokens
    python bench/sequence_parallel_memory.py --quick    # 16 frames (CI)

The row goes through the recipe's path (decode_video, the labeller, ChatCollator, VLMForTraining): once in one
process, whole; then on 2 gloo processes with `SequenceParallel` (Ulysses: each rank holds half of the merged
sequence; the vision tower's work shared, each rank encoding half of the clip's frames, the features gathered).
Activation memory is what autograd saves for the backward during the forward
(`torch.autograd.graph.saved_tensors_hooks`, each storage once, parameters left out): what a rank holds at its peak
between forward and backward, split into the vision tower's and the language model's. The loss and gradient norm
of both are printed too (they agree). Appends a JSON line to bench/results/.
"""

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mmrecipes.images import to_device
from mmrecipes.vlm.arguments import VideoArgs
from mmrecipes.vlm.model.families import dummy_image_inputs, video_path
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import encode_row
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.videos import decode_video

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "sequence_parallel_memory.jsonl"
sys.path.insert(0, str(REPO / "data_prep"))
from make_videos import encode_clip, moving_shape  # noqa: E402
from tiny_vlm import save_tiny_vlm  # noqa: E402


class SavedActivations:
    """Bytes autograd saves during a forward, each storage once, parameters left out, by part of the model (the
    vision tower's forward hooks mark where it runs)."""

    def __init__(self, model):
        self.parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
        self.seen, self.part, self.bytes = set(), "language_model", {"vision_tower": 0, "language_model": 0}
        tower = model.model.visual
        tower.register_forward_pre_hook(lambda *_: setattr(self, "part", "vision_tower"))
        tower.register_forward_hook(lambda *_: setattr(self, "part", "language_model"))

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters | self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes[self.part] += storage.nbytes()
        return tensor


def long_clip_batch(directory, frames: int):
    """(model, its VLMForTraining input) of one conversation about a `frames`-frame clip."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, processor = AutoModelForImageTextToText.from_pretrained(directory), AutoProcessor.from_pretrained(directory)
    clip = encode_clip([frame.resize((64, 64)) for frame in moving_shape("right", "red", "circle", frames=frames)])
    video, problem = decode_video(clip, VideoArgs(video_fps=1000.0, video_max_frames=frames))
    assert problem is None, problem
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor), videos=video_path(model, processor))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Where does it move?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "right"}]}]
    input_ids, labels, inputs = encode_row(labeller, messages, [], [video])
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    return model, to_device(collator([{"input_ids": input_ids, "labels": labels, "media_inputs": inputs}]), "cpu")


def measure(rank, world, port, directory, frames, out):
    """One forward and backward of the row on this rank (split over `world` ranks if 2); its numbers to `out`."""
    from mmrecipes.vlm.parallel.sequence_parallel import SequenceParallel

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model, batch = long_clip_batch(directory, frames)
    step = VLMForTraining(model, SequenceParallel(model, world) if world > 1 else None)
    saved = SavedActivations(model)
    start = time.perf_counter()
    # enable_grad: tests/run_benches.py runs scripts in one process, after some that switch gradients off
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        loss = step(batch, LossSum()).summed
        loss.backward()
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    if world > 1:  # each shard got its gradient once from each rank's loss (mmrecipes.vlm.parallel.sequence_parallel)
        for grad in grads:
            dist.all_reduce(grad)
            grad /= world
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(grad) for grad in grads])).item()
    torch.save({"tokens": batch["input_ids"].shape[1], "loss": loss.item(), "grad_norm": norm,
                "seconds": time.perf_counter() - start, **saved.bytes}, Path(out) / f"{world}_{rank}.pt")
    if world > 1:
        dist.destroy_process_group()


def run_ranks(directory, frames: int, folder) -> str | None:
    """The sp=2 run: 2 processes of this script (`--rank`); None, or the failing ranks' output."""
    with socket.socket() as probe:  # a free port for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), port, str(directory), str(frames),
                               folder], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [rank.communicate()[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        return "\n".join(f"rank {index} (exit {rank.returncode}):\n{output[-3000:]}"
                         for index, (rank, output) in enumerate(zip(ranks, outputs)))
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=128)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    parser.add_argument("--rank", nargs=5, help=argparse.SUPPRESS)  # a rank of the sp=2 run: rank port dir frames out
    args = parser.parse_args()
    if args.rank:
        rank, port, directory, frames, out = args.rank
        return measure(int(rank), 2, int(port), directory, int(frames), out)
    frames = 16 if args.quick else args.frames
    with tempfile.TemporaryDirectory() as folder:
        directory = save_tiny_vlm("qwen2_5_vl", Path(folder) / "model")
        measure(0, 1, 0, directory, frames, folder)
        for attempt in (1, 2):  # a second try once, said: a rank failed once in a full CI-style run, unexplained
            outputs = run_ranks(directory, frames, folder)
            if outputs is None:
                break
            print(f"sp=2 attempt {attempt} failed:\n{outputs}")
        else:
            raise RuntimeError("both sp=2 attempts failed (their output is above)")
        runs = {name: torch.load(Path(folder) / f"{name}.pt") for name in ("1_0", "2_0", "2_1")}
    whole, shards = runs["1_0"], [runs["2_0"], runs["2_1"]]
    mib = 2 ** 20
    print(f"one conversation about a {frames}-frame clip: {whole['tokens']} tokens (tiny Qwen2.5-VL, CPU, fp32)")
    print(f"{'':>12} {'vision tower MiB':>17} {'language model MiB':>19} {'loss':>10} {'grad norm':>10}")
    for name, run in [("sp=1", whole), *[(f"sp=2 rank {rank}", run) for rank, run in enumerate(shards)]]:
        print(f"{name:>12} {run['vision_tower'] / mib:17.2f} {run['language_model'] / mib:19.2f} "
              f"{run['loss']:10.5f} {run['grad_norm']:10.5f}")
    ratios = {part: max(run[part] for run in shards) / whole[part] for part in ("vision_tower", "language_model")}
    total = max(run["vision_tower"] + run["language_model"] for run in shards) / (
        whole["vision_tower"] + whole["language_model"])
    print(f"per rank at sp=2 / sp=1: language model {ratios['language_model']:.3f}, vision tower "
          f"{ratios['vision_tower']:.3f} (each rank encodes its share of the frames), all {total:.3f}")
    record = {"bench": "sequence_parallel_memory", "quick": args.quick, "frames": frames, "tokens": whole["tokens"],
              "sp1": whole, "sp2": shards, "ratio_language_model": ratios["language_model"],
              "ratio_vision_tower": ratios["vision_tower"], "ratio_all": total,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
