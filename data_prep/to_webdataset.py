"""Write an image-caption dataset as webdataset tar shards in img2dataset's layout.

    python data_prep/to_webdataset.py --output_dir /data/shapes_wds     # the embedded shapes set
    accelerate launch recipes/clip_pretrain.py --dataset_name webdataset \
        --data_files "/data/shapes_wds/train-{00000..00003}.tar" --eval_data_files /data/shapes_wds/test-00000.tar \
        --image_column jpg --caption_column txt

Each row becomes `{key}.jpg`, `{key}.txt` and `{key}.json` (key, width, height, caption), the
members img2dataset writes, so the recipe reads the result exactly as it reads a crawl. Rows
whose image does not decode are skipped here and counted in the output.
"""

import argparse
import io
import json
import tarfile
from pathlib import Path

import datasets

from mmrecipes.images import decode_image
from mmrecipes.paths import SHAPES_DATA


def add_member(tar: tarfile.TarFile, name: str, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(rows, output_dir: Path, prefix: str, num_shards: int, image_column: str, caption_column: str) -> dict:
    """Rows spread over `num_shards` tars in order; returns {"written": n, "skipped": n}."""
    output_dir.mkdir(parents=True, exist_ok=True)
    counts = {"written": 0, "skipped": 0}
    per_shard = -(-len(rows) // num_shards)
    for shard in range(num_shards):
        with tarfile.open(output_dir / f"{prefix}-{shard:05d}.tar", "w") as tar:
            for index in range(shard * per_shard, min(len(rows), (shard + 1) * per_shard)):
                row = rows[index]
                image, problem = decode_image(row[image_column], max_pixels=10**9)
                if image is None or not isinstance(row[caption_column], str):
                    counts["skipped"] += 1
                    continue
                key = f"{shard:05d}{index:05d}"
                jpeg = io.BytesIO()
                image.save(jpeg, format="JPEG", quality=95)
                add_member(tar, f"{key}.jpg", jpeg.getvalue())
                add_member(tar, f"{key}.txt", row[caption_column].encode())
                meta = {"key": key, "width": image.width, "height": image.height, "caption": row[caption_column]}
                add_member(tar, f"{key}.json", json.dumps(meta).encode())
                counts["written"] += 1
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--dataset_name", default=str(SHAPES_DATA))
    parser.add_argument("--image_column", default="image")
    parser.add_argument("--caption_column", default="text")
    parser.add_argument("--train_shards", type=int, default=4)
    args = parser.parse_args()
    for split, num_shards in (("train", args.train_shards), ("test", 1)):
        rows = datasets.load_dataset(args.dataset_name, split=split).cast_column(
            args.image_column, datasets.Image(decode=False))
        counts = write_shards(rows, Path(args.output_dir), split, num_shards, args.image_column, args.caption_column)
        print(f"{split}: {counts['written']} rows in {num_shards} shards, {counts['skipped']} skipped")


if __name__ == "__main__":
    main()
