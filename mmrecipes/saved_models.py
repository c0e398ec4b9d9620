"""A saved model's folder, checked before anything loads: `model_config` (its config alone: an empty
name, a missing folder, a training checkpoint-N, a folder without config.json, each refused naming
the flag and the fix) and `pretrained` (its weights: a pickle that holds more than tensors is
refused with the fix). The VLM recipes, their teachers and `python -m mmrecipes.benchmarks` load
through them."""

import pickle
from pathlib import Path

from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, MODEL_FOR_MULTIMODAL_LM_MAPPING
from transformers.utils import CONFIG_NAME

from .checkpointing import MARKER


def model_config(name_or_path: str, flag: str = "--model_name_or_path", *, training_checkpoint: bool = False):
    """The config of a saved model (a folder here, or a hub id), read alone; a ValueError naming
    `flag` and the fix where it is none: empty, a missing folder, a file, a training checkpoint
    (checkpoint-N, or a link to one: read where `training_checkpoint`, a clip_pretrain.py checkpoint
    as a tower), a folder without config.json, a name neither here nor fetchable."""
    name_or_path = str(name_or_path)
    path = Path(name_or_path)
    if not name_or_path.strip():
        raise ValueError(f"{flag} is empty: give a saved model's folder or a hub id")
    if (path / MARKER).is_file() and not training_checkpoint:
        raise ValueError(f"{flag} {name_or_path} is a training checkpoint (the engine's state that "
                         "--resume_from_checkpoint reads), not a saved model: give the run's output_dir, where its "
                         "model is saved when it ends, or resume the run from the checkpoint")
    if path.is_file():
        raise ValueError(f"{flag} {name_or_path} is a file: give the folder that holds the model's {CONFIG_NAME}")
    if path.is_dir() and not (path / CONFIG_NAME).is_file():
        raise ValueError(f"{flag} {name_or_path} is a folder without {CONFIG_NAME}: not a saved model "
                         "(save_pretrained writes one)")
    if not path.exists() and (path.is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1):
        raise ValueError(f"{flag} {name_or_path}: no such folder")
    try:
        return AutoConfig.from_pretrained(name_or_path)
    # not a folder here, and not on the hub (or no network); no model_type
    except (OSError, ValueError) as error:
        raise ValueError(f"{flag} {name_or_path}: neither a model folder here nor a model transformers can fetch "
                         f"({str(error).splitlines()[0]})") from error


def pretrained(auto_class, name_or_path: str, flag: str):
    """`auto_class.from_pretrained(name_or_path)`; weights in a pickle that holds more than tensors
    are refused by torch's weights-only loading (nothing in it runs), and the error names the file
    and the fix."""
    try:
        return auto_class.from_pretrained(name_or_path)
    except pickle.UnpicklingError as error:
        files = ", ".join(sorted(file.name for file in Path(name_or_path).glob("*.bin"))) or "its weights"
        raise ValueError(f"{flag} {name_or_path}: {files} is a pickle holding more than tensors, which torch's "
                         "weights-only loading refuses (nothing in it ran): save the model as safetensors "
                         "(save_pretrained writes model.safetensors) and give that folder") from error


def only_hears(config) -> bool:
    """A model with an audio tower and no vision one (Qwen2-Audio, Voxtral, Granite Speech)."""
    return getattr(config, "audio_config", None) is not None and getattr(config, "vision_config", None) is None


def trained_class(config):
    """The class the recipes train for `config`: its AutoModelForImageTextToText class, or AutoModelForMultimodalLM's
    for a model that only hears; None for any other."""
    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    if only_hears(config) and type(config) in MODEL_FOR_MULTIMODAL_LM_MAPPING:
        return MODEL_FOR_MULTIMODAL_LM_MAPPING[type(config)]
    return None
