"""Make the embedded image-caption dataset: rendered shapes with compositional captions.

    python data_prep/make_shapes.py            # writes data/shapes/{train,test}-*.parquet

Deterministic (fixed seed): re-running it reproduces the checked-in shards. Each image holds
one or two shapes of a colour and size at a position; the caption names them and their
relation ("a small red circle above a large blue square"), so retrieval R@1 needs the model
to bind colour, shape, size and position. The training split carries what web data carries
too: a few grayscale/RGBA/palette/CMYK images (converted) and a few undecodable or captionless
rows (skipped and counted), so the default run exercises both paths.
"""

import argparse
import io
import random
from pathlib import Path

import datasets
from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 220, 40),
    "purple": (150, 60, 200),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "cyan": (40, 210, 220),
}
SHAPES = ("circle", "square", "triangle", "diamond")
SIZES = {"small": 10, "large": 20}  # half-width in pixels on a 64x64 canvas
RELATIONS = ("above", "below", "left of", "right of")
CANVAS = 64


def draw_shape(draw, shape, center, half, color):
    x, y = center
    box = (x - half, y - half, x + half, y + half)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    elif shape == "triangle":
        draw.polygon([(x, y - half), (x - half, y + half), (x + half, y + half)], fill=color)
    else:  # diamond
        draw.polygon([(x, y - half), (x + half, y), (x, y + half), (x - half, y)], fill=color)


def random_object(rng):
    return rng.choice(list(SIZES)), rng.choice(list(COLORS)), rng.choice(SHAPES)


def centers_for(relation, rng):
    """Two centres, the first in `relation` to the second, both clear of the border."""
    near, far = rng.randint(14, 22), rng.randint(42, 50)
    other = rng.randint(20, 44)
    first, second = {
        "above": ((other, near), (other, far)),
        "below": ((other, far), (other, near)),
        "left of": ((near, other), (far, other)),
        "right of": ((far, other), (near, other)),
    }[relation]
    return first, second


def make_scene(rng):
    """(image, objects, relation): one or two (size, colour, shape) objects; relation None for one."""
    background = tuple(rng.randint(0, 60) for _ in range(3))
    image = Image.new("RGB", (CANVAS, CANVAS), background)
    draw = ImageDraw.Draw(image)
    obj_a = random_object(rng)
    if rng.random() < 0.3:
        size, color, shape = obj_a
        center = (rng.randint(22, 42), rng.randint(22, 42))
        draw_shape(draw, shape, center, SIZES[size], COLORS[color])
        return image, [obj_a], None
    obj_b = random_object(rng)
    relation = rng.choice(RELATIONS)
    center_a, center_b = centers_for(relation, rng)
    # small shapes drawn last so a large neighbour never hides them
    for (size, color, shape), center in sorted([(obj_a, center_a), (obj_b, center_b)], key=lambda o: -SIZES[o[0][0]]):
        draw_shape(draw, shape, center, SIZES[size] // 2 + 4, COLORS[color])
    return image, [obj_a, obj_b], relation


def make_example(rng):
    image, objects, relation = make_scene(rng)
    if relation is None:
        return image, f"a {' '.join(objects[0])}"
    return image, f"a {' '.join(objects[0])} {relation} a {' '.join(objects[1])}"


def encode(image, fmt="PNG"):
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def web_like(image, caption, rng):
    """Turn a clean example into one of the awkward kinds real crawls contain."""
    kind = rng.choice(["L", "RGBA", "P", "CMYK", "undecodable", "no_caption"])
    if kind == "undecodable":
        return encode(image)[:40], caption
    if kind == "no_caption":
        return encode(image), rng.choice(["", "   ", None])
    fmt = "JPEG" if kind == "CMYK" else "PNG"
    return encode(image.convert(kind), fmt), caption


def make_split(num_examples, seed, web_like_fraction):
    rng = random.Random(seed)
    images, captions = [], []
    for _ in range(num_examples):
        image, caption = make_example(rng)
        if rng.random() < web_like_fraction:
            image_bytes, caption = web_like(image, caption, rng)
        else:
            image_bytes = encode(image)
        images.append({"bytes": image_bytes, "path": None})
        captions.append(caption)
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    return datasets.Dataset.from_dict({"image": images, "text": captions}, features=features)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(Path(__file__).resolve().parents[1] / "data" / "shapes"))
    parser.add_argument("--train_examples", type=int, default=4096)
    parser.add_argument("--test_examples", type=int, default=512)
    parser.add_argument("--train_shards", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = {
        "train": (make_split(args.train_examples, args.seed, web_like_fraction=0.02), args.train_shards),
        "test": (make_split(args.test_examples, args.seed + 1, web_like_fraction=0.0), 1),
    }
    for split, (dataset, num_shards) in splits.items():
        for index in range(num_shards):
            path = out / f"{split}-{index:05d}-of-{num_shards:05d}.parquet"
            dataset.shard(num_shards, index, contiguous=True).to_parquet(str(path))
            print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
