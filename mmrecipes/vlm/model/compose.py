"""A LLaVA built from parts: a vision tower (CLIP or SigLIP, or a `clip_pretrain.py` checkpoint),
any causal language model and a fresh projector: a standard `LlavaForConditionalGeneration` with its
`LlavaProcessor`, so every later stage is a `vlm_finetune.py` / `vlm_dpo.py` run and every output
loads with the Auto classes.

Decided from the checkpoints' configs and modules, never a name table (docs/vlm.md, "Build your own
VLM"): the image token count (a class token dropped, or every patch kept), the feature layer, the
added `<image>` and pad tokens (new rows at the mean of the old), the chat template (the LM's own
behind a prelude that flattens each message's content), the tower's own image processor; the parts
are taken as loaded, never copied. Both parts are checked first, each refusal with its own reason.
"""

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)
from transformers.utils import CONFIG_NAME

from ...checkpointing import MARKER, checkpoint_weights
from ...paths import PLAIN_CHAT_TEMPLATE
from ...saved_models import model_config
from ..arguments import read_chat_template

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
IMAGE_TOKEN = "<image>"
PAD_TOKEN = "<pad>"
# Renders a message whose content is a list of parts as one string, each image as `<image>` and a new line before
# its text (LLaVA's convention), for a language model's template that reads `message.content` as a string.
FLATTEN_CONTENT = (
    "{%- set flattened = namespace(messages=[]) -%}"
    "{%- for message in messages -%}"
    "{%- if message.content is string -%}{%- set flattened.messages = flattened.messages + [message] -%}"
    "{%- else -%}{%- set text = namespace(value='') -%}"
    "{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}{%- set text.value = text.value + '" + IMAGE_TOKEN + "\\n' -%}"
    "{%- elif part.type == 'text' -%}{%- set text.value = text.value + part.text -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set flattened.messages = flattened.messages + [{'role': message.role, 'content': text.value}] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set messages = flattened.messages -%}\n"
)


def compose_llava(vision_name_or_path: str, language_name_or_path: str, *, vision_feature_layer: int = -2,
                  chat_template: str | None = None, chat_template_path: str | None = None):
    """(LlavaForConditionalGeneration, LlavaProcessor) of the vision half of `vision_name_or_path`
    (a CLIPModel, SiglipModel or vision-only checkpoint: the tower and its image processor) and the
    causal LM at `language_name_or_path` (with its tokenizer), joined by LLaVA's two-layer GELU
    projector, freshly initialised. `chat_template`: "plain" (stage 1 trains in LLaVA's format) or
    None; `chat_template_path`: a .jinja file that replaces the language model's template (a base
    LM's instruct sibling's, TRL's training patch of Qwen3's); the processor gets
    `chat_template_for`'s."""
    vision_config = _vision_config(vision_name_or_path, vision_feature_layer)
    _check_language_model(language_name_or_path)  # both parts checked before any weight is read
    tower = _tower(vision_name_or_path)
    language_model = AutoModelForCausalLM.from_pretrained(language_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(language_name_or_path)
    if chat_template_path:
        tokenizer.chat_template = read_chat_template(chat_template_path)
    template = chat_template_for(tokenizer, chat_template, chat_template_path or language_name_or_path)
    _add_tokens(language_model, tokenizer)
    # CLIP's CLS position; SigLIP has none
    class_token = hasattr(tower.embeddings, "class_embedding")
    strategy = "default" if class_token else "full"
    grid = (vision_config.image_size // vision_config.patch_size) ** 2
    text_config = language_model.config
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), image_seq_length=grid,
        vision_feature_layer=vision_feature_layer, vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu", tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
        pad_token_id=tokenizer.pad_token_id, eos_token_id=text_config.eos_token_id)
    # The parts' own modules go in as they are: built on the meta device, the Llava never holds a second (random)
    # copy of the language model or the tower; only the projector is made and initialised here.
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    model.model.vision_tower, model.model.language_model = tower, language_model.get_decoder()
    # a tied head is the embedding matrix itself
    model.lm_head = language_model.get_output_embeddings()
    projector = model.model.multi_modal_projector.to_empty(device=language_model.device)
    projector.apply(model._init_weights)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = language_model.generation_config.eos_token_id or tokenizer.eos_token_id
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(vision_name_or_path), tokenizer=tokenizer,
        patch_size=vision_config.patch_size, vision_feature_select_strategy=strategy,
        num_additional_image_tokens=int(class_token), image_token=IMAGE_TOKEN, chat_template=template)
    return model, processor


def _tower(name_or_path: str):
    """The vision half of a saved model, or of a `checkpoint-N` of a clip_pretrain.py run: its
    weights read from any engine's files (`checkpoint_weights`, validated first), its config beside
    them."""
    if not (Path(name_or_path) / MARKER).is_file():
        model = AutoModel.from_pretrained(name_or_path)
        return getattr(model, "vision_model", model)  # the vision half of a two-tower model
    model = AutoModel.from_config(AutoConfig.from_pretrained(name_or_path))
    weights = {name.removeprefix("vision_model."): tensor for name, tensor in checkpoint_weights(name_or_path).items()
               if name.startswith("vision_model.")}
    model.vision_model.load_state_dict(weights)
    return model.vision_model


def _vision_config(name_or_path: str, feature_layer: int):
    """The tower's config, once it proves to be one that Llava can take, and `feature_layer` one of
    its layers."""
    flag = "vision_model_name_or_path"
    if (Path(name_or_path) / MARKER).is_file() and not (Path(name_or_path) / CONFIG_NAME).is_file():
        raise ValueError(f"{name_or_path} is a checkpoint saved before checkpoints held their model's config: compose "
                         "from the run's saved model, or from a checkpoint of a newer run")
    config = model_config(name_or_path, f"--{flag}", training_checkpoint=True)
    if getattr(config, "image_token_id", None) is not None or getattr(config, "image_token_index", None) is not None:
        raise ValueError(f"--{flag} {name_or_path} is a built image-text-to-text model ({config.model_type}), not a "
                         "vision tower: fine-tune it with --model_name_or_path, or give its tower's own checkpoint")
    vision_config = getattr(config, "vision_config", config)
    if not hasattr(vision_config, "patch_size"):
        raise ValueError(f"--{flag} {name_or_path} is a {config.model_type} model with no vision config (no patch "
                         "size): give a CLIP or SigLIP checkpoint, or a vision tower's")
    if not hasattr(vision_config, "image_size"):  # SigLIP 2 NaFlex: a patch budget, no fixed size
        raise ValueError(f"{name_or_path} is a {config.model_type} tower whose images keep their aspect ratio as "
                         "patch grids of their own (NaFlex); Llava's processor and projector take one fixed grid: "
                         "use a fixed-resolution CLIP or SigLIP tower")
    layers = vision_config.num_hidden_layers
    if not 1 <= abs(feature_layer) <= layers:
        raise ValueError(f"--vision_feature_layer {feature_layer}: the tower at {name_or_path} has {layers} layers; "
                         f"give 1 to {layers}, or -1 (its last) to -{layers} (0 and -{layers + 1} are its patch "
                         "embeddings, before any layer)")
    return vision_config


def _check_language_model(name_or_path: str):
    """Refuse, before its weights are read, what is not a decoder-only causal LM with a
    tokenizer."""
    flag = "language_model_name_or_path"
    config = model_config(name_or_path, f"--{flag}")
    causal = [name for name in config.architectures or [] if name.endswith("ForCausalLM")]
    if config.is_encoder_decoder or not causal:
        raise ValueError(f"--{flag} {name_or_path} is a {', '.join(config.architectures or [config.model_type])}, "
                         "not a decoder-only causal language model (...ForCausalLM): Llava generates with one")
    if Path(name_or_path).is_dir() and not any((Path(name_or_path) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"--{flag} {name_or_path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
                         "language model's tokenizer beside it (tokenizer.save_pretrained)")


def _add_tokens(language_model, tokenizer):
    """`<image>` (and a pad token where there is none) added to the tokenizer; their embedding rows,
    input and output, start at the mean of the rows of the tokens it had (a tied output layer is the
    same matrix and stays so). A vocabulary padded past its tokenizer (Qwen's) is never shrunk: the
    new tokens take padding rows."""
    first_new = min(len(tokenizer), language_model.get_input_embeddings().num_embeddings)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    if len(tokenizer) > language_model.get_input_embeddings().num_embeddings:
        language_model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        for embedding in {id(m.weight): m.weight for m in (language_model.get_input_embeddings(),
                                                            language_model.get_output_embeddings())}.values():
            embedding[first_new:len(tokenizer)] = embedding[:first_new].mean(dim=0)
    language_model.config.pad_token_id = tokenizer.pad_token_id


def replaced_template(current, new: str) -> str:
    """`new` (--chat_template_path) as a built model's chat template: a composed model's keeps the
    prelude that hands its language model's template each message's content as one string
    (`FLATTEN_CONTENT`), as at composing."""
    composed = isinstance(current, str) and current.startswith(FLATTEN_CONTENT)
    return FLATTEN_CONTENT + new if composed and not new.startswith(FLATTEN_CONTENT) else new


def chat_template_for(tokenizer, chat_template: str | None, name: str) -> str:
    """The composed model's own chat template, the one it is saved with: the LM's behind
    `FLATTEN_CONTENT`. A base LM without one gets LLaVA's `plain` format where stage 1 trains in it
    (`chat_template` "plain"), and is refused otherwise, with the fix."""
    if isinstance(tokenizer.chat_template, str):
        return FLATTEN_CONTENT + tokenizer.chat_template
    if chat_template == "plain":
        return PLAIN_CHAT_TEMPLATE.read_text()
    raise ValueError(f"{name} has no chat template (a base model): stage 2 trains on conversations in one. Give its "
                     "instruct sibling's with --chat_template_path, or train stage 1 with --chat_template plain")
