"""Where the embedded data and tiny tokenizers are: data/ of this checkout, or mmrecipes/embedded/
inside a wheel (pyproject.toml packs one as the other), so a recipe copied out of the repository
finds them too."""

from pathlib import Path

_PACKAGED = Path(__file__).resolve().parent / "embedded"
EMBEDDED = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[1] / "data"
TINY_TOKENIZER = EMBEDDED / "tokenizer"  # byte-level BPE for captions (data_prep/make_tokenizer.py)
# a Siglip2Tokenizer for captions (the same script)
TINY_SIGLIP2_TOKENIZER = EMBEDDED / "siglip2_tokenizer"
TINY_VLM_TOKENIZER = EMBEDDED / "vlm_tokenizer"  # chat tokenizer with <image> and a chat template
SHAPES_DATA = EMBEDDED / "shapes"  # image-caption pairs (data_prep/make_shapes.py)
# the zero-shot image folder (data_prep/make_zeroshot.py)
SHAPES_ZEROSHOT = EMBEDDED / "shapes_zeroshot"
# pairs of its questions (data_prep/make_vlm_preferences.py)
VLM_PREFERENCES = EMBEDDED / "vlm_preferences"
# chat data: image_chat, text_chat (data_prep/make_vlm_data.py)
VLM_SHAPES = EMBEDDED / "vlm_shapes"
TINY_LM = EMBEDDED / "tiny_lm"  # a tiny base causal LM to compose a VLM with (data_prep/tiny_lm.py)
# LLaVA's stage-1 format (mmrecipes.vlm.model.compose)
PLAIN_CHAT_TEMPLATE = EMBEDDED / "chat_templates" / "plain.jinja"

# `embedded:vlm_shapes/image_chat`: a folder of the embedded data, from any directory
EMBEDDED_PREFIX = "embedded:"


def resolve_name(name: str) -> str:
    """A dataset name as `datasets` takes it: `embedded:<folder>` is that folder of the embedded
    data (in this checkout or the wheel), so a config names it from any working directory; any other
    name as it is."""
    return str(EMBEDDED / name.removeprefix(EMBEDDED_PREFIX)) if name.startswith(EMBEDDED_PREFIX) else name


def is_embedded(name: str) -> bool:
    """Whether a dataset name is the embedded data (by its `embedded:` name or its path)."""
    path = Path(resolve_name(name.strip()))
    return path.exists() and path.resolve().is_relative_to(EMBEDDED.resolve())
