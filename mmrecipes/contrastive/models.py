"""The two-tower models (CLIP, SigLIP): a tiny default built from a config (nothing downloaded),
or a saved directory, and what every engine needs of them."""

import math

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoTokenizer,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    Siglip2Config,
    Siglip2ImageProcessor,
    Siglip2Model,
    SiglipConfig,
    SiglipImageProcessor,
    SiglipModel,
)

from ..distributed import fsdp_block_classes
from ..images import takes_patch_grids
from ..paths import TINY_SIGLIP2_TOKENIZER, TINY_TOKENIZER
from .arguments import ModelArgs

MAX_LOGIT_SCALE = math.log(100)  # CLIP clamps the temperature at 100


class CLIPForContrastiveTraining(CLIPModel):
    """HF `CLIPModel` (same weights and keys) whose forward returns what a gathered loss needs.

    `forward` returns (image_embeds, text_embeds, logit_scale.exp()): the scale must be read
    inside the forward, where FSDP2 and ZeRO-3 have the parameter unsharded. Two changes make
    it acceptable to every engine (docs/engines.md): FSDP and DeepSpeed reject 0-dim parameters,
    so `build_clip` reshapes `logit_scale` to [1] once the weights are loaded (`save_clip` writes
    it back as []), and accelerate's FSDP2 path calls `get_input_embeddings()`, which CLIPModel
    does not implement.
    """

    hf_architecture = "CLIPModel"
    loss = "clip"
    max_logit_scale = MAX_LOGIT_SCALE  # CLIP clamps the temperature at 100 after every step
    pads_text_to_max_length = False  # it pools the EOS position, so any padding works

    def forward(self, input_ids, attention_mask, pixel_values):
        image_embeds = self.get_image_features(pixel_values=pixel_values).pooler_output
        mask = text_attention_mask(self, attention_mask, causal=True)
        text_embeds = self.get_text_features(input_ids=input_ids, attention_mask=mask).pooler_output
        return F.normalize(image_embeds, dim=-1), F.normalize(text_embeds, dim=-1), self.logit_scale.exp()

    def get_input_embeddings(self):
        return self.text_model.embeddings.token_embedding


class SigmoidContrastive:
    """What SigLIP and SigLIP 2 add to their HF model (same weights and keys): a forward returning
    (image_embeds, text_embeds, logit_scale.exp(), logit_bias), what `siglip_loss` takes. Both
    scalars are [1]-shaped parameters already. The image inputs are the processor's: `pixel_values`,
    and for SigLIP 2 NaFlex each image's patches with `pixel_attention_mask` and `spatial_shapes`
    (its patch grid).

    SigLIP pools the text tower's *last position*, padding or not (docs/clip.md, SigLIP): the padded
    length is part of the model, so captions are padded to the tokenizer's `model_max_length`
    (64 for SigLIP, which the zero-shot pipeline hard-codes), in training as in inference.
    """

    loss = "siglip"
    max_logit_scale = None  # SigLIP learns its temperature unclamped
    pads_text_to_max_length = True

    def forward(self, input_ids, attention_mask, **image_inputs):
        image_embeds = self.get_image_features(**image_inputs).pooler_output
        mask = text_attention_mask(self, attention_mask, causal=False)
        text_embeds = self.get_text_features(input_ids=input_ids, attention_mask=mask).pooler_output
        return (F.normalize(image_embeds, dim=-1), F.normalize(text_embeds, dim=-1), self.logit_scale.exp(),
                self.logit_bias)


class SiglipForContrastiveTraining(SigmoidContrastive, SiglipModel):
    hf_architecture = "SiglipModel"


class Siglip2ForContrastiveTraining(SigmoidContrastive, Siglip2Model):
    hf_architecture = "Siglip2Model"


def text_attention_mask(model, attention_mask, causal: bool):
    """The text tower's attention mask as SDPA takes it, `[batch, 1, query or 1, key]` booleans,
    made on the device. From a 2D padding mask, transformers' `create_causal_mask` /
    `create_bidirectional_mask` first read `mask.all()` on the host (to drop the mask when nothing
    is padded): a device sync in every step on a GPU. A 4D mask is used as given. Other attention
    implementations keep the 2D one.
    """
    if model.config.text_config._attn_implementation != "sdpa":
        return attention_mask
    mask = attention_mask.bool()[:, None, None, :]
    if causal:
        length = attention_mask.shape[-1]
        mask = mask & torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    return mask


# By the saved config's model_type; each class names the loss it trains with.
TRAINING_CLASSES = {"clip": CLIPForContrastiveTraining, "siglip": SiglipForContrastiveTraining,
                    "siglip2": Siglip2ForContrastiveTraining}


def build_contrastive(args: ModelArgs):
    """(model, tokenizer, image_processor) for `args.loss`: loaded from `model_name_or_path`, or
    the tiny default.

    Build it *before* `Accelerator()`: under ZeRO-3 accelerate registers the DeepSpeed config
    with transformers, and a model constructed afterwards is partitioned at construction with a
    different random init (a different first loss than DDP's and ZeRO-2's).
    """
    if args.model_name_or_path:
        model_type = AutoConfig.from_pretrained(args.model_name_or_path).model_type
        model_class = TRAINING_CLASSES.get(model_type)
        if model_class is None or model_class.loss != args.loss:
            trains = f"set --loss {model_class.loss}" if model_class else f"it trains {', '.join(TRAINING_CLASSES)}"
            raise ValueError(f"{args.model_name_or_path} is a {model_type!r} model, not {args.loss}: {trains}")
        model = model_class.from_pretrained(args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        image_processor = AutoImageProcessor.from_pretrained(args.model_name_or_path)
    elif args.loss == "clip":
        model, tokenizer, image_processor = _tiny_clip(args)
    else:
        model, tokenizer, image_processor = _tiny_siglip(args)
    if args.max_num_patches:
        if not takes_patch_grids(image_processor):
            raise ValueError(f"--max_num_patches sizes SigLIP 2 NaFlex images; this {model.config.model_type} model "
                             "takes fixed-size images: drop the flag")
        image_processor.max_num_patches = args.max_num_patches
    # After loading: CLIP's logit_scale is 0-dim, which FSDP and DeepSpeed reject (saved back as it was).
    model.saved_logit_scale_shape = model.logit_scale.shape
    model.logit_scale = torch.nn.Parameter(model.logit_scale.detach().reshape(1))
    model._no_split_modules = fsdp_block_classes(model)  # what fsdp2.yaml wraps
    model.set_attn_implementation(args.attn_implementation)
    if args.gradient_checkpointing:
        # Non-reentrant: works when a layer's inputs need no grad, and under DDP's no_sync and FSDP2.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer, image_processor


def _tower(args: ModelArgs) -> dict:
    return dict(hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                num_hidden_layers=args.num_layers, num_attention_heads=max(1, args.hidden_size // 32))


def _tiny_siglip(args: ModelArgs):
    """A tiny SiglipModel, or with `max_num_patches` a Siglip2Model (NaFlex): the same towers, its
    position embeddings an `image_size / patch_size` grid resized to each image's own grid of at
    most that many patches."""
    # The zero-shot pipeline pads SigLIP captions to 64 tokens: train at that length (docs/clip.md,
    # SigLIP).
    default = TINY_SIGLIP2_TOKENIZER if args.max_num_patches else TINY_TOKENIZER
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or default, model_max_length=64)
    text_config = dict(_tower(args), vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    vision_config = dict(_tower(args), patch_size=args.patch_size)
    if args.max_num_patches:
        grid = (args.image_size // args.patch_size) ** 2
        model = Siglip2ForContrastiveTraining(Siglip2Config(text_config=text_config,
                                                            vision_config=vision_config | {"num_patches": grid}))
        image_processor = Siglip2ImageProcessor(patch_size=args.patch_size, max_num_patches=args.max_num_patches)
    else:
        config = SiglipConfig(text_config=text_config, vision_config=vision_config | {"image_size": args.image_size})
        model = SiglipForContrastiveTraining(config)
        image_processor = SiglipImageProcessor(size={"height": args.image_size, "width": args.image_size})
    # Both initialise them to 0, which leaves a small model at chance: the paper's log(10) and -10.
    with torch.no_grad():
        model.logit_scale.fill_(math.log(10) if args.logit_scale_init_value is None else args.logit_scale_init_value)
        model.logit_bias.fill_(args.logit_bias_init_value)
    return model, tokenizer, image_processor


def _tiny_clip(args: ModelArgs):
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or TINY_TOKENIZER)
    tower = _tower(args)
    config = CLIPConfig(
        text_config=dict(
            tower, vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
            # CLIP pools the text tower at the first eos_token_id: without it every caption pools
            # one token.
            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(tower, image_size=args.image_size, patch_size=args.patch_size),
        projection_dim=args.projection_dim,
        logit_scale_init_value=2.6592 if args.logit_scale_init_value is None else args.logit_scale_init_value,
    )
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": args.image_size}, crop_size={"height": args.image_size, "width": args.image_size}
    )
    return CLIPForContrastiveTraining(config), tokenizer, image_processor


@torch.no_grad()
def clamp_logit_scale_(accelerator, model):
    """Clamp the logit scale at the model's `max_logit_scale` (CLIP: ln 100; SigLIP: none) after
    the optimizer step, on every copy the engine keeps.

    Clamping is elementwise, so each rank clamping the part it holds is exact. DDP: the
    parameter. FSDP2: this rank's DTensor shard. DeepSpeed keeps an fp32 master copy in the
    optimizer that the next step starts from: clamp it too (ZeRO-1/2: partitioned master, full
    model copy; ZeRO-3: both partitioned, plus a full copy of small parameters).
    Call it on every rank: under ZeRO-1/2 it runs collectives.
    """
    unwrapped = accelerator.unwrap_model(model)
    param, max_value = unwrapped.logit_scale, unwrapped.max_logit_scale
    if max_value is None:
        return
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        param.data.clamp_(max=max_value)
        return
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
        safe_set_local_fp32_param,
    )

    if hasattr(param, "ds_id"):  # ZeRO-3
        safe_set_local_fp32_param(param, safe_get_local_fp32_param(param).clamp(max=max_value))
        param.ds_tensor.data.clamp_(max=max_value)
    else:
        safe_set_full_fp32_param(param, safe_get_full_fp32_param(param).clamp(max=max_value))
    # The model's full copy: ZeRO-1/2 always, ZeRO-3 for small "persistent" parameters it keeps
    # gathered (empty, so a no-op, otherwise).
    param.data.clamp_(max=max_value)


def save_contrastive(accelerator, model, tokenizer, image_processor, output_dir):
    """`save_pretrained` a directory that `CLIPModel`/`SiglipModel.from_pretrained` and the
    zero-shot pipeline load (model + tokenizer + image processor).

    `get_state_dict` gathers full weights under FSDP2/ZeRO-3, so every rank must call this.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        state_dict["logit_scale"] = state_dict["logit_scale"].reshape(unwrapped.saved_logit_scale_shape)
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, save_function=accelerator.save)
        # a plain checkpoint: loads without mmrecipes
        unwrapped.config.architectures = [unwrapped.hf_architecture]
        unwrapped.config.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        image_processor.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
