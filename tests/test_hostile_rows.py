"""Hostile rows, round three, in process: rows that would stall or balloon a DataLoader worker before they are
dropped are refused from their header or their length first; rows that were lost or read silently are counted."""

import io
import multiprocessing
import resource
import tarfile
import time

import av
import numpy

from mmrecipes.skips import Skip
from mmrecipes.sources import PROBLEM, load_stream, read_files
from mmrecipes.vlm.arguments import ChatDataArgs, VideoArgs, VLMModelArgs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.rows.chat_data import ChatPreprocessor
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.videos import decode_video


def clip(container: str, codec: str, frames: int, width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuvj420p" if codec == "mjpeg" else "yuv420p"
        for index in range(frames):
            pixels = numpy.full((height, width, 3), index % 255, numpy.uint8)
            output.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        output.mux(stream.encode())
    return buffer.getvalue()


def _measured(queue, work, *args):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    result = work(*args)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    queue.put((result, time.perf_counter() - start, grown))


def skip_of(preprocess, row):
    """What `preprocess` skips `row` for (`Skip`), or None: it reads it."""
    try:
        preprocess.example(row)
    except Skip as skip:
        return skip
    return None


def measured(work, *args):
    """(result, seconds, MB of resident memory it added at its peak), in a forked process of its own."""
    context = multiprocessing.get_context("fork")
    queue = context.SimpleQueue()
    process = context.Process(target=_measured, args=(queue, work, *args))
    process.start()
    result = queue.get()
    process.join()
    return result


def test_a_clip_is_bounded_by_its_header_before_decoding():
    """One 8000 x 6000 frame: refused as too_large from the header (it was decoded: 4.5 s and 614 MB for one
    frame of 200M pixels). A stream with no frame count in its header (1,500 frames): it was decoded whole into
    memory (+354 MB here) before 8 frames were kept; now its packets are counted and only those 8 decoded."""
    (video, problem), seconds, grown = measured(decode_video, clip("avi", "mjpeg", 1, 8000, 6000), VideoArgs())
    assert (video, problem) == (None, "too_large") and seconds < 1 and grown < 50, (seconds, grown)
    raw = clip("m4v", "mpeg4", 1500, 320, 240)
    (video, problem), seconds, grown = measured(decode_video, raw, VideoArgs())
    assert problem is None and video.metadata.total_num_frames == 1500 and grown < 100, (seconds, grown)
    assert video.metadata.frames_indices == [93, 281, 468, 656, 843, 1031, 1218, 1406]  # as for a known length
    shades = [int(frame[0, 0, 0]) for frame in video.frames]  # each frame its index's shade, to the codec's loss
    assert all(abs(shade - index % 255) <= 4 for shade, index in zip(shades, video.metadata.frames_indices)), shades


def test_a_text_row_far_over_max_length_is_dropped_before_its_alignment():
    """10,000 and 12,000 repetitive words: the labeller's alignment, quadratic on such text, ran before the length
    check (3.6 s and 50 s here; 22-92 s a row reported). Now the row's text is measured first: a character bound,
    then its tokens alone (0.1 ms and 1.3 ms)."""
    model, processor = load_vlm(VLMModelArgs())
    preprocess = ChatPreprocessor(ChatDataArgs(), AnswerLabeller(processor, stop_token_ids(model, processor)), 256)
    words = " ".join(["red square"] * 5000)
    for text, why in ((words, "characters of text, more than 256 tokens hold"),
                      ("word " * 12000, "characters of text"),  # 50 s before
                      (words[:4000], "its text alone is")):
        row = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "yes"}]}
        skip, seconds, grown = measured(skip_of, preprocess, row)
        assert skip.reason == "too_long" and why in skip.detail and seconds < 2 and grown < 50, (skip, seconds, grown)


def test_silent_data_cases_are_counted_or_read(tmp_path):
    """A tar cut inside a member header read 27 of 48 samples with `bad_shard 0`; a JSON line nested deeper than
    Python's stack (RecursionError) lost the 32 good lines after it; `--dataset_name csv` on a clean file raised
    'Features decoding is only available for datasets with known features'."""
    with tarfile.open(tmp_path / "whole.tar", "w") as tar:
        for key in range(48):
            for field, data in (("jpg", b"\xff\xd8 not decoded here"), ("txt", f"caption {key}".encode())):
                info = tarfile.TarInfo(f"{key:03d}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with tarfile.open(tmp_path / "whole.tar") as tar:
        cut = tar.getmember("027.jpg").offset + 100  # inside the header of sample 27's first member
    (tmp_path / "cut.tar").write_bytes((tmp_path / "whole.tar").read_bytes()[:cut])
    rows = list(read_files([str(tmp_path / "cut.tar")], "webdataset", ["jpg", "txt"]))
    assert [row[PROBLEM] for row in rows] == [None] * 26 + ["bad_shard"]  # the sample before the cut may lack members
    assert [row[PROBLEM] for row in read_files([str(tmp_path / "whole.tar")], "webdataset", ["txt"])] == [None] * 48

    lines = ['{"text": "before"}', "[" * 100_000 + "]" * 100_000, *[f'{{"text": "good {i}"}}' for i in range(32)]]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines))
    rows = list(read_files([str(tmp_path / "rows.jsonl")], "json", ["text"]))
    assert [row[PROBLEM] for row in rows] == [None, "bad_row"] + [None] * 32

    (tmp_path / "pairs.csv").write_text("image,text\nred.png,a red square\nblue.png,a blue circle\n")
    stream, _ = load_stream("csv", None, "train", str(tmp_path / "pairs.csv"), ["image", "text"], data_rank=0,
                            data_world=1)
    assert [row["text"] for row in stream] == ["a red square", "a blue circle"]
