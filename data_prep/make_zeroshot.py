"""Make the embedded zero-shot classification set: the single-shape images of the shapes test split.

    python data_prep/make_zeroshot.py          # writes data/shapes_zeroshot/test/<colour shape>/<row>.png

An image folder, one sub-folder per class ("red circle", ... : 8 colours x 4 shapes), which
`datasets.load_dataset` reads as `imagefolder` with a `ClassLabel` column: what the CLIP recipe's
`--zeroshot_dataset` evaluates by default, like ImageNet zero-shot in open_clip. Only held-out
images (the test split), only those with one shape (a two-shape image has no single class).
"""

import argparse
from pathlib import Path

import datasets

from make_shapes import RELATIONS

ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(ROOT / "data" / "shapes_zeroshot"))
    args = parser.parse_args()
    rows = datasets.load_dataset(str(ROOT / "data" / "shapes"), split="test")
    written = 0
    for index, row in enumerate(rows):
        caption = row["text"]
        if any(relation in caption for relation in RELATIONS):
            continue
        _, _size, colour, shape = caption.split()  # "a small red circle"
        folder = Path(args.output_dir) / "test" / f"{colour} {shape}"
        folder.mkdir(parents=True, exist_ok=True)
        row["image"].save(folder / f"{index:04d}.png")
        written += 1
    print(f"wrote {written} images in {len(list((Path(args.output_dir) / 'test').iterdir()))} classes to "
          f"{args.output_dir}")


if __name__ == "__main__":
    main()
