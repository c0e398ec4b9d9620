"""Video clips from whatever a row holds, decoded with PyAV in the DataLoader workers (its wheels
bundle FFmpeg).

`decode_video` never raises: it gives the sampled frames as one uint8 array with the clip's
`VideoMetadata` (what a processor given `do_sample_frames=False` reads the sampling rate from), or
why there are none, for the caller to count: "undecodable", "no_frames", "video_too_long" and
"too_large" (the last two from the header, before decoding). Frames are sampled as the video
processors' `fps` / `num_frames` do; a stream without a frame count is counted packet by packet, so
only the sampled frames are ever decoded and held (docs/vlm.md, "Video").
"""

import logging
import math
from typing import NamedTuple

import av
import numpy
from transformers.video_utils import VideoMetadata

from ...audio import stream_seconds
from ...images import readable_source
from ..arguments import VideoArgs

logger = logging.getLogger(__name__)

VIDEO_COUNTED = ("no_frames", "video_too_long")  # besides "undecodable", which images share


class DecodedVideo(NamedTuple):
    frames: numpy.ndarray  # uint8 (frames, height, width, 3)
    metadata: VideoMetadata


def sampled_indices(total_frames: int, seconds: float | None, fps: float, max_frames: int) -> list[int]:
    """Indices of `fps` frames per second of clip, at most `max_frames`, at least one, each the
    middle frame of an equal stretch of the clip (no duration known: `max_frames`)."""
    per_second = math.floor(seconds * fps) if seconds else max_frames
    count = max(1, min(max_frames, total_frames, per_second))
    stretch = total_frames / count
    return [min(total_frames - 1, int(stretch * (index + 0.5))) for index in range(count)]


def decode_video(raw_video, args: VideoArgs):
    """(DecodedVideo or None, problem or None)."""
    try:
        raw_video = readable_source(raw_video)
        if raw_video is None:
            return None, "undecodable"
        with av.open(raw_video, mode="r") as container:
            if not container.streams.video:
                return None, "undecodable"
            stream = container.streams.video[0]
            if stream.codec_context.width * stream.codec_context.height > args.video_max_pixels:
                return None, "too_large"
            seconds = stream_seconds(container, stream)
            if seconds is not None and seconds > args.video_max_seconds:
                return None, "video_too_long"
            rate = float(stream.average_rate or 0)
            total = stream.frames or (round(seconds * rate) if seconds and rate else 0)
            # no length in the header: count the packets (nothing decoded), then decode from the
            # start
            if not total:
                total = sum(packet.size > 0 for packet in container.demux(stream))
                if not total:
                    return None, "no_frames"
                seconds = seconds if seconds and seconds > 0 else total / (rate or 1)
                container.seek(0, stream=stream)
            kept = sampled_indices(total, seconds, args.video_fps, args.video_max_frames)
            frames = []
            for index, frame in enumerate(container.decode(stream)):
                if index in kept:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if index >= kept[-1]:
                    break
    # missing files; PyAV raises many types for corrupt or truncated input
    except Exception as error:
        logger.debug("undecodable video: %s", error)
        return None, "undecodable"
    if not frames:
        return None, "no_frames"
    kept = kept[:len(frames)]  # fewer than sampled where the header overstated the length
    rate = rate or (total / seconds if seconds else 1.0)  # no rate in the header: the clip's own
    metadata = VideoMetadata(total_num_frames=total, fps=rate, duration=total / rate, frames_indices=kept)
    return DecodedVideo(numpy.stack(frames), metadata), None
