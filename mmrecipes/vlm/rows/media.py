"""A row's media as the chat reader takes them: its paths resolved against the folder they are relative to
(never outside it unless asked), its images and clips decoded, each kind checked against its placeholders, and the
kinds of media a recipe does not train on found, for the row to be skipped and counted (docs/data.md)."""

import functools
import os

from ...audio import decode_audio
from ...images import decode_image
from ...skips import Skip
from ...sources import DATA_FILE
from ..arguments import ChatDataArgs
from .videos import decode_video

AUDIO_COLUMNS = ("audios", "audio")  # LLaMA-Factory's and ms-swift's, and one clip's
# LLaVA-Video's one clip: `video`
MEDIA_COLUMNS = {"image": ("images", "image"), "video": ("videos", "video"), "audio": AUDIO_COLUMNS}
# why a row of that media is skipped (`media_not_taken`)
NOT_TAKEN = {"image": "this model has no vision tower (it only hears)",
             "video": "this model's processor takes no video",
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
    """A `kind` ("image", "video", "audio") part or placeholder in `messages`, or a column of that kind with something
    in it."""
    return count_parts(messages, kind) > 0 or any(row.get(column) for column in MEDIA_COLUMNS[kind])


def media_not_taken(row, messages, takes_video: bool, takes_audio: bool = False, takes_images: bool = True):
    """The kind of media a row holds that is not trained here, for the row to be skipped and counted as it: "audio"
    where not `takes_audio`, "image" where not `takes_images`, "video" where not `takes_video`; else None."""
    for kind, taken in (("audio", takes_audio), ("image", takes_images), ("video", takes_video)):
        if not taken and holds(row, messages, kind):
            return kind
    return None


def count_parts(messages, kind) -> int:
    return sum(part["type"] == kind for message in messages for part in message["content"])


def row_images(args: ChatDataArgs, folder: str | None, messages, raw_images):
    """(decoded images, a note such as "converted") of a row, or `Skip`: its placeholders do not
    match its images, a path leaves `folder` (`media_folder`), or an image does not decode."""
    decoded = _decoded(args, folder, messages, raw_images, "image", "images", lambda raw: decode_image(
        raw, args.max_image_pixels, args.max_image_aspect_ratio))
    return [image for image, _ in decoded], next((note for _, note in decoded if note), None)


def row_videos(args: ChatDataArgs, folder: str | None, messages, raw_videos):
    """The decoded clips of a row (`mmrecipes.vlm.rows.videos.DecodedVideo`s), or `Skip`: as for
    images, and a clip that yields no frame or runs over --video_max_seconds."""
    return [video for video, _ in _decoded(args, folder, messages, raw_videos, "video", "clips",
                                           lambda raw: decode_video(raw, args))]


def row_audios(args: ChatDataArgs, folder: str | None, messages, raw_audios, sampling_rate: int):
    """The decoded clips of a row (mono float32 at `sampling_rate`), or `Skip`: as for images (audio_mismatch), and a
    clip that does not decode, is empty or runs over --audio_max_seconds (`decode_audio`)."""
    return [clip for clip, _ in _decoded(args, folder, messages, raw_audios, "audio", "clips",
                                         lambda raw: decode_audio(raw, sampling_rate, args.audio_max_seconds))]


def _decoded(args: ChatDataArgs, folder: str | None, messages, raw_media, kind: str, noun: str, decode) -> list:
    """(media, note) of each of a row's `raw_media` by `decode` (-> (media or None, its problem or note)), or `Skip`:
    fewer or more `kind` placeholders than media (`<kind>_mismatch`), a path that leaves `folder`, a problem."""
    placeholders = count_parts(messages, kind)
    if placeholders != len(raw_media):
        raise Skip(f"{kind}_mismatch", f"{placeholders} {kind} placeholders or parts, {len(raw_media)} {noun}")
    decoded = []
    for raw in raw_media:
        raw = _resolved(args, folder, raw)
        media, problem = decode(raw)
        if media is None:
            raise Skip(problem, _unreadable(raw))
        decoded.append((media, problem))
    return decoded


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
