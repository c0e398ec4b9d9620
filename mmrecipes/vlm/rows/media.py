"""A row's media as the chat reader takes them: its paths resolved against the folder they are relative to
(never outside it unless asked), its images and clips decoded, each kind checked against its placeholders, and the
kinds of media a recipe does not train on found, for the row to be skipped and counted (docs/data.md)."""

import functools
import os

from ...images import decode_image
from ...skips import Skip
from ...sources import DATA_FILE
from ..arguments import ChatDataArgs
from .audio import decode_audio
from .videos import decode_video

AUDIO_COLUMNS = ("audios", "audio")  # LLaMA-Factory's and ms-swift's, and one clip's
MEDIA_COLUMNS = {"video": ("videos", "video"), "audio": AUDIO_COLUMNS}  # LLaVA-Video's one clip: `video`
# why a row of that media is skipped (`media_not_taken`)
NOT_TAKEN = {"video": "this model's processor takes no video",
             "audio": "this model has no audio tower (or its processor no feature extractor), or this recipe does not "
                      "train on audio yet"}


def media_folder(row, folder: str | None) -> str | None:
    """What a row's relative image or video paths resolve against: `folder` (--image_folder /
    --video_folder), else the folder of the local file the row was read from (as LLaMA-Factory's
    media_dir), else None (the working directory: `datasets`' own readers do not say which file a
    row came from)."""
    if folder:
        return _resolved_folder(folder)
    data_file = row.get(DATA_FILE)
    return _resolved_folder(data_file, parent=True) if data_file and "://" not in data_file else None


@functools.lru_cache(maxsize=1024)
def _resolved_folder(path: str, parent: bool = False) -> str:
    """The real path of a folder (or of a file's folder), resolved once: a stream asks for the same
    few per row."""
    return os.path.dirname(os.path.realpath(path)) if parent else os.path.realpath(path)


def holds(row, messages, kind: str) -> bool:
    """A `kind` ("video", "audio") part or placeholder in `messages`, or a column of that kind with something in it."""
    return count_parts(messages, kind) > 0 or any(row.get(column) for column in MEDIA_COLUMNS[kind])


def media_not_taken(row, messages, takes_video: bool, takes_audio: bool = False) -> str | None:
    """The kind of media a row holds that is not trained here, for the row to be skipped and counted as it: "audio"
    where not `takes_audio`, "video" where not `takes_video`; else None."""
    if not takes_audio and holds(row, messages, "audio"):
        return "audio"
    return "video" if not takes_video and holds(row, messages, "video") else None


def count_parts(messages, kind) -> int:
    return sum(part["type"] == kind for message in messages for part in message["content"])


def row_images(args: ChatDataArgs, folder: str | None, messages, raw_images):
    """(decoded images, a note such as "converted") of a row, or `Skip`: its placeholders do not
    match its images, a path leaves `folder` (`media_folder`), or an image does not decode."""
    placeholders = count_parts(messages, "image")
    if placeholders != len(raw_images):
        raise Skip("image_mismatch", f"{placeholders} image placeholders or parts, {len(raw_images)} images")
    images, note = [], None
    for raw_image in raw_images:
        raw_image = _resolved(args, folder, raw_image)
        image, problem = decode_image(raw_image, args.max_image_pixels, args.max_image_aspect_ratio)
        if image is None:
            raise Skip(problem, _unreadable(raw_image))
        images.append(image)
        note = note or problem
    return images, note


def row_videos(args: ChatDataArgs, folder: str | None, messages, raw_videos):
    """The decoded clips of a row (`mmrecipes.vlm.rows.videos.DecodedVideo`s), or `Skip`: as for
    images, and a clip that yields no frame or runs over --video_max_seconds."""
    placeholders = count_parts(messages, "video")
    if placeholders != len(raw_videos):
        raise Skip("video_mismatch", f"{placeholders} video placeholders or parts, {len(raw_videos)} clips")
    videos = []
    for raw_video in raw_videos:
        raw_video = _resolved(args, folder, raw_video)
        video, problem = decode_video(raw_video, args)
        if video is None:
            raise Skip(problem, _unreadable(raw_video))
        videos.append(video)
    return videos


def row_audios(args: ChatDataArgs, folder: str | None, messages, raw_audios, sampling_rate: int):
    """The decoded clips of a row (mono float32 at `sampling_rate`), or `Skip`: its placeholders do not match its
    clips (audio_mismatch), a path leaves `folder`, or a clip does not decode, is empty or runs over
    --audio_max_seconds (`decode_audio`)."""
    placeholders = count_parts(messages, "audio")
    if placeholders != len(raw_audios):
        raise Skip("audio_mismatch", f"{placeholders} audio placeholders or parts, {len(raw_audios)} clips")
    clips = []
    for raw_audio in raw_audios:
        raw_audio = _resolved(args, folder, raw_audio)
        clip, problem = decode_audio(raw_audio, sampling_rate, args.audio_max_seconds)
        if clip is None:
            raise Skip(problem, _unreadable(raw_audio))
        clips.append(clip)
    return clips


def _resolved(args: ChatDataArgs, folder: str | None, raw_media):
    """A media path joined to `folder`, or `Skip` if it resolves outside it (symlinks followed:
    '../' and absolute paths), unless --allow_images_outside_folder; bytes and decoded media as they
    are."""
    if not isinstance(raw_media, str) or not folder:
        return raw_media
    path = os.path.join(folder, raw_media)
    if not args.allow_images_outside_folder and os.path.commonpath([folder, os.path.realpath(path)]) != folder:
        raise Skip("outside_folder", f"{raw_media!r} resolves to {os.path.realpath(path)}, outside {folder}")
    return path


def _unreadable(raw_media) -> str:
    """How a skip report names media that could not be used."""
    if isinstance(raw_media, str):
        return raw_media if os.path.exists(raw_media) else f"{raw_media} (no such file)"
    return f"{type(raw_media).__name__} data"
