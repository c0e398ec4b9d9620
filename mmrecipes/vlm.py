"""Vision-language models that run the same graph on every rank, whatever each rank's batch holds.

When one data-parallel rank gets a text-only micro-batch and another an image-text one, the
vision tower and projector run on some ranks only: DDP waits for gradients that never come,
FSDP and ZeRO-3 issue mismatched all-gathers (FIELD_NOTES §1, §4). `VLMForTraining` wraps any
`AutoModelForImageTextToText` model (Llava, Qwen2-VL, ...) so that every micro-batch calls the
vision step exactly once, in the same module order on every rank:

1. image features: `model.get_image_features(...)` on the batch's images, or on the one tiny
   dummy image `DummyImageCollator` puts into a text-only batch (`dummy_image_inputs`);
2. the model's own forward, given real features as `mm_encoder_outputs`, or no images at all;
3. the summed token cross-entropy, plus, for a dummy, a zero-length slice of its features
   (`features[:0].sum()`): the vision parameters get an exact-zero gradient and the loss and LM
   gradients stay bitwise unchanged. Slicing, not `0 * features`, because `0 * inf = nan`.

The wrapper reads no parameter itself: under ZeRO-3, reading a sub-module's parameter (its dtype,
say) in a parent's forward gathers it on that rank only and breaks the next collective
(CPU_ENGINES.md §3); each tower casts its inputs inside its own forward.

A dummy's zero gradient still lets AdamW apply weight decay and momentum to those parameters on
that step; train the tower with `weight_decay=0` (the recipe's default for it) if that matters.
"""

import inspect
from dataclasses import dataclass

import torch
from transformers import (AutoProcessor, AutoTokenizer, CLIPImageProcessor, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor)

from .distributed import fsdp_block_classes
from .losses import token_cross_entropy_sum
from .models import EMBEDDED

TINY_VLM_TOKENIZER = EMBEDDED / "vlm_tokenizer"
TRAIN_MODULE_CHOICES = ("projector", "projector,language_model", "all")


@dataclass
class VLMModelArgs:
    model_name_or_path: str | None = None  # a saved Llava directory or hub id; None builds the tiny Llava below
    tokenizer_name: str = str(TINY_VLM_TOKENIZER)  # used only with model_name_or_path=None
    # What trains: projector (LLaVA stage 1), projector,language_model (stage 2), all (tower too, at its own lr)
    train_modules: str = "projector,language_model"
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"  # as for CLIP (mmrecipes.models.ModelArgs)
    image_size: int = 32
    patch_size: int = 8
    vision_hidden_size: int = 64
    vision_layers: int = 2
    text_hidden_size: int = 128
    text_layers: int = 2


class VLMForTraining(torch.nn.Module):
    """One training/eval step of an image-text-to-text model that is the same graph on every rank.

    `forward(batch)` takes a `DummyImageCollator` batch and returns (summed token CE, logits). Wrap
    the model *before* `accelerator.prepare`: the dummy's features must enter the loss inside the
    module the engine wraps, or DDP sees the vision parameters' (zero) gradients too late.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.vision_input_names = set(inspect.signature(model.get_image_features).parameters) - {"kwargs"}

    def forward(self, input_ids, attention_mask, labels, dummy_image: bool, **image_inputs):
        vision_inputs = {name: value for name, value in image_inputs.items() if name in self.vision_input_names}
        features = self.model.get_image_features(**vision_inputs, return_dict=True)
        if dummy_image:
            # Text-only batch: the tower ran on the dummy; the LM sees no image and no image token.
            text_inputs = {name: value for name, value in image_inputs.items() if name not in self.vision_input_names}
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **text_inputs).logits
        else:
            other_inputs = {name: value for name, value in image_inputs.items() if name != "pixel_values"}
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, mm_encoder_outputs={"image": features},
                                **other_inputs).logits
        loss_sum = token_cross_entropy_sum(logits, labels)
        if dummy_image:
            loss_sum = loss_sum + torch.cat([part.flatten() for part in features.pooler_output])[:0].sum()
        return loss_sum, logits

    def get_input_embeddings(self):  # accelerate's FSDP2 path asks the root module for it
        return self.model.get_input_embeddings()

    @property
    def _no_split_modules(self):  # what accelerate_configs/fsdp2.yaml wraps
        return fsdp_block_classes(self.model)


def dummy_image_inputs(model) -> dict:
    """The smallest image input the model's vision step accepts, as `get_image_features` kwargs.

    Chosen from `get_image_features`' signature and the vision config (FIELD_NOTES §10), not from
    the model's name: a patch grid (`image_grid_thw`: Qwen2-VL style) gets one merged token of
    spatial_merge_size^2 patches; a tower with a `pixel_attention_mask` (Idefics3 style) one tile
    of scale_factor x patch_size pixels; a fixed-size tower (CLIP, SigLIP: Llava style) one image
    of its image_size. Filled with ones: some towers drop an all-zero image as padding.
    """
    names = inspect.signature(model.get_image_features).parameters
    vision = model.config.vision_config
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    if "image_grid_thw" in names:
        merge = vision.spatial_merge_size
        patch_dim = channels * vision.temporal_patch_size * vision.patch_size ** 2
        return {"pixel_values": torch.ones(merge * merge, patch_dim),
                "image_grid_thw": torch.tensor([[1, merge, merge]])}
    if "pixel_attention_mask" in names:
        side = model.config.scale_factor * vision.patch_size
        return {"pixel_values": torch.ones(1, 1, channels, side, side),
                "pixel_attention_mask": torch.ones(1, 1, side, side, dtype=torch.bool)}
    return {"pixel_values": torch.ones(1, channels, vision.image_size, vision.image_size)}


def build_llava(args: VLMModelArgs):
    """(model, processor): loaded from `model_name_or_path`, or a tiny Llava built from a config.

    Build it *before* `Accelerator()` (under ZeRO-3 a model built afterwards is partitioned and
    re-initialised, as for CLIP).
    """
    if args.model_name_or_path:
        model = LlavaForConditionalGeneration.from_pretrained(args.model_name_or_path)
        processor = AutoProcessor.from_pretrained(args.model_name_or_path)
    else:
        model, processor = _tiny_llava(args)
    model.set_attn_implementation(args.attn_implementation)
    return model, processor


def _tiny_llava(args: VLMModelArgs):
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    image_token_id = tokenizer.convert_tokens_to_ids(tokenizer.image_token)
    vision = dict(model_type="clip_vision_model", hidden_size=args.vision_hidden_size,
                  intermediate_size=4 * args.vision_hidden_size, num_hidden_layers=args.vision_layers,
                  num_attention_heads=max(1, args.vision_hidden_size // 32), image_size=args.image_size,
                  patch_size=args.patch_size)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=args.text_hidden_size,
                intermediate_size=4 * args.text_hidden_size, num_hidden_layers=args.text_layers,
                num_attention_heads=max(1, args.text_hidden_size // 32), max_position_embeddings=tokenizer.model_max_length,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_token_id,
        # The last layer (not LLaVA's -2): a -2 layer here would leave the tower's last layer unused.
        vision_feature_layer=-1, vision_feature_select_strategy="default",
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    image_processor = CLIPImageProcessor(size={"shortest_edge": args.image_size},
                                         crop_size={"height": args.image_size, "width": args.image_size})
    # What AutoProcessor and the image-text-to-text pipeline need of the saved directory (FIELD_NOTES §7).
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=args.patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               image_token=tokenizer.image_token, chat_template=tokenizer.chat_template)
    return model, processor


def llava_module_groups(model) -> dict[str, list[torch.nn.Parameter]]:
    """Llava's parameters by part: vision_tower, projector, language_model (LM + head)."""
    groups = {"vision_tower": list(model.model.vision_tower.parameters()),
              "projector": list(model.model.multi_modal_projector.parameters())}
    seen = {id(p) for group in groups.values() for p in group}
    groups["language_model"] = [p for p in model.parameters() if id(p) not in seen]
    return groups


def apply_train_modules(model, train_modules: str) -> dict[str, list[torch.nn.Parameter]]:
    """Freeze what `train_modules` does not name; returns the trainable parameters by group.

    Frozen parameters get `requires_grad=False` before `accelerator.prepare`, so DDP needs no
    `find_unused_parameters`, FSDP2 and ZeRO-3 skip their gradients, and the optimizer (built
    from the returned groups) holds no state for them.
    """
    if train_modules not in TRAIN_MODULE_CHOICES:
        raise ValueError(f"--train_modules {train_modules!r}: choose one of {', '.join(TRAIN_MODULE_CHOICES)}")
    names = {"projector"} | ({"language_model"} if "language_model" in train_modules else set())
    if train_modules == "all":
        names = {"projector", "language_model", "vision_tower"}
    groups = llava_module_groups(model)
    for name, params in groups.items():
        for param in params:
            param.requires_grad_(name in names)
    return {name: params for name, params in groups.items() if name in names}


def freeze_unreached_parameters(model, dummy_inputs: dict) -> list[str]:
    """Freeze trainable parameters that the vision step never reaches; returns their names.

    CLIP's `post_layernorm` feeds only the pooled output, which Llava discards, and at LLaVA's
    `vision_feature_layer=-2` the tower's last layer is computed but unused (FIELD_NOTES §7): no
    batch ever gives them a gradient, so DDP fails without `find_unused_parameters`. One backward
    of the dummy image through `get_image_features` (before `prepare`) finds them, for any family.
    """
    features = model.get_image_features(**dummy_inputs, return_dict=True).pooler_output
    torch.cat([part.flatten() for part in features]).sum().backward()
    language_model = [*model.get_decoder().parameters(), *model.get_output_embeddings().parameters()]
    outside_vision_step = {id(param) for param in language_model}
    unreached = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.grad is None and id(param) not in outside_vision_step:
            param.requires_grad_(False)
            unreached.append(name)
    model.zero_grad(set_to_none=True)
    return unreached


def save_vlm(accelerator, model, processor, output_dir):
    """`save_pretrained` the wrapped model and its processor: a directory that
    `AutoProcessor`, `AutoModelForImageTextToText` and `pipeline("image-text-to-text")` load.

    `get_state_dict` gathers full weights under FSDP2/ZeRO-3, so every rank must call this.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        inner = accelerator.unwrap_model(model).model
        state_dict = {name.removeprefix("model."): tensor for name, tensor in state_dict.items()}
        inner.save_pretrained(output_dir, state_dict=state_dict, save_function=accelerator.save)
        processor.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
