"""Clips decoded and sampled (mmrecipes.vlm.rows.videos), in process: frame sampling as transformers' video
processors sample, the motion kept in order, and every bad clip a counted problem, never an exception."""

import io
import sys

import av
import datasets
import numpy
import pytest
from transformers import AutoProcessor

from launch import REPO
from mmrecipes.vlm.arguments import VideoArgs
from mmrecipes.vlm.rows.videos import decode_video, sampled_indices

sys.path.insert(0, str(REPO / "data_prep"))
from make_shapes import COLORS  # noqa: E402
from make_videos import colour_sequence, encode_clip, moving_shape  # noqa: E402


def test_sampling_takes_fps_frames_per_second_capped_and_spread_evenly():
    assert sampled_indices(8, 2.0, 2.0, 8) == [1, 3, 5, 7]  # 4 frames: the middle of each quarter
    assert sampled_indices(300, 10.0, 2.0, 8) == [18, 56, 93, 131, 168, 206, 243, 281]  # 20 wanted, 8 kept
    assert sampled_indices(8, 0.2, 2.0, 8) == [4]  # shorter than one sample's worth: still one frame
    assert sampled_indices(3, 2.0, 30.0, 16) == [0, 1, 2]  # never more than the clip has
    assert sampled_indices(10, None, 2.0, 4) == [1, 3, 6, 8]  # no duration known: max_frames


def centre_x(frame):
    return numpy.nonzero(frame.max(axis=-1) > 100)[1].mean()


@pytest.mark.parametrize("wrap", [bytes, lambda clip: {"bytes": clip, "path": None}, "path"])
def test_the_motion_survives_decoding_in_frame_order(wrap, tmp_path):
    clip = encode_clip(moving_shape("right", "red", "circle"))
    if wrap == "path":
        (tmp_path / "clip.mp4").write_bytes(clip)
        source = tmp_path / "clip.mp4"
    else:
        source = wrap(clip)
    video, problem = decode_video(source, VideoArgs(video_fps=100, video_max_frames=8))
    assert problem is None and video.frames.shape == (8, 48, 48, 3) and video.frames.dtype == numpy.uint8
    xs = [centre_x(frame) for frame in video.frames]
    assert xs == sorted(xs) and xs[-1] - xs[0] > 20  # left to right, across the frame
    # The default 2 frames per second of a 2-second clip: 4 of them, still in order, and the metadata a video
    # processor reads the sampling rate from says so.
    video, _ = decode_video(source, VideoArgs())
    assert len(video.frames) == 4 and [centre_x(frame) for frame in video.frames] == sorted(xs)[1::2]
    metadata = video.metadata
    assert (metadata.total_num_frames, metadata.fps, metadata.frames_indices) == (8, 4.0, [1, 3, 5, 7])
    assert metadata.sampled_fps == 2.0 and metadata.duration == 2.0


def test_frame_order_carries_the_colour_sequence():
    video, _ = decode_video(encode_clip(colour_sequence("red", "blue", "square")), VideoArgs())
    reds = [frame[..., 0].mean() > frame[..., 2].mean() for frame in video.frames]
    assert reds == [True, True, False, False]


def test_the_embedded_clips_answer_their_questions_from_the_sampled_frames():
    """data/vlm_shapes/video_chat (data_prep/make_videos.py): every held-out answer follows from the frames the
    default flags sample, through the shape's path or the colours in order, and both kinds are there."""
    rows = datasets.load_dataset("parquet", data_files=str(REPO / "data/vlm_shapes/video_chat/test-*.parquet"),
                                 split="train")
    kinds = set()
    for row in rows:
        (user, assistant), (clip,) = row["messages"], row["videos"]
        question, answer = user["content"][-1]["text"], assistant["content"][0]["text"]
        video, problem = decode_video(clip, VideoArgs())
        assert problem is None and len(video.frames) == 4
        frames = video.frames
        lit = [numpy.nonzero(frame.max(axis=-1) > 100) for frame in frames]
        if question == "Which way does the shape move?":
            dy, dx = (lit[-1][axis].mean() - lit[0][axis].mean() for axis in (0, 1))
            assert answer == (("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up"))
        else:
            first = frames[0][lit[0]].mean(axis=0)
            assert answer == min(COLORS, key=lambda name: numpy.abs(numpy.subtract(COLORS[name], first)).sum())
            assert numpy.abs(frames[-1][lit[-1]].mean(axis=0) - first).sum() > 60  # the second colour differs
        kinds.add(question)
    assert len(rows) == 64 and len(kinds) == 2


def test_qwen_video_processor_takes_our_frames_at_our_sampling_rate(tiny_vlms):
    """Qwen2.5-VL's own processor, given the sampled frames and their metadata without sampling again: 4 frames
    are 2 temporal patches of 12 x 12 (48 px / 4), merged 2 x 2 into 72 tokens, each patch 1 s of clip (2
    frames a second): what its 3-D positions use."""
    processor = AutoProcessor.from_pretrained(tiny_vlms["qwen2_5_vl"])
    video, _ = decode_video(encode_clip(moving_shape("up", "green", "square")), VideoArgs())
    chat = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way?"}]}]
    inputs = processor(text=processor.apply_chat_template(chat, add_generation_prompt=True), videos=[video.frames],
                       video_metadata=[video.metadata], do_sample_frames=False, return_tensors="pt")
    assert inputs["video_grid_thw"].tolist() == [[2, 12, 12]] and inputs["second_per_grid_ts"].tolist() == [1.0]
    assert (inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids(processor.video_token)).sum() == 72


def audio_only() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(numpy.zeros((1, 1024), numpy.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return buffer.getvalue()


def empty_video_stream() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="avi") as container:  # AVI keeps a stream that has no packet
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 48, 48, "yuv420p"
        container.start_encoding()  # the header: a video stream, and no frame after it
    return buffer.getvalue()


def test_bad_clips_are_problems_to_count_never_exceptions(tmp_path):
    clip = encode_clip(moving_shape("up", "green", "triangle"))
    (tmp_path / "folder.mp4").mkdir()
    cases = {
        "zero bytes": b"",
        "truncated": clip[: len(clip) // 2],
        "not a video": b"\x89PNG\r\n\x1a\n" + bytes(56),
        "no video stream": audio_only(),
        "a directory": tmp_path / "folder.mp4",
        "missing": tmp_path / "missing.mp4",
    }
    for name, source in cases.items():
        assert decode_video(source, VideoArgs()) == (None, "undecodable"), name
    assert decode_video(empty_video_stream(), VideoArgs()) == (None, "no_frames")
    # Too long by its header (2 s here), refused before decoding.
    assert decode_video(clip, VideoArgs(video_max_seconds=1.5)) == (None, "video_too_long")
    assert decode_video(clip, VideoArgs(video_max_seconds=2.5))[1] is None


def test_flags_are_checked():
    for bad in ({"video_fps": 0}, {"video_max_frames": 0}, {"video_max_seconds": -1.0}, {"video_fps": float("nan")}):
        with pytest.raises(ValueError):
            VideoArgs(**bad)
