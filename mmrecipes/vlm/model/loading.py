"""Loading a saved image-text-to-text checkpoint (a student's, a teacher's), checked first from its
config alone (`check_trainable`), each refusal naming the flag and the fix: an empty name, a folder
that is missing or not a saved model (a training checkpoint-N), a model that is not
image-text-to-text, a family the step cannot run, weights in an unsafe pickle; and the tokens that
end its turns. A full omni checkpoint (Qwen2.5-Omni: a thinker that reads and writes text, a talker
that speaks) trains its thinker, which saves as an image-text-to-text model of its own."""

import inspect
import logging

from transformers import AutoProcessor
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from ...audio import hears
from ...audio_windows import windowed_audio
from ...saved_models import model_config, only_hears, pretrained, trained_class

logger = logging.getLogger(__name__)


def trained_config(config):
    """The config the recipes train: `config`, or a full omni checkpoint's thinker's
    (`thinker_config`, where that is an image-text-to-text model)."""
    thinker = getattr(config, "thinker_config", None)
    trains = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    return thinker if type(config) not in trains and type(thinker) in trains else config


def check_trainable(name_or_path: str, flag: str = "--model_name_or_path"):
    """Raise, naming `flag`, the model type and why, if the recipes cannot train this checkpoint;
    reads its config only, and returns it."""
    saved = model_config(name_or_path, flag)
    config = trained_config(saved)
    model_type = config.model_type
    model_class = trained_class(config)
    if model_class is None:
        raise ValueError(f"{flag} {name_or_path}: model type {model_type!r} is not an image-text-to-text model "
                         "(AutoModelForImageTextToText has no class for it) nor an audio-text one "
                         "(AutoModelForMultimodalLM's, with an audio tower and no vision one); give a VLM checkpoint")
    reason = None
    if getattr(config, "is_encoder_decoder", False):
        reason = "it is an encoder-decoder model; the recipe trains decoder-only language models"
    elif only_hears(config):
        pass  # its audio step is checked on the loaded model (`load_pretrained`)
    elif not hasattr(model_class, "get_image_features"):
        reason = f"{model_class.__name__} has no get_image_features, so a text-only batch cannot run the vision step"
    elif "mm_encoder_outputs" not in inspect.signature(model_class.forward).parameters:
        reason = f"{model_class.__name__}.forward takes no precomputed image features (mm_encoder_outputs)"
    if reason:
        raise ValueError(f"{flag} {name_or_path}: model type {model_type!r} cannot be trained by this recipe: {reason}")
    return saved


def load_pretrained(name_or_path: str, flag: str = "--model_name_or_path"):
    """(model, processor) of a saved image-text-to-text checkpoint, checked first
    (`check_trainable`). Weights in a pickle that holds more than tensors are refused by torch's
    weights-only loading (nothing in it runs); the error names the file and the fix. A processor
    whose call takes no audio (Voxtral's) is given one (`audio_windows.WindowedAudio`)."""
    config = check_trainable(name_or_path, flag)
    model = pretrained(trained_class(trained_config(config)), name_or_path, flag)
    processor = windowed_audio(model, AutoProcessor.from_pretrained(name_or_path))
    if only_hears(model.config) and not hears(model, processor):
        raise ValueError(f"{flag} {name_or_path}: model type {model.config.model_type!r} has an audio tower but no "
                         "audio step the recipe can run (no get_audio_features, nor an audio_tower and a "
                         "multi_modal_projector its forward runs inline), or its processor no feature extractor and "
                         "audio token: it can be trained on neither images nor audio here")
    return model, processor


def thinker_note(name_or_path: str | None, model) -> str | None:
    """The start-up line of a full omni checkpoint (`trained_config`): its thinker trains, and
    saves on its own."""
    if not name_or_path:
        return None
    config = model_config(name_or_path, "")
    if config.model_type == model.config.model_type:
        return None
    return (f"{name_or_path} is a full {config.model_type} checkpoint: training its thinker "
            f"({type(model).__name__}), saved as a model of its own that loads with "
            "AutoModelForImageTextToText; the talker is neither trained nor saved")


def stop_token_ids(model, processor) -> list[int]:
    """The tokens that end an assistant turn: the generation config's eos ids and the tokenizer's
    eos."""
    eos = model.generation_config.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return [i for i in {*ids, processor.tokenizer.eos_token_id} if i is not None]


def set_attention(model, implementation: str, flag: str = "--attn_implementation"):
    """`implementation` for every part of the model; asked for sdpa, a part without that kernel
    (Gemma 2's LM in PaliGemma 2, Gemma 4's audio tower) keeps eager, said in the log."""
    try:
        model.set_attn_implementation(implementation)
    except ValueError as error:
        if implementation != "sdpa":
            raise ValueError(f"{flag} {implementation}: {error}") from error
        without = _sdpa_where_supported(model)
        verbs = ("s", "s") if len(without) == 1 else ("ve", "")
        logger.warning("%s: %s ha%s no sdpa attention and keep%s eager (%s eager: every part)",
                       type(model).__name__, ", ".join(without), *verbs, flag)


def _sdpa_where_supported(model) -> list[str]:
    """sdpa for each part of the model (its sub-configs) that has it; the parts that have none
    keep eager, as transformers loaded them: their names."""
    without = []
    for part in model.config.sub_configs or ["model"]:
        try:
            model.set_attn_implementation({part: "sdpa"} if part != "model" else "sdpa")
        except ValueError:
            without.append(part)
            model.set_attn_implementation({part: "eager"} if part != "model" else "eager")
    return without
