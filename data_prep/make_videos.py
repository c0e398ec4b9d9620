"""Make the embedded video conversations: short clips of moving coloured shapes, as chat rows.

    python data_prep/make_videos.py            # writes data/vlm_shapes/video_chat/{train,test}-*.parquet

Deterministic (fixed seed). Each clip is 8 frames of 48 x 48 pixels at 4 frames per second, H.264
in MP4 (PyAV's bundled libx264), about 2 KB. Its question needs the motion or the frame order, never
one frame alone:
- "Which way does the shape move?": one shape crosses the frame left, right, up or down;
- "Which colour appears first?": a shape of one colour, then a shape of another.
Rows are in chat format: `messages` with a `{"type": "video"}` part and a `videos` column holding
each clip's bytes.
"""

import argparse
import io
import random
from pathlib import Path

import av
import datasets
import numpy
from PIL import Image, ImageDraw

from make_shapes import COLORS, SHAPES, draw_shape

SIZE, FRAMES, FPS = 48, 8, 4
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def encode_clip(frames: list[Image.Image], fps: int = FPS) -> bytes:
    """RGB frames -> H.264 MP4 bytes (yuv420p: what every decoder reads)."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(numpy.asarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def moving_shape(direction: str, colour: str, shape: str, frames: int = FRAMES) -> list[Image.Image]:
    """One shape crossing the frame in `direction`, from one edge's side to the other's."""
    dx, dy = DIRECTIONS[direction]
    images = []
    for index in range(frames):
        offset = round((index / (frames - 1) - 0.5) * (SIZE - 20))
        image = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
        draw_shape(ImageDraw.Draw(image), shape, (SIZE // 2 + dx * offset, SIZE // 2 + dy * offset), 7,
                   COLORS[colour])
        images.append(image)
    return images


def colour_sequence(first: str, second: str, shape: str, frames: int = FRAMES) -> list[Image.Image]:
    """A shape of colour `first` for the first half of the clip, then one of colour `second`."""
    images = []
    for index in range(frames):
        image = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
        colour = first if index < frames // 2 else second
        draw_shape(ImageDraw.Draw(image), shape, (SIZE // 2, SIZE // 2), 12, COLORS[colour])
        images.append(image)
    return images


def clip_row(kind: str, question: str, answer: str, clip: bytes) -> dict:
    """A chat row of one `kind` ("video", "audio") part and a question, its clip's bytes in the `<kind>s` column."""
    return {"messages": [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            f"{kind}s": [{"bytes": clip}]}


def write_splits(output: Path, make_rows, train_rows: int, test_rows: int):
    """train- and test-00000-of-00001.parquet of `make_rows(count, seed)` (seeds 0 and 1) in `output`."""
    output.mkdir(parents=True, exist_ok=True)
    for split, count, seed in (("train", train_rows, 0), ("test", test_rows, 1)):
        datasets.Dataset.from_list(make_rows(count, seed)).to_parquet(output / f"{split}-00000-of-00001.parquet")
        print(f"{split}: {count} rows -> {output}")


def make_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    colours = sorted(COLORS)
    rows = []
    for index in range(count):
        shape = rng.choice(SHAPES)
        if index % 2 == 0:
            direction = rng.choice(sorted(DIRECTIONS))
            clip = encode_clip(moving_shape(direction, rng.choice(colours), shape))
            rows.append(clip_row("video", "Which way does the shape move?", direction, clip))
        else:
            first, second = rng.sample(colours, 2)
            rows.append(clip_row("video", "Which colour appears first?", first,
                                  encode_clip(colour_sequence(first, second, shape))))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(Path(__file__).resolve().parents[1] / "data" / "vlm_shapes" /
                                                "video_chat"))
    parser.add_argument("--train_rows", type=int, default=256)
    parser.add_argument("--test_rows", type=int, default=64)
    args = parser.parse_args()
    write_splits(Path(args.output), make_rows, args.train_rows, args.test_rows)


if __name__ == "__main__":
    main()
