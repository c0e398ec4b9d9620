"""Streamed chat data for VLM fine-tuning: rows in any public layout -> tokens + labels, bad rows
counted.

Each row is told apart by its columns (TRL's `messages`, ShareGPT, LLaMA-Factory's and LLaVA's
`conversations`, image-caption rows: docs/data.md) and becomes image and video content parts, which
the checkpoint's own chat template and processor turn into its tokens; the labels are the assistant
turns (`labels.AnswerLabeller`). Relative media paths resolve against `--image_folder` /
`--video_folder`, else the data file's folder, never outside it unless asked. A row is never
truncated: one that is too long, or whose media or placeholders do not fit, raises `Skip` and is
counted; a `<video>` placeholder never reaches a model that takes no video as the text it looks
like, nor an `<audio>` one (or an audio part, or a row's audio column) a model that does not hear: such rows are
counted (audio) instead of trained without their sound. Audio clips resolve as images do.
"""

import json
import logging
import re

import torch
from PIL import Image

from ...audio import AUDIO_COUNTED, audio_kwargs
from ...loader import check_held_out, rank_loader
from ...skips import SKIPPED, DropCounter, Skip
from ...sources import DATA_FILE, PROBLEM, mixed_stream, row_name
from ..arguments import ChatDataArgs
from .labels import IGNORE_INDEX, ReasoningDropped, TemplateError, UnalignedAnswer
from .media import AUDIO_COLUMNS, NOT_TAKEN, media_folder, media_not_taken, row_audios, row_images, row_videos
from .videos import VIDEO_COUNTED

logger = logging.getLogger(__name__)

# What the log reports: images converted to RGB, and rows skipped because an image does not decode (or is not
# a regular file), is too large or too elongated, or lies outside --image_folder; the image placeholders do
# not match the images; the row is over max_length or has no answer token; its answer tokens are not found
# exactly in the processor's ids (labels.UnalignedAnswer); its text is not UTF-8; it is not
# a well-formed conversation (or the chat template refuses it); its file is empty, unreadable or truncated; or
# it holds audio where the checkpoint does not hear, an image where it only hears, or a video where it takes none; a
# clip yields no frame or is too long; the video placeholders do not match the clips; an audio clip does not decode,
# is empty or too long; the audio placeholders do not match the clips.
CHAT_COUNTED = ("converted", "undecodable", "too_large", "outside_folder", "image_mismatch", "too_long", "no_target",
                "unaligned", "bad_text", "bad_row", "bad_shard", "image", "audio", "video", *VIDEO_COUNTED,
                "video_mismatch", *AUDIO_COUNTED, "audio_mismatch")
CAPTIONS = ("caption", "text")  # image-caption rows: a conversation of the image and its caption
CHAT_COLUMNS = ["messages", "images", "conversations", "image", "videos", "video", *AUDIO_COLUMNS, "id", "tools",
                *CAPTIONS]
MAX_CHARS_PER_TOKEN = 32  # a bound on the characters of text one token holds, with a wide margin
# about what a token holds of English: longer texts are tokenised before labelling
TYPICAL_CHARS_PER_TOKEN = 4
# per token: padded
TOKEN_ALIGNED = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
# what the chat templates know; a bot's turn is a bad_row
ROLES = ("system", "user", "assistant", "tool")
LLAVA_ROLES = {"human": "user", "gpt": "assistant", **{role: role for role in ROLES}}
# LLaVA's placeholders (LLaMA-Factory's and ms-swift's <audio>) -> content part types
MEDIA_PARTS = {"<image>": "image", "<video>": "video", "<audio>": "audio"}


class BadRow(Skip):
    """A row that is not a well-formed conversation: skipped and counted as bad_row."""

    def __init__(self, detail: str):
        super().__init__("bad_row", detail)


def labelling_skip(error: TemplateError) -> Skip:
    """How a row whose labelling raised `error` is skipped and counted."""
    if isinstance(error, UnalignedAnswer):
        return Skip("unaligned", str(error))
    if isinstance(error, ReasoningDropped):
        return BadRow(str(error))
    # the template renders this row's turns differently from its prefixes
    return Skip("no_target", "the chat template renders its turns differently from their prefixes")


def to_chat(row):
    """(messages, raw images, raw videos) of a row in any of the layouts in the module docstring;
    raises BadRow for anything else. Paths are returned as written (`media_folder` says what they
    are relative to)."""
    key = "messages" if row.get("messages") is not None else "conversations"
    if row.get(key) is None and (caption := next((row[name] for name in CAPTIONS if row.get(name) is not None),
                                                  None)) is not None:
        return _captioned(caption), row_media(row, "images", "image"), []
    if not isinstance(row.get(key), list) or not row[key]:
        raise BadRow("no messages and no conversations")
    return [to_message(turn) for turn in row[key]], row_media(row, "images", "image"), row_media(row, "videos", "video")


def _captioned(caption) -> list[dict]:
    """An image-caption row (the CLIP data; LLaVA's stage 1) as a conversation: the image, then the
    caption."""
    if not isinstance(caption, str) or not caption.strip():
        raise BadRow(f"a caption that is not text: {caption!r:.80}")
    return [{"role": "user", "content": [{"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": caption.strip()}]}]


def to_message(turn) -> dict:
    """A message of a role/content turn (TRL, LLaMA-Factory) or a from/value one (ShareGPT,
    LLaVA)."""
    if isinstance(turn, dict) and "from" in turn:
        if _field(turn, "from") not in LLAVA_ROLES:
            raise BadRow(f"unknown speaker {turn['from']!r}")
        return {"role": LLAVA_ROLES[turn["from"]], "content": _content_parts(_field(turn, "value"))}
    if not (isinstance(turn, dict) and "role" in turn):
        keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
        raise BadRow(f"a turn with keys {keys}: turns are from/value (ShareGPT, LLaVA) or role/content (TRL, "
                     "LLaMA-Factory)")
    if _field(turn, "role") not in ROLES:
        raise BadRow(f"unknown role {turn['role']!r}: {', '.join(ROLES)}")
    calls_only = turn["role"] == "assistant" and turn.get("tool_calls") and turn.get("content") is None
    # an assistant turn of calls alone has no content in TRL's datasets (and OpenAI's): an empty one, its calls kept
    message = {"role": turn["role"], "content": [] if calls_only else _content_parts(_field(turn, "content", list))}
    # an assistant's calls (TRL's layout; arguments as an object or JSON text)
    if turn.get("tool_calls"):
        message["tool_calls"] = [_tool_call(call) for call in turn["tool_calls"]]
    if turn.get("name") is not None:  # a tool's turn: the tool it answers for
        message["name"] = str(turn["name"])
    # the transformers / OpenAI field the reasoning templates read (empty: none, as datasets fill other turns)
    if turn.get("reasoning_content"):
        message["reasoning_content"] = _reasoning(turn)
    if turn["role"] == "assistant":
        _check_inline_reasoning(message)
    return message


def _check_inline_reasoning(message: dict):
    """An answer's reasoning inlined as `<think>...</think>` (the reasoning templates read it so, as
    they read `reasoning_content`): refused where it would be trained as other text than the
    model writes: a block never closed, or one beside a `reasoning_content` (two reasonings)."""
    text = "".join(part.get("text") or "" for part in message["content"] if part["type"] == "text")
    if "<think>" not in text:
        return
    if "</think>" not in text.split("<think>", 1)[1]:
        raise BadRow("an assistant turn opens <think> and never closes it: its reasoning has no end to train")
    if message.get("reasoning_content"):
        raise BadRow("an assistant turn with both reasoning_content and an inline <think> block: two reasonings")


def _reasoning(turn) -> str:
    if turn["role"] != "assistant":
        raise BadRow(f"reasoning_content on a {turn['role']} turn: only an assistant's turn holds reasoning")
    if not isinstance(turn["reasoning_content"], str):
        raise BadRow(f"reasoning_content is {type(turn['reasoning_content']).__name__}, not text")
    return turn["reasoning_content"]


def _tool_call(call) -> dict:
    try:
        function = call["function"]
        arguments = function.get("arguments") or {}
        arguments = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        return {"type": "function", "function": {"name": str(function["name"]), "arguments": arguments}}
    except (TypeError, KeyError, AttributeError, ValueError) as error:
        raise BadRow(f"a tool call that is not {{\"function\": {{\"name\", \"arguments\"}}}}: {call!r:.80}") from error


def row_tools(row) -> list | None:
    """The JSON schemas of a row's `tools` column (TRL's: a list, or its JSON text), which its
    template renders."""
    tools = row.get("tools")
    if tools is None:
        return None
    tools = json.loads(tools) if isinstance(tools, str) else tools
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRow(f"tools must be a list of JSON schemas, not {tools!r:.80}")
    return tools or None


def string_prompt(prompt: str, images: list) -> dict:
    """A TRL string prompt as a user turn: its `<image>` placeholders become image parts, or, where
    it has none, one image part per image goes in front of its text (TRL's DPO and GRPO rows)."""
    placeholders = "" if "<image>" in prompt else "<image>" * len(images)
    return to_message({"role": "user", "content": placeholders + prompt})


def row_media(row, *keys) -> list:
    """The row's images (or videos) from the first of `keys` that holds any: a list, or one of
    them."""
    media = next((row[key] for key in keys if row.get(key)), [])
    media = [media] if isinstance(media, (str, bytes, dict, Image.Image)) else media
    if not isinstance(media, list) or not all(isinstance(item, (str, bytes, dict, Image.Image)) for item in media):
        raise BadRow(f"{'/'.join(keys)} must be a path, or a list of paths, bytes, {{bytes, path}} dicts or images, "
                     f"not {media!r:.80}")
    return media


def _field(item, key, kind=str):
    """`item[key]`, which must be a `kind` (a string unless told; a string always passes for
    content)."""
    value = item.get(key) if isinstance(item, dict) else None
    if not isinstance(value, (kind, str)):
        raise BadRow(f"{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _content_parts(content):
    """Content parts; a string's `<image>`, `<video>` and `<audio>` placeholders become image, video and audio parts
    (LLaVA's convention). A media part carries no text key: some templates test `'text' in part`
    before the part's type."""
    if not isinstance(content, str):
        parts = [{"type": part["type"]} if _field(part, "type") in MEDIA_PARTS.values()
                 else {"type": part["type"], "text": part.get("text")} for part in content]
        if any(part["type"] == "text" and not isinstance(part["text"], str) for part in parts):
            raise BadRow("a text part without text")
        return parts
    parts = []
    for piece in re.split(f"({'|'.join(MEDIA_PARTS)})", content):
        if piece in MEDIA_PARTS:
            parts.append({"type": MEDIA_PARTS[piece]})
        elif piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    return parts


class ChatPreprocessor:
    """Batched `datasets.map` function: chat rows in, {input_ids, labels, media_inputs} rows out,
    bad rows dropped and counted (`Skip`; the counts travel on the next kept row, `SKIPPED`)."""

    COLUMNS = CHAT_COLUMNS  # what it reads of a row
    # what `example` gives for a kept row, in this order
    OUTPUTS = ("input_ids", "labels", "media_inputs")

    def __init__(self, args: ChatDataArgs, labeller, max_length: int):
        self.args, self.labeller, self.max_length = args, labeller, max_length
        self.drops = DropCounter()
        # what was already logged once: "video", "audio", and the kinds of unexpected failure
        self.logged = set()

    def __call__(self, batch):
        out = {name: [] for name in (*self.OUTPUTS, SKIPPED)}
        for row in (dict(zip(batch, values)) for values in zip(*batch.values())):
            try:
                if row.get(PROBLEM):  # what `load_stream` could not read
                    raise Skip(row[PROBLEM])
                values, note = self.example(row)
            except Skip as skip:
                self.drops.drop(skip, row_name(row))
                continue
            for key, value in zip(self.OUTPUTS, values, strict=True):
                out[key].append(value)
            out[SKIPPED].append(self.drops.keep(note))
        return out

    def example(self, row):
        """(`tokenize`'s outputs, a note) of a raw row, or `Skip` ("video": a video the checkpoint
        cannot take; "audio"); any other failure is a counted "bad_row", never a crash (logged once per kind:
        a chat template that refuses a row raises its own errors, and so would a bug)."""
        try:
            messages, raw_images, raw_videos = to_chat(row)
            hears = self.labeller.audio_token_id is not None
            if kind := media_not_taken(row, messages, self.labeller.video_token_id is not None, hears,
                                       takes_images=self.labeller.image_token_id is not None):
                why = NOT_TAKEN[kind]
                if kind not in self.logged:  # said once, not only counted
                    self.logged.add(kind)
                    logger.warning("skipping %s rows (counted as %s): %s", kind, kind, why)
                raise Skip(kind, why)
            images_folder = media_folder(row, self.args.image_folder)
            videos_folder = media_folder(row, self.args.video_folder or self.args.image_folder)
            raw_audios = row_media(row, *AUDIO_COLUMNS) if hears else []
            return self.tokenize(messages, raw_images, raw_videos, images_folder, videos_folder, row_tools(row),
                                 raw_audios)
        except Skip:
            raise
        except Exception as error:
            if type(error) not in self.logged:
                self.logged.add(type(error))
                logger.warning("skipping a row (counted as bad_row): %s: %s", type(error).__name__, error)
            raise Skip("bad_row", f"{type(error).__name__}: {error}") from error

    def tokenize(self, messages, raw_images, raw_videos=(), images_folder=None, videos_folder=None, tools=None,
                 raw_audios=()):
        """((input_ids, labels, media_inputs), note), or `Skip` with the reason the row is dropped.
        Relative media paths resolve against the folders (`media_folder`; audio clips: the images').
        A row whose text alone cannot fit is dropped first, before its media are decoded and before the
        labeller renders and tokenises it."""
        self.check_text_length(messages)
        images, note = row_images(self.args, images_folder, messages, raw_images)
        videos = row_videos(self.args, videos_folder, messages, raw_videos)
        audios = self.clips(images_folder, messages, raw_audios)
        try:
            input_ids, labels, media_inputs = encode_row(self.labeller, messages, images, videos, tools, audios)
        except TemplateError as error:
            raise labelling_skip(error) from error
        if len(input_ids) > self.max_length:
            raise Skip("too_long", f"{len(input_ids)} tokens, over {self.max_length}")
        # the first token is never a target after the shift
        if not (labels[1:] != IGNORE_INDEX).any():
            raise Skip("no_target", "no assistant answer to learn")
        return (input_ids, labels, media_inputs), note

    def clips(self, folder, messages, raw_audios) -> list:
        """A row's clips decoded at the feature extractor's rate (`row_audios`), where the labeller
        hears (a placeholder without its clip is counted too); none otherwise."""
        if self.labeller.audio_token_id is None:
            return []
        return row_audios(self.args, folder, messages, raw_audios,
                          self.labeller.processor.feature_extractor.sampling_rate)

    def check_text_length(self, messages):
        """Skip (too_long) a row whose text parts alone cannot fit in `max_length` tokens: over
        `MAX_CHARS_PER_TOKEN` characters a token (no tokenizer packs natural text so densely), or,
        for a text long enough to be in doubt, over the limit once tokenised on their own (a margin
        of one token a part: in the template a part may merge with its neighbours)."""
        texts = [part["text"] for message in messages for part in message["content"] if part["type"] == "text"]
        texts += [message["reasoning_content"] for message in messages if message.get("reasoning_content")]
        characters = sum(map(len, texts))
        if characters > self.max_length * MAX_CHARS_PER_TOKEN:
            raise Skip("too_long", f"{characters} characters of text, more than {self.max_length} tokens hold")
        if characters <= self.max_length * TYPICAL_CHARS_PER_TOKEN:
            # most rows: the labeller measures them, without a tokenisation of their own here
            return
        tokens = sum(map(len, self.labeller.tokenizer(texts, add_special_tokens=False)["input_ids"])) if texts else 0
        if tokens > self.max_length + len(texts):
            raise Skip("too_long", f"its text alone is {tokens} tokens, over {self.max_length}")

    @staticmethod
    def check_columns(name, available):
        if available is not None and not set(available) & {"messages", "conversations", *CAPTIONS}:
            raise ValueError(f"{name} has columns {available}: a chat source needs 'messages' (TRL, ShareGPT) or "
                             "'conversations' (LLaVA, LLaMA-Factory), with 'images'/'image' and 'videos'/'video', or "
                             "image-caption rows ('image' and 'text' or 'caption') (the layouts in docs/data.md); "
                             "rename its columns to one of them")


def encode_row(labeller, messages, images, videos=(), tools=None, audios=()):
    """(input_ids, labels, media_inputs) of one conversation (with its `tools`' schemas): the
    labeller's tokens and targets, and the processor's other outputs (image, video and audio inputs;
    per-token ones like mm_token_type_ids unbatched)."""
    encoded, target = labeller(messages, images, videos, tools, audios)
    input_ids, media_inputs = unbatched(encoded)
    return input_ids, torch.where(target, input_ids, IGNORE_INDEX), media_inputs


def unbatched(encoded) -> tuple[torch.Tensor, dict]:
    """(input_ids, the other inputs) of a one-conversation processor output, the mask left out."""
    input_ids = torch.as_tensor(encoded.pop("input_ids")[0])
    encoded.pop("attention_mask")
    return input_ids, {key: _as_tensor(value[0] if key in TOKEN_ALIGNED else value) for key, value in encoded.items()}


def prompt_row(processor, messages, images, tools=None, template_kwargs=None, audios=()) -> dict:
    """A collator row of `messages` rendered with the generation prompt (and the `tools`' JSON
    schemas, where given; `template_kwargs`: --chat_template_kwargs; `audios`: its clips, decoded; no target):
    what `generate` is given."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, **({"tools": tools} if tools else {}),
                                         **(template_kwargs or {}))
    heard = dict(audio=list(audios), audio_kwargs=audio_kwargs(processor, audios)) if audios else {}
    input_ids, media_inputs = unbatched(processor(text=text, images=[images] if images else None, **heard))
    return {"input_ids": input_ids, "labels": torch.full_like(input_ids, IGNORE_INDEX), "media_inputs": media_inputs}


def _as_tensor(value):
    """A processor output (a list of per-image arrays/tensors, or nested lists) as one tensor."""
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (int, float, list)):
        return torch.stack([torch.as_tensor(item) for item in value])
    return torch.as_tensor(value)


def build_chat_dataloader(args: ChatDataArgs, labeller, collator, *, batch_size, ranks, shuffle_seed=None,
                          eval_split=False, preprocessor=ChatPreprocessor, preprocessor_kwargs=None):
    """A DataLoader over this rank's rows (`ranks.reads`: `distributed.Ranks`; GRPO's prompts:
    `Ranks.teams`): the training mixture, or (eval_split) the held-out set, read by `preprocessor`
    (conversations; `PreferencePreprocessor`: preference pairs; `PromptPreprocessor`: prompts),
    built with `preprocessor_kwargs` besides. --max_tokens_per_batch is what one rank holds: a
    micro-batch split over `ranks.split_size` ranks holds that many times as many tokens. A held-out
    set that gives no rank a row stops the run now (`loader.check_held_out`: every rank together, a
    collective).

    The sources are mixed at `dataset_weights` (`mmrecipes.sources.mixed_stream`), then the mixture
    is shuffled in blocks and tokenised (`ResumableShuffle`: a checkpoint resumes it exactly). An
    epoch ends once every source has been read once.
    """
    sources = ([(args.eval_dataset_name, args.dataset_config_name, args.eval_split, args.eval_data_files)]
               if eval_split else args.training_sources())
    stream = mixed_stream(sources, None if eval_split else args.dataset_weights, preprocessor.COLUMNS,
                          **ranks.reads(eval_split), seed=shuffle_seed or 0, check_columns=preprocessor.check_columns)
    budget = None  # evaluation keeps fixed batches
    if shuffle_seed is not None and args.max_tokens_per_batch:
        budget = args.max_tokens_per_batch * ranks.split_size
    preprocess = preprocessor(args, labeller, min(args.max_length, budget or args.max_length),
                              **(preprocessor_kwargs or {}))
    loader = rank_loader(stream, preprocess, collator, args, batch_size=batch_size, shuffle_seed=shuffle_seed,
                         remove_columns=[*preprocessor.COLUMNS, PROBLEM, DATA_FILE], budget=budget, cpu_workers=1)
    if eval_split:
        check_held_out(loader, ranks.device, args.eval_dataset_name)
    return loader
