"""Loading a saved image-text-to-text checkpoint (a student's, a teacher's), checked first from its config alone
(`check_trainable`), each refusal naming the flag and the fix: an empty name, a folder that is missing or not a saved
model (a training checkpoint-N), a model that is not image-text-to-text, a family the step cannot run, weights in an
unsafe pickle; and the tokens that end its turns."""

import inspect
import pickle
from pathlib import Path

from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
from transformers.utils import CONFIG_NAME

from ...checkpointing import MARKER


def model_config(name_or_path: str, flag: str = "--model_name_or_path", *, training_checkpoint: bool = False):
    """The config of a saved model (a folder here, or a hub id), read alone; a ValueError naming `flag` and the fix
    where it is none: empty, a missing folder, a file, a training checkpoint (checkpoint-N, or a link to one: read
    where `training_checkpoint`, a clip_pretrain.py checkpoint as a tower), a folder without config.json, a name
    neither here nor fetchable."""
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
    except (OSError, ValueError) as error:  # not a folder here, and not on the hub (or no network); no model_type
        raise ValueError(f"{flag} {name_or_path}: neither a model folder here nor a model transformers can fetch "
                         f"({str(error).splitlines()[0]})") from error


def check_trainable(name_or_path: str, flag: str = "--model_name_or_path"):
    """Raise, naming `flag`, the model type and why, if the recipes cannot train this checkpoint; reads its config
    only."""
    config = model_config(name_or_path, flag)
    model_type = config.model_type
    if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        raise ValueError(f"{flag} {name_or_path}: model type {model_type!r} is not an image-text-to-text model "
                         "(AutoModelForImageTextToText has no class for it); give a VLM checkpoint")
    model_class = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    reason = None
    if getattr(config, "is_encoder_decoder", False):
        reason = "it is an encoder-decoder model; the recipe trains decoder-only language models"
    elif not hasattr(model_class, "get_image_features"):
        reason = f"{model_class.__name__} has no get_image_features, so a text-only batch cannot run the vision step"
    elif "mm_encoder_outputs" not in inspect.signature(model_class.forward).parameters:
        reason = f"{model_class.__name__}.forward takes no precomputed image features (mm_encoder_outputs)"
    if reason:
        raise ValueError(f"{flag} {name_or_path}: model type {model_type!r} cannot be trained by this recipe: {reason}")


def load_pretrained(name_or_path: str, flag: str = "--model_name_or_path"):
    """(model, processor) of a saved image-text-to-text checkpoint, checked first (`check_trainable`). Weights in a
    pickle that holds more than tensors are refused by torch's weights-only loading (nothing in it runs); the error
    names the file and the fix."""
    check_trainable(name_or_path, flag)
    try:
        model = AutoModelForImageTextToText.from_pretrained(name_or_path)
    except pickle.UnpicklingError as error:
        files = ", ".join(sorted(file.name for file in Path(name_or_path).glob("*.bin"))) or "its weights"
        raise ValueError(f"{flag} {name_or_path}: {files} is a pickle holding more than tensors, which torch's "
                         "weights-only loading refuses (nothing in it ran): save the model as safetensors "
                         "(save_pretrained writes model.safetensors) and give that folder") from error
    return model, AutoProcessor.from_pretrained(name_or_path)


def stop_token_ids(model, processor) -> list[int]:
    """The tokens that end an assistant turn: the generation config's eos ids and the tokenizer's eos."""
    eos = model.generation_config.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return [i for i in {*ids, processor.tokenizer.eos_token_id} if i is not None]
