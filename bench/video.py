"""Video rows: decoding speed in one worker, the recipe's data_wait with video rows, and what a tiny model learns.

    python bench/video.py            # 300 recipe steps (about 2 minutes on 2 cores)
    python bench/video.py --quick    # a smoke run: 3 steps, 2 motion questions

1. Decoding (`mmrecipes.vlm.rows.videos.decode_video`, PyAV, one process = one DataLoader worker): clips/s and
   sampled frames/s at the recipe's defaults (--video_fps 2, --video_max_frames 8) on the embedded clips
   (48 px, 8 frames at 4 fps) and on a generated 224 px, 10-second clip at 30 fps. Then Qwen2.5-VL's video
   processor (its class defaults) on that clip's 8 sampled frames, in the worker: ms and bytes per clip as the
   float32 it finishes itself and as the uint8 the recipe ships through shared memory (`mmrecipes.vlm.rows.videos`).
2. `vlm_finetune.py` on a tiny Qwen2.5-VL (data_prep/tiny_vlm.py) on the embedded video conversations
   only, at the default DataLoader workers: data_wait (median over log lines after the first) and the
   teacher-forced answer accuracy on the 64 held-out clips.
3. The trained model on the held-out "Which way does the shape move?" clips, each answer chosen as the
   most likely of left / right / up / down (chance: 0.25), with the frames in order and reversed. A model
   that reads the motion answers the opposite way on reversed frames: its accuracy there falls towards 0.
"""

import argparse
import json
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
from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2VLVideoProcessor

from mmrecipes.images import UINT8_PIXELS, to_device
from mmrecipes.paths import VLM_SHAPES
from mmrecipes.vlm.arguments import VideoArgs
from mmrecipes.vlm.model.families import dummy_image_inputs, video_path
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import encode_row
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.videos import DecodedVideo, decode_video

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "video.jsonl"
sys.path.insert(0, str(REPO / "data_prep"))
from make_videos import encode_clip, moving_shape  # noqa: E402
from tiny_vlm import save_tiny_vlm  # noqa: E402

DIRECTIONS = ("left", "right", "up", "down")
WINDOW = re.compile(r"^step \d+/\d+ .*\| data_wait ([\d.]+)", re.M)
ACCURACY = re.compile(r"^eval step \d+ \| answer_accuracy ([\d.]+)", re.M)


def decoding_speed(clips: list[bytes], seconds: float) -> dict:
    """Clips/s and sampled frames/s of `decode_video` at the defaults, repeated for about `seconds`."""
    args, decoded, frames, start = VideoArgs(), 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for clip in clips:
            video, problem = decode_video(clip, args)
            assert problem is None, problem
            decoded, frames = decoded + 1, frames + len(video.frames)
    elapsed = time.perf_counter() - start
    return {"clips_per_s": decoded / elapsed, "frames_per_s": frames / elapsed, "frames_per_clip": frames / decoded}


def worker_pixels(clip: bytes, seconds: float) -> dict:
    """Qwen2.5-VL's video processor on one decoded clip, as float32 and as uint8: ms and MiB per clip."""
    video_processor, (video, _) = Qwen2VLVideoProcessor(), decode_video(clip, VideoArgs())
    measured = {}
    for dtype, flags in (("float32", {}), ("uint8", UINT8_PIXELS)):
        calls, start = 0, time.perf_counter()
        while not calls or time.perf_counter() - start < seconds:
            pixels = video_processor(videos=[video.frames], video_metadata=[video.metadata], do_sample_frames=False,
                                     return_tensors="pt", **flags)["pixel_values_videos"]
            calls += 1
        measured[dtype] = {"ms_per_clip": 1000 * (time.perf_counter() - start) / calls,
                           "mib_per_clip": pixels.numel() * pixels.element_size() / 2 ** 20}
    return measured


def large_clip(seconds: int) -> bytes:
    """A 224 px clip at 30 fps: a shape crossing the frame, upscaled from the embedded drawing."""
    frames = [image.resize((224, 224)) for image in moving_shape("right", "red", "circle", frames=30 * seconds)]
    return encode_clip(frames, fps=30)


def direction_accuracy(model_dir: Path, reverse: bool, limit: int) -> float:
    """Share of the first `limit` held-out motion questions whose most likely answer (summed token loss) is the
    right one."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor), videos=video_path(model, processor))
    collator, step = ChatCollator(0, dummy_image_inputs(model, processor)), VLMForTraining(model)
    rows = datasets.load_dataset(str(VLM_SHAPES / "video_chat"), split="test")
    right = total = 0
    for row in rows:
        question, answer = (message["content"][-1]["text"] for message in row["messages"])
        if answer not in DIRECTIONS:
            continue
        if total == limit:
            break
        video, _ = decode_video(row["videos"][0], VideoArgs())
        if reverse:
            video = DecodedVideo(video.frames[::-1].copy(), video.metadata)
        losses = {}
        for candidate in DIRECTIONS:
            messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]},
                        {"role": "assistant", "content": [{"type": "text", "text": candidate}]}]
            input_ids, labels, inputs = encode_row(labeller, messages, [], [video])
            batch = collator([{"input_ids": input_ids, "labels": labels, "media_inputs": inputs}
                             ])
            with torch.no_grad():
                losses[candidate] = float(step(to_device(batch, "cpu"), LossSum()).summed)
        right += min(losses, key=losses.get) == answer
        total += 1
    return right / total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--results", default=str(RESULTS), help="the JSON-lines file to append to")
    args = parser.parse_args()
    # --quick: the recipe without workers (their fork server's start is most of a short run)
    steps, seconds, workers = (3, 0.5, ["--dataloader_num_workers", "0"]) if args.quick else (args.steps, 5.0, [])

    embedded = [row["videos"][0]["bytes"] for row in datasets.load_dataset(str(VLM_SHAPES / "video_chat"),
                                                                            split="train").select(range(32))]
    large = large_clip(1 if args.quick else 10)
    speed = {"embedded_48px": decoding_speed(embedded, seconds), "224px_10s_30fps": decoding_speed([large], seconds)}
    print("decoding in one process (one DataLoader worker), the defaults (--video_fps 2, --video_max_frames 8)")
    for name, numbers in speed.items():
        print(f"  {name:<16} {numbers['clips_per_s']:8.1f} clips/s  {numbers['frames_per_s']:8.1f} frames/s  "
              f"({numbers['frames_per_clip']:.0f} frames a clip)")
    pixels = worker_pixels(large, seconds)
    print("Qwen2.5-VL's video processor on the 224 px clip's frames, in the worker: " + ", ".join(
        f"{dtype} {numbers['ms_per_clip']:.1f} ms and {numbers['mib_per_clip']:.2f} MiB a clip"
        for dtype, numbers in pixels.items()))

    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = save_tiny_vlm("qwen2_5_vl", Path(scratch) / "qwen")
        start = time.perf_counter()
        log = subprocess.run(
            [sys.executable, str(REPO / "recipes" / "vlm_finetune.py"), "--model_name_or_path", str(checkpoint),
             "--dataset_name", str(VLM_SHAPES / "video_chat"), "--dataset_weights", "",
             "--eval_dataset_name", str(VLM_SHAPES / "video_chat"), "--eval_generation_rows", "0",
             "--max_steps", str(steps), "--eval_steps", str(steps), "--logging_steps", str(max(1, steps // 10)),
             "--report_to", "none", "--output_dir", str(Path(scratch) / "run"), *workers],
            capture_output=True, text=True, check=True).stdout.replace("\r", "\n")
        wall = time.perf_counter() - start
        waits = [float(wait) for wait in WINDOW.findall(log)][1:]
        answer_accuracy = float(ACCURACY.findall(log)[-1])
        accuracy = {order: direction_accuracy(Path(scratch) / "run", order == "reversed", 2 if args.quick else 64)
                    for order in ("in_order", "reversed")}
    print(f"\nvlm_finetune.py, tiny Qwen2.5-VL, embedded clips only, {steps} steps, "
          f"{'no' if args.quick else 'default'} workers: "
          f"data_wait median {statistics.median(waits):.3f}, wall {wall:.0f} s, held-out answer accuracy "
          f"{answer_accuracy:.3f}")
    print(f"motion direction (chance 0.25): frames in order {accuracy['in_order']:.3f}, "
          f"reversed {accuracy['reversed']:.3f}")

    record = {"bench": "video", "quick": args.quick, "machine": platform.node(),
              "time": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(), "decoding": speed,
              "worker_pixels": pixels,
              "steps": steps,
              "data_wait_median": statistics.median(waits), "wall_s": wall, "answer_accuracy": answer_accuracy,
              "direction_accuracy": accuracy}
    with open(args.results, "a") as results:
        results.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
