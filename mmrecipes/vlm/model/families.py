"""What differs between image-text-to-text families, read from the model itself, not from its name.

Every `AutoModelForImageTextToText` family the recipe trains (Llava, LLaVA-OneVision,
Qwen2/2.5/3-VL, Idefics3/SmolVLM, Gemma 3, ...) exposes the same two hooks:
`get_image_features(pixel_values, **extra)` returns the projected image features, and `forward(...,
mm_encoder_outputs=...)` takes them back. From those, the configs and the module tree this module
derives:

- `check_trainable`: families the recipe cannot train, rejected before any weight is loaded;
- `dummy_image_inputs`: the smallest image the vision step accepts, its extra inputs chosen from
  `get_image_features`' signature (Qwen needs `image_grid_thw`, Idefics3 a 5-D `pixel_values`), and the
  dummy clip and sound of a model with a video path or an audio tower of its own;
- `audio_inputs`: what the audio step takes (`get_audio_features`' signature), where the model hears;
- `lm_features`: the tensors of that call the language model consumes (the projected features,
  and Qwen3-VL's deepstack features);
- `PROJECTORS`: the projector's modules where the widths cannot tell (`module_groups` reads it);
- `placeholder_token_ids`: the image and video placeholders the forward counts, which decoding never
  emits;
- `stateful_mixers`: the language model's token mixers that are not attention (Qwen3.5's Gated
  DeltaNet).
"""

import inspect

import numpy
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata

from ...audio import audio_kwargs, hears
from ...audio_windows import WINDOWS
from .audio_rows import audio_step

# Outputs of a vision encoder that the language model never reads.
ENCODER_ONLY_OUTPUTS = ("last_hidden_state", "hidden_states", "attentions")
# Backs the projector rule (module_groups) where it cannot decide: a tower as wide as the language
# model. tests/test_vlm_families.py checks that rule and table agree on every family listed.
PROJECTORS = {
    "llava": ("model.multi_modal_projector",),
    "llava_next": ("model.multi_modal_projector", "model.image_newline"),
    "llava_onevision": ("model.multi_modal_projector", "model.image_newline"),
    "qwen2_vl": ("model.visual.merger",),
    "qwen2_5_vl": ("model.visual.merger",),
    "qwen3_vl": ("model.visual.merger", "model.visual.deepstack_merger_list"),
    "qwen3_vl_moe": ("model.visual.merger", "model.visual.deepstack_merger_list"),
    "qwen3_5": ("model.visual.merger",),
    "qwen3_5_moe": ("model.visual.merger",),
    "gemma4": ("model.embed_vision", "model.embed_audio"),  # E2B and E4B hear
    "qwen2_5_omni_thinker": ("model.visual.merger", "model.audio_tower.proj"),
    "qwen3_omni_moe_thinker": ("model.visual.merger", "model.visual.merger_list", "model.audio_tower.proj2"),
    "internvl": ("model.multi_modal_projector",),
    "idefics2": ("model.connector",),
    "idefics3": ("model.connector",),
    "smolvlm": ("model.connector",),
    "gemma3": ("model.multi_modal_projector",),
    "mistral3": ("model.multi_modal_projector",),
}


def lm_features(output) -> list[torch.Tensor]:
    """Every tensor of a `get_image_features` output that the language model consumes, flattened out
    of nested lists (per-image features, Qwen3-VL's per-layer deepstack features)."""
    tensors = []

    def collect(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():  # not a mask (Gemma 4's audio rows)
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    for name, value in output.items():
        if name not in ENCODER_ONLY_OUTPUTS:
            collect(value)
    return tensors


def vision_inputs(model) -> set[str]:
    """The inputs of the model's vision step (`get_image_features`' signature); none for a model that only hears
    (Qwen2-Audio)."""
    step = getattr(model, "get_image_features", None)
    return set(inspect.signature(step).parameters) - {"self", "kwargs"} if step is not None else set()


def dummy_image_inputs(model, processor=None) -> dict:
    """The smallest image input the model's vision step accepts, as `get_image_features` kwargs,
    and, given the processor, a one-frame clip for a model whose clips take a path of their own
    (`dummy_video_inputs`).

    Chosen from `get_image_features`' signature and the vision config, not from the model's name:
    a patch grid (`image_grid_thw`: Qwen-VL style) gets one merged token of spatial_merge_size^2
    patches; a tower with a `pixel_attention_mask` (Idefics3 style) one tile of scale_factor x
    patch_size pixels; a tower that takes pixels alone (CLIP, SigLIP: Llava, Gemma 3) one image of
    its image_size. Filled with ones: some towers drop an all-zero image as padding. Any other
    signature (LLaVA-OneVision's `image_sizes`) gets what the processor makes of one small white
    image, with every extra input the tower needs. A model that only hears: no image, its dummy sound alone.
    """
    if processor is None:
        return _dummy_image(model, processor)
    return _dummy_image(model, processor) | dummy_video_inputs(model, processor) | dummy_audio_inputs(model, processor)


def _dummy_image(model, processor) -> dict:
    names = vision_inputs(model)
    if not names:  # a model that only hears
        return {}
    vision = model.config.vision_config
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    if "image_grid_thw" in names:
        merge = vision.spatial_merge_size
        patch_dim = channels * vision.temporal_patch_size * vision.patch_size ** 2
        return {"pixel_values": torch.ones(merge * merge, patch_dim),
                "image_grid_thw": torch.tensor([[1, merge, merge]])}
    if "pixel_attention_mask" in names:
        scale = getattr(model.config, "scale_factor", 1)  # Idefics2 has no pixel shuffle
        height, width = (scale * side for side in height_width(vision.patch_size))
        return {"pixel_values": torch.ones(1, 1, channels, height, width),
                "pixel_attention_mask": torch.ones(1, 1, height, width, dtype=torch.bool)}
    required = {name for name, p in inspect.signature(model.get_image_features).parameters.items()
                if p.default is inspect.Parameter.empty and name not in ("self", "kwargs")}
    if required == {"pixel_values"} and hasattr(vision, "image_size"):
        return {"pixel_values": torch.ones(1, channels, *height_width(vision.image_size))}
    if processor is None:
        raise ValueError(f"{type(model).__name__}.get_image_features needs {sorted(required)}: pass the processor")
    height, width = height_width(getattr(vision, "image_size", 32))
    made = processor.image_processor(images=[Image.new("RGB", (width, height), (255, 255, 255))], return_tensors="pt")
    return {name: value for name, value in made.items() if name in names}


def video_as_image_names(model) -> dict[str, str]:
    """{video input: image input}, paired by position in `get_video_features`' and
    `get_image_features`' signatures (Qwen2/2.5/3-VL: pixel_values_videos -> pixel_values,
    video_grid_thw -> image_grid_thw), or {} for a model without video features. Whether the video
    features really are the image features of those inputs (one tower call can then take both) is
    `video_path`'s probe."""
    if getattr(model, "get_video_features", None) is None:
        return {}
    video, image = ([name for name in inspect.signature(function).parameters if name not in ("self", "kwargs")]
                    for function in (model.get_video_features, model.get_image_features))
    return dict(zip(video, image)) if len(video) == len(image) else {}


@torch.no_grad()
def video_path(model, processor) -> str | None:
    """How the recipe trains this model on clips, from what its processor makes of a 2-frame probe
    clip:
    - "as images": image inputs only (InternVL3: the frames become image tiles), which the image
      path takes;
    - "with images": video inputs whose features equal the image features of the same inputs
      (`video_as_image_names`: Qwen2, 2.5 and 3-VL): one tower call a step takes images, videos or
      the dummy alike, on every rank;
    - "own": `pixel_values_videos` for a video path of the model's own (LLaVA-OneVision: frames
      pooled after the tower) whose features fill the clip's placeholders exactly: every micro-batch
      calls it, on the batch's clips or on a dummy clip (`dummy_video_inputs`).
    No video processor, or anything else: None, and video rows are skipped and counted."""
    if getattr(processor, "video_processor", None) is None or getattr(processor, "video_token", None) is None:
        return None
    made = processor(text=processor.video_token, **_probe_clip(2), return_tensors="pt")
    media = set(made) - {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"}
    if media <= set(inspect.signature(model.get_image_features).parameters):
        return "as images" if "pixel_values" in media else None
    names = video_as_image_names(model)
    try:
        if names:
            videos = {name: made[name] for name in names}
            video = model.get_video_features(**videos, return_dict=True)
            image = model.get_image_features(**{names[name]: value for name, value in videos.items()},
                                             return_dict=True)
            same = all(torch.equal(a, b) for a, b in zip(lm_features(video), lm_features(image), strict=True))
            return "with images" if same else None
        if media != {"pixel_values_videos"} or getattr(model, "get_video_features", None) is None:
            return None
        features = lm_features(model.get_video_features(pixel_values_videos=made["pixel_values_videos"],
                                                        return_dict=True))
    except (TypeError, ValueError, RuntimeError, KeyError):
        return None
    placeholders = int((made["input_ids"] == processor.tokenizer.convert_tokens_to_ids(processor.video_token)).sum())
    return "own" if sum(feature.shape[:-1].numel() for feature in features) == placeholders else None


def dummy_video_inputs(model, processor) -> dict:
    """A one-frame probe clip as `pixel_values_videos`, for a model whose clips take a video path of
    their own (see `video_path`): the collator gives it to every micro-batch without a clip, so that
    path runs on every rank. {} for any other model: one whose video features are image features, or
    that has none, is never "own", so the probe runs (a second time at start-up, after the
    labeller's) only for a model that may be."""
    if video_as_image_names(model) or getattr(model, "get_video_features", None) is None:
        return {}
    if video_path(model, processor) != "own":
        return {}
    made = processor.video_processor(**_probe_clip(1), return_tensors="pt")
    return {"pixel_values_videos": made["pixel_values_videos"]} if "pixel_values_videos" in made else {}


def _probe_clip(frames: int) -> dict:
    """Processor kwargs of a `frames`-frame 56 px clip, its frames already sampled (random: some
    towers drop an all-zero input as padding)."""
    clip = numpy.random.default_rng(0).integers(0, 256, (frames, 56, 56, 3), dtype=numpy.uint8)
    metadata = VideoMetadata(total_num_frames=frames, fps=2.0, duration=frames / 2.0,
                             frames_indices=list(range(frames)))
    return dict(videos=[clip], video_metadata=[metadata], do_sample_frames=False)


def audio_inputs(model, processor=None) -> tuple[str, ...]:
    """The inputs of the model's audio step, from `get_audio_features`' signature (`audio_rows.audio_step`; Gemma 4:
    input_features and input_features_mask; the Qwen2.5-Omni thinker: input_features, feature_attention_mask,
    audio_feature_lengths; Qwen2-Audio: input_features, feature_attention_mask; the features first), where the model
    hears (`audio.hears`). () otherwise: audio rows are skipped and counted."""
    if not hears(model, processor):
        return ()
    step = audio_step(model.base_model)
    return tuple(name for name in inspect.signature(step).parameters if name not in ("self", "kwargs"))


def dummy_audio_inputs(model, processor) -> dict:
    """A tenth of a second of noise (some towers drop silence as padding) through the processor, as
    `get_audio_features`' inputs: the collator gives it to every micro-batch without a clip, so the audio tower runs
    on every rank. {} for a model that does not hear (`audio_inputs`)."""
    names = audio_inputs(model, processor)
    if not names:
        return {}
    rate = processor.feature_extractor.sampling_rate
    noise = numpy.random.default_rng(0).uniform(-0.5, 0.5, rate // 10).astype(numpy.float32)
    made = processor(text=processor.audio_token, audio=[noise], audio_kwargs=audio_kwargs(processor),
                     return_tensors="pt")
    return {name: made[name] for name in (*names, WINDOWS) if name in made}


def split_items(features, count: int) -> tuple:
    """A `get_image_features` output for several items (per-item tuples: Qwen's pooler_output, each
    of Qwen3-VL's deepstack layers) split into two outputs: its first `count` items, and the
    rest."""
    def split(value, part):
        if isinstance(value, list):
            return [split(item, part) for item in value]
        return value[:count] if part == 0 else value[count:]

    per_item = {name: value for name, value in features.items() if isinstance(value, (tuple, list))}
    return tuple(type(features)(**{name: split(value, part) for name, value in per_item.items()}) for part in (0, 1))


def height_width(size) -> tuple[int, int]:
    """A config's image or patch size as (height, width): an int, or a list/tuple (InternVL writes
    [448, 448])."""
    if isinstance(size, (list, tuple)):
        return (int(size[0]), int(size[-1]))
    return (int(size), int(size))


def placeholder_token_ids(model, processor) -> list[int]:
    """The image, video and audio placeholder tokens, which decoding never emits (a sampled or greedy
    one, appended, makes the next forward find one more placeholder than images: "Image features and
    image tokens do not match"; or than a clip's encoder rows: `AudioRows` refuses the batch). The
    model's config names the ones its forward counts (Gemma 3's processor calls `<start_of_image>`
    its image token; the placeholder is `<image_soft_token>`); the processor's are added (InternVL's
    config names no video token). The tokens that open a span, where the config names them, too: a
    sequence that ends in one fails the Qwen families' 3-D positions (they read the token after it)."""
    config = model.config
    ids = {getattr(config, f"{kind}_token_{suffix}", None) for kind in ("image", "video", "audio")
           for suffix in ("id", "index")}
    ids |= {getattr(config, f"{kind}_start_token_id", None) for kind in ("vision", "audio")}
    ids |= {processor.tokenizer.convert_tokens_to_ids(getattr(processor, f"{kind}_token"))
            for kind in ("image", "video", "audio") if getattr(processor, f"{kind}_token", None) is not None}
    return sorted(token for token in ids if isinstance(token, int) and token >= 0)


# transformers' layer_types
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


def stateful_mixer_classes(model) -> dict[str, set[type]]:
    """{layer type: the classes its layers hold that the attention layers do not} for each layer
    type of the language model's config that is not attention (Qwen3.5's linear_attention: a Gated
    DeltaNet, a recurrence with a causal convolution)."""
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    layers = next((child for child in model.get_decoder().children()
                   if isinstance(child, torch.nn.ModuleList) and len(child) == len(types)), None)
    if layers is None:
        return {}

    def classes(kind):
        return {type(child) for layer, layer_type in zip(layers, types) if layer_type == kind
                for child in layer.children()}

    attention = set().union(*(classes(kind) for kind in ATTENTION_LAYERS))
    return {kind: classes(kind) - attention for kind in dict.fromkeys(types) if kind not in ATTENTION_LAYERS}


def stateful_mixers(model) -> list[str]:
    """"<layer type> layers (<class>)" for each of `stateful_mixer_classes`."""
    return [f"{kind} layers ({', '.join(sorted(cls.__name__ for cls in classes))})"
            for kind, classes in stateful_mixer_classes(model).items()]

