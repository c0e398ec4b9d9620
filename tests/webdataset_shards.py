"""A small webdataset tar set in img2dataset's layout (data_prep/to_webdataset.py), with broken members."""

import sys
import tarfile

import datasets

from launch import REPO

sys.path.insert(0, str(REPO / "data_prep"))
from to_webdataset import add_member, write_shards  # noqa: E402


def make_webdataset(directory, train_rows=240, test_rows=64) -> dict:
    """`train-{00000..00003}.tar` and `test-00000.tar` from the embedded shapes set. Shards 1 and 2
    end with a broken sample each: a corrupt `.jpg`, and a `.jpg` + `.json` with no `.txt`.
    Returns the counts written."""
    shapes = str(REPO / "data" / "shapes")
    train = datasets.load_dataset(shapes, split="train").select(range(train_rows))
    test = datasets.load_dataset(shapes, split="test").select(range(test_rows))
    written = {split: write_shards(rows.cast_column("image", datasets.Image(decode=False)), directory, split, shards,
                                   "image", "text")["written"]
               for split, rows, shards in (("train", train, 4), ("test", test, 1))}
    with tarfile.open(directory / "train-00001.tar", "a") as tar:
        add_member(tar, "broken0.jpg", b"\xff\xd8\xff\xe0 not really a jpeg")
        add_member(tar, "broken0.txt", b"a caption whose image is corrupt")
        add_member(tar, "broken0.json", b'{"key": "broken0"}')
    with tarfile.open(directory / "train-00002.tar", "a") as tar:
        with tarfile.open(directory / "train-00000.tar") as source:  # a valid image, but its caption is missing
            add_member(tar, "broken1.jpg", source.extractfile(source.getmembers()[0]).read())
        add_member(tar, "broken1.json", b'{"key": "broken1"}')
    return written
