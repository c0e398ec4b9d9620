"""The streamed pipeline: bad rows converted or skipped and counted, ranks read disjoint
complete shares, and ranks with unequal shares stop together."""

import io
import json
import multiprocessing.forkserver
import os
import signal
import time
from collections import Counter

import datasets
import pytest
import torch
from PIL import Image

from gloo import run_on_ranks
from mmrecipes.contrastive.arguments import DataArgs, ModelArgs
from mmrecipes.contrastive.data import COUNTED, ImageTextPreprocessor, PairCollator, build_dataloader
from mmrecipes.contrastive.evaluation import evaluate_retrieval, retrieval_recall_at_1
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.distributed import Ranks
from mmrecipes.images import processed_pixels, to_device
from mmrecipes.loader import FIRST_ROWS, batches_forever, check_held_out
from mmrecipes.sources import expand_data_files
from webdataset_shards import make_webdataset


def png(image, fmt="PNG"):
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def write_parquet(path, rows):
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    images = [{"bytes": image_bytes, "path": None} for image_bytes, _ in rows]
    datasets.Dataset.from_dict({"image": images, "text": [t for _, t in rows]}, features=features).to_parquet(str(path))


@pytest.fixture(scope="module")
def tiny():
    _, tokenizer, image_processor = build_contrastive(ModelArgs())
    return tokenizer, image_processor


def test_bad_rows_are_converted_or_skipped_and_counted(tmp_path, tiny):
    rgb = Image.new("RGB", (48, 40), (200, 10, 10))
    rows = [
        (png(rgb), "good one"),
        (png(rgb.convert("L")), "grayscale"),
        (png(Image.new("RGBA", (30, 30), (0, 0, 255, 0))), "transparent"),
        (png(rgb.convert("P")), "palette"),
        (png(rgb.convert("CMYK"), "JPEG"), "cmyk"),
        (png(rgb)[:30], "truncated file"),
        (b"not an image at all", "garbage"),
        (png(rgb), ""),
        (png(rgb), None),
        (png(Image.new("L", (9000, 6000))), "huge"),
        (png(Image.new("1", (20000, 20000))), "decompression bomb: 48 kB of PNG, 400M pixels"),
        (png(rgb), "good two"),
    ]
    write_parquet(tmp_path / "train.parquet", rows)
    args = DataArgs(dataset_name="parquet", data_files=str(tmp_path / "train.parquet"), max_image_pixels=50_000_000)
    loader = build_dataloader(args, "train", args.data_files, *tiny, batch_size=4, ranks=Ranks())
    batches = list(loader)
    kept = sum(len(b["input_ids"]) for b in batches)
    counts = dict(zip(COUNTED, sum(b["data_counts"] for b in batches).tolist()))
    assert kept == 6  # good one, grayscale, transparent, palette, cmyk, good two
    assert counts == {"converted": 4, "undecodable": 2, "too_large": 2, "no_caption": 2,
                      "bad_text": 0, "bad_row": 0, "bad_shard": 0}
    for batch in batches:
        pixels = to_device(batch, torch.device("cpu"))["pixel_values"]
        assert pixels.shape[1:] == (3, 32, 32) and torch.isfinite(pixels).all()
        # one EOS each
        assert (batch["input_ids"][batch["attention_mask"].bool()] == 0).sum() == len(batch["input_ids"])


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_batched_pixels_equal_the_image_processor(loss):
    """The loader applies the processor's own steps a size group at a time: its output must be
    what the saved processor gives at inference, down to the bit (sizes that shrink, grow and
    crop, mixed in one batch)."""
    _, _, image_processor = build_contrastive(ModelArgs(loss=loss))
    generator = torch.Generator().manual_seed(0)
    sizes = [(64, 64), (50, 80), (64, 64), (20, 30), (33, 17), (50, 80)]
    images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=generator, dtype=torch.uint8).numpy())
              for w, h in sizes]
    expected = image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert torch.equal(processed_pixels(image_processor, images), expected)
    # What the loader ships: uint8, which model_inputs finishes (on the device) to the same floats.
    pixels = processed_pixels(image_processor, images, normalize=False)
    collated = PairCollator(build_contrastive(ModelArgs(loss=loss))[1], image_processor)(
        [{"pixel_values": row, "input_ids": [5, 6]} for row in pixels])
    assert collated["pixel_values"].dtype == torch.uint8
    assert torch.equal(to_device(collated, torch.device("cpu"))["pixel_values"], expected)


def test_collator_pads_as_the_tokenizer_does(tiny):
    tokenizer, image_processor = tiny
    ids = tokenizer(["a red circle", "a small blue square above a large green star", "x"])["input_ids"]
    rows = [{"input_ids": row, "pixel_values": torch.zeros(3, 2, 2)} for row in ids]
    for side in ("right", "left"):
        tokenizer.padding_side = side
        for length in (None, 32):
            batch = PairCollator(tokenizer, image_processor, pad_to_length=length)(rows)
            expected = tokenizer.pad({"input_ids": ids}, padding="max_length" if length else True, max_length=length,
                                     return_tensors="pt")
            assert torch.equal(batch["input_ids"], expected["input_ids"])
            assert torch.equal(batch["attention_mask"], expected["attention_mask"])
    tokenizer.padding_side = "right"
    pad_token = tokenizer.pad_token
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match="has no pad token"):
        PairCollator(tokenizer, image_processor)
    tokenizer.pad_token = pad_token


def test_transparent_pixels_become_white_not_black():
    from mmrecipes.images import decode_image

    image, problem = decode_image(Image.new("RGBA", (4, 4), (0, 0, 0, 0)), max_pixels=100)
    assert problem == "converted" and image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)


def captions_of_rank(rank, world, tiny, shuffle_seed=None):
    args = DataArgs()
    loader = build_dataloader(args, "train", None, *tiny, batch_size=64, ranks=Ranks(rank, world),
                              shuffle_seed=shuffle_seed)
    return [tuple(ids[mask.bool()].tolist()) for batch in loader
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]  # without the batch's padding


@pytest.mark.parametrize("world", [2, 3])  # 4 shards: split by shard for 2, by row for 3
def test_data_ranks_read_disjoint_and_complete_shares(tiny, world):
    everything = Counter(captions_of_rank(0, 1, tiny))
    shares = [Counter(captions_of_rank(rank, world, tiny, shuffle_seed=7)) for rank in range(world)]
    assert sum(shares, Counter()) == everything  # every row exactly once across ranks (duplicate captions counted)
    assert all(shares)


def test_batches_forever_reshuffles_each_epoch_and_flags_empty_shards(tmp_path, tiny):
    rows = [(png(Image.new("RGB", (8, 8), (i, 0, 0))), f"caption {i}") for i in range(6)]
    write_parquet(tmp_path / "one.parquet", rows)
    args = DataArgs(dataset_name="parquet", data_files=str(tmp_path / "one.parquet"))
    loader = build_dataloader(args, "train", args.data_files, *tiny, batch_size=6, ranks=Ranks(),
                              shuffle_seed=0)
    stream = batches_forever(loader)
    (epoch0, first), (epoch1, second) = next(stream), next(stream)
    assert (epoch0, epoch1) == (0, 1)
    assert sorted(first["input_ids"].tolist()) == sorted(second["input_ids"].tolist())
    assert first["input_ids"].tolist() != second["input_ids"].tolist()
    empty = build_dataloader(args, "train", args.data_files, *tiny, batch_size=6, ranks=Ranks(6, 7))
    assert next(batches_forever(empty)) == (0, None)  # the recipe turns this into one error on every rank


def _eval_on_ranks(rank, world, data_files):
    torch.manual_seed(0)
    model, tokenizer, image_processor = build_contrastive(ModelArgs())
    args = DataArgs(dataset_name="parquet", data_files=data_files)
    loader = build_dataloader(args, "train", data_files, tokenizer, image_processor, batch_size=4,
                              ranks=Ranks(rank, world))
    filler = next(iter(build_dataloader(args, "train", data_files, tokenizer, image_processor, batch_size=4,
                                        ranks=Ranks())))
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    return evaluate_retrieval(model, loader, filler, torch.device("cpu")), len(forwards)


def test_eval_with_unequal_shares_stops_together_and_matches_one_process(tmp_path):
    """Rank 0 holds 3 eval batches, rank 1 one: both run 3 forwards (FSDP/ZeRO-3 need that) and
    report the R@1 of one process embedding all 14 rows."""
    rows = [(png(Image.new("RGB", (16, 16), ((37 * i) % 256, (91 * i) % 256, (53 * i) % 256))), f"colour number {i}")
            for i in range(14)]
    write_parquet(tmp_path / "a.parquet", rows[:10])
    write_parquet(tmp_path / "b.parquet", rows[10:])
    files = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    per_rank = run_on_ranks(_eval_on_ranks, 2, files)
    (recall0, forwards0), (recall1, forwards1) = per_rank
    assert recall0 == recall1 and recall0["eval_pairs"] == 14
    assert forwards0 == forwards1 == 3

    torch.manual_seed(0)
    model, tokenizer, image_processor = build_contrastive(ModelArgs())
    args = DataArgs(dataset_name="parquet", data_files=files)
    loader = build_dataloader(args, "train", files, tokenizer, image_processor, batch_size=14, ranks=Ranks())
    with torch.no_grad():
        image_embeds, text_embeds, _ = model(**to_device(next(iter(loader)), torch.device("cpu")))
    assert recall0 == retrieval_recall_at_1(image_embeds, text_embeds)


def test_data_files_expand_brace_ranges_lists_and_keep_globs_and_urls():
    assert expand_data_files("/data/{00000..00002}.tar") == ["/data/00000.tar", "/data/00001.tar", "/data/00002.tar"]
    assert expand_data_files("a/{9..11}.parquet, b/*.parquet,s3://bucket/{x,y}-{1..2}.tar") == [
        "a/9.parquet", "a/10.parquet", "a/11.parquet", "b/*.parquet",
        "s3://bucket/x-1.tar", "s3://bucket/x-2.tar", "s3://bucket/y-1.tar", "s3://bucket/y-2.tar"]
    assert expand_data_files("literal{brace}.json") == ["literal{brace}.json"]
    assert expand_data_files(None) is None
    assert expand_data_files(["x/{1..2}.json", "y.json"]) == ["x/1.json", "x/2.json", "y.json"]  # the library API
    assert expand_data_files("zip://rows.json::file:///data/rows.zip") == ["zip://rows.json::file:///data/rows.zip"]


def test_open_clip_double_colon_sources_are_refused_with_what_to_write():
    """open_clip's `A::B` (two sources) reached fsspec as a URL chain and trained on A alone, without a word."""
    with pytest.raises(ValueError, match="separate the files with commas"):
        expand_data_files("/data/a-{0..3}.tar::/data/b-{0..1}.tar")


def test_weighted_sources_mix_at_their_weights_and_count_each(tiny, tmp_path):
    """The embedded shapes and a folder whose captions name it, at --dataset_weights 0.75,0.25 (the same
    mechanism as the VLM recipe's): 0.25 of an epoch's rows (it ends once the 4,096 shapes are read) come from
    the folder within 0.02 on one data rank, and between 0.2 and 0.3 on each of 2 (about 2,700 rows each), and
    the per-source counts (rows_shapes, rows_other) are the rows whose captions say so."""
    (tmp_path / "other").mkdir()
    for index in range(32):
        Image.new("RGB", (16, 16), (index * 8, 0, 0)).save(tmp_path / "other" / f"{index}.png")
    (tmp_path / "other" / "metadata.csv").write_text(
        "file_name,text\n" + "".join(f"{index}.png,from the other source\n" for index in range(32)))
    args = DataArgs(dataset_name=f"{DataArgs().dataset_name},{tmp_path / 'other'}", dataset_weights="0.75,0.25")
    assert args.counted() == (*COUNTED, "rows_shapes", "rows_other")
    tokenizer, _ = tiny
    marker = tokenizer("from the other source")["input_ids"]
    for rank, world, tolerance in ((0, 1, 0.02), (0, 2, 0.05), (1, 2, 0.05)):
        loader = build_dataloader(args, "train", None, *tiny, batch_size=64, ranks=Ranks(rank, world),
                                  shuffle_seed=0)
        batches = list(loader)
        rows = sum(len(batch["input_ids"]) for batch in batches)
        from_other = sum(ids[mask.bool()].tolist() == marker for batch in batches
                         for ids, mask in zip(batch["input_ids"], batch["attention_mask"]))
        counts = dict(zip(args.counted(), sum(batch["data_counts"] for batch in batches).tolist()))
        assert counts["rows_other"] == from_other and counts["rows_shapes"] + from_other == rows > 4096 / world
        assert abs(from_other / rows - 0.25) < tolerance, (from_other, rows)
    with pytest.raises(ValueError, match="give one finite weight, 0 or more, per --dataset_name source"):
        build_dataloader(DataArgs(dataset_name=args.dataset_name, dataset_weights="1"), "train", None, *tiny,
                         batch_size=4, ranks=Ranks())


def test_uneven_shard_split_is_reported_once(caplog, monkeypatch):
    """4 shards over 3 data ranks: every rank would read every shard (3x the traffic); rank 0 says so, once for
    the source (its evaluation and prompt streams said it again, three lines in all)."""
    from mmrecipes import sources

    monkeypatch.setattr(sources, "_WARNED_SHARDS", set())  # what this process said before this test
    load_stream = sources.load_stream
    source = DataArgs().training_sources()[0]
    with caplog.at_level("WARNING", logger="mmrecipes.sources"):
        for rank in (0, 1, 2, 0):
            load_stream(*source, ["image", "text"], data_rank=rank, data_world=3)
        load_stream(*source, ["image", "text"], data_rank=0, data_world=2)  # 4 shards over 2: whole shards, silent
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "4 shards over 3 data ranks" in warnings[0] and "3x the read traffic" in warnings[0]


def test_webdataset_shards_with_broken_members_are_skipped_and_counted(tmp_path, tiny):
    """img2dataset's layout (`{key}.jpg/.txt/.json`) over 4 tars named by a brace range, one given
    as a file:// URL: every good row arrives once, the corrupt jpg and the missing txt are counted."""
    written = make_webdataset(tmp_path)
    args = DataArgs(dataset_name="webdataset", image_column="jpg", caption_column="txt",
                    data_files=f"{tmp_path}/train-{{00000..00002}}.tar,file://{tmp_path}/train-00003.tar")
    loader = build_dataloader(args, "train", args.data_files, *tiny, batch_size=16, ranks=Ranks())
    assert loader.dataset.n_shards == 4
    batches = list(loader)
    counts = dict(zip(COUNTED, sum(b["data_counts"] for b in batches).tolist()))
    assert sum(len(b["input_ids"]) for b in batches) == written["train"]
    assert counts["undecodable"] == 1 and counts["no_caption"] == 1


def test_jsonl_rows_with_image_paths(tmp_path, tiny):
    """`--dataset_name json`: one row per line, the image column a file path; a missing file is counted."""
    lines = []
    for i in range(6):
        path = tmp_path / f"{i}.png"
        if i != 4:
            Image.new("RGB", (20, 20), (40 * i, 0, 0)).save(path)
        lines.append(f'{{"image_path": "{path}", "caption": "picture {i}"}}')
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    args = DataArgs(dataset_name="json", data_files=str(tmp_path / "rows.jsonl"), image_column="image_path",
                    caption_column="caption")
    batches = list(build_dataloader(args, "train", args.data_files, *tiny, batch_size=4, ranks=Ranks()))
    assert sum(len(b["input_ids"]) for b in batches) == 5
    assert dict(zip(COUNTED, sum(b["data_counts"] for b in batches).tolist()))["undecodable"] == 1


def test_one_persistent_worker_reads_the_same_sample_order_as_none_in_every_epoch(tmp_path, tiny):
    """One DataLoader worker overlaps preprocessing with the step without changing the data: the
    shuffled training rows arrive in the same order as with none (so resume stays exact too), in
    every epoch, though the worker lives across epochs (the epoch is in shared memory)."""
    write_parquet(tmp_path / "rows.parquet", [(png(Image.new("RGB", (8, 8), (i, 0, 0))), f"caption {i}")
                                              for i in range(40)])

    def three_epochs(workers):
        args = DataArgs(dataset_name="parquet", data_files=str(tmp_path / "rows.parquet"),
                        dataloader_num_workers=workers, shuffle_buffer_size=16)
        loader = build_dataloader(args, "train", args.data_files, *tiny, batch_size=8, ranks=Ranks(),
                                  shuffle_seed=3)
        assert loader.persistent_workers == bool(workers)
        return [(epoch, batch["input_ids"]) for (epoch, batch), _ in zip(batches_forever(loader), range(15))]

    in_process, in_worker = three_epochs(0), three_epochs(1)
    assert [epoch for epoch, _ in in_worker] == [0] * 5 + [1] * 5 + [2] * 5
    for (_, expected), (_, got) in zip(in_process, in_worker):
        assert torch.equal(expected, got)
    epochs = [torch.cat([ids for epoch, ids in in_worker if epoch == e]) for e in range(3)]
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])  # reshuffled


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_the_loader_state_is_exact_with_workers_and_epochs_order_shards_anew(tmp_path, tiny, workers):
    """The loader's state after any batch (each worker's stream position and which worker is next),
    through JSON as a checkpoint holds it, resumes the exact batches that followed, also across an
    epoch's end, their --train_augment crops included; each epoch reads the 4 shards in another order, so
    epochs differ from the start."""
    for shard in range(4):
        write_parquet(tmp_path / f"rows-{shard}.parquet", [(png(Image.new("RGB", (8, 8), (i, shard, 0))),
                                                            f"caption {shard} {i}") for i in range(23)])

    def loader():
        args = DataArgs(dataset_name="parquet", data_files=str(tmp_path / "*.parquet"), dataloader_num_workers=workers,
                        shuffle_buffer_size=8, train_augment=True)
        return build_dataloader(args, "train", args.data_files, *tiny, batch_size=5, ranks=Ranks(),
                                shuffle_seed=3)

    straight_loader, straight, states = loader(), [], []
    for (epoch, batch), _ in zip(batches_forever(straight_loader), range(45)):
        straight.append((epoch, batch["input_ids"], batch["pixel_values"]))
        states.append((epoch, json.loads(json.dumps(straight_loader.state_dict()))))
    first_epoch_end = [epoch for epoch, *_ in straight].index(1) - 1
    for at in (3, first_epoch_end - 1, first_epoch_end, first_epoch_end + 1, 30):
        resumed_loader = loader()
        epoch, state = states[at]
        resumed_loader.load_state_dict(state)
        resumed = batches_forever(resumed_loader, resumed_epoch=epoch)
        for (expected_epoch, ids, pixels), ((got_epoch, batch), _) in zip(straight[at + 1:], zip(resumed, range(8))):
            assert got_epoch == expected_epoch and torch.equal(batch["input_ids"], ids), f"resumed after {at}"
            assert torch.equal(batch["pixel_values"], pixels), f"crops resumed after {at}"
    tokenizer = tiny[0]
    shard_order = [list(dict.fromkeys(caption.split()[1] for epoch, ids, _ in straight if epoch == e
                                      for caption in tokenizer.batch_decode(ids, skip_special_tokens=True)))
                   for e in (0, 1)]
    assert sorted(shard_order[0]) == sorted(shard_order[1]) == ["0", "1", "2", "3"]
    assert shard_order[0] != shard_order[1], shard_order


def test_train_augment_crops_training_rows_only(tiny):
    """--train_augment: the training rows are open_clip's random crops, at the eval transform's size but other
    pixels, the same again from the same stream positions; the evaluation split keeps the eval transform."""
    def first_batch(augment, split, seed):
        args = DataArgs(train_augment=augment, dataloader_num_workers=0)
        return next(iter(build_dataloader(args, split, None, *tiny, batch_size=16, ranks=Ranks(),
                                          shuffle_seed=seed)))

    cropped, again, plain = first_batch(True, "train", 0), first_batch(True, "train", 0), first_batch(False, "train", 0)
    assert torch.equal(cropped["input_ids"], plain["input_ids"])  # the same rows
    assert cropped["pixel_values"].shape == plain["pixel_values"].shape
    assert torch.equal(cropped["pixel_values"], again["pixel_values"])
    different = (cropped["pixel_values"] != plain["pixel_values"]).flatten(1).any(1)
    assert different.float().mean() > 0.9, different  # (a crop of the whole image at its own ratio is rare)
    evaluated = [first_batch(augment, "test", None)["pixel_values"] for augment in (True, False)]
    assert torch.equal(*evaluated)


def test_default_workers_follow_cores_and_shards(monkeypatch):
    from mmrecipes.loader import default_num_workers

    assert default_num_workers(num_shards=4) == 0  # CPU: the step uses every core
    assert default_num_workers(num_shards=4, cpu_workers=1) == 1
    assert default_num_workers(num_shards=0, cpu_workers=1) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_num_workers(num_shards=1024) == 11  # 12 cores per GPU process, one for the loop
    assert default_num_workers(num_shards=4) == 4  # no idle workers (torch warns about those)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "96")
    assert default_num_workers(num_shards=1024) == 0


def test_workers_outlive_a_preemption_signal_to_the_process_group(tiny):
    """Launchers and Slurm signal a rank's whole process group. The worker is in a session of its
    own, and the fork server it comes from ignores the signal, so the batches keep coming until
    the recipe's step boundary (where StepGuard saves and exits)."""
    args = DataArgs(dataloader_num_workers=1)
    loader = build_dataloader(args, "train", None, *tiny, batch_size=32, ranks=Ranks(), shuffle_seed=0)
    batches = iter(loader)
    next(batches)
    worker, = batches._workers
    assert os.getpgid(worker.pid) != os.getpgid(0)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert os.getpgid(server) == os.getpgid(0)  # what the group signal reaches
    os.kill(server, signal.SIGTERM)
    time.sleep(6)  # longer than the worker's parent check (torch's MP_STATUS_CHECK_INTERVAL, 5 s)
    assert len([batch for _, batch in zip(range(40), batches)]) == 40  # more than the prefetched ones


def test_the_held_out_check_reads_a_few_rows_not_a_batch(tiny, monkeypatch):
    """`check_held_out` decides from the first row kept, read `FIRST_ROWS` at a time in this process: it took the
    loader's first batch (128 rows preprocessed, then thrown away, before every run's first step). The evaluation
    still reads every row."""
    seen = []
    preprocess = ImageTextPreprocessor.__call__
    monkeypatch.setattr(ImageTextPreprocessor, "__call__",
                        lambda self, batch: seen.append(len(next(iter(batch.values())))) or preprocess(self, batch))
    args = DataArgs()  # the embedded held-out pairs
    loader = build_dataloader(args, args.eval_split, None, *tiny, batch_size=128, ranks=Ranks())
    check_held_out(loader, "cpu", args.eval_split)
    assert seen == [FIRST_ROWS]
    assert sum(len(batch["input_ids"]) for batch in loader) == 512
