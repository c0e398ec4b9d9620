"""The two-tower models (CLIP, SigLIP; CLAP, which hears): a tiny default built from a config
(nothing downloaded), or a saved directory, and what every engine needs of them."""

import math

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType
from transformers import (
    AutoConfig,
    AutoFeatureExtractor,
    AutoImageProcessor,
    AutoTokenizer,
    ClapConfig,
    ClapFeatureExtractor,
    ClapModel,
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
from .batch_norm import globalise_batch_norms

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
    scale_name = "logit_scale"  # the parameter the loss's scale is, clamped after every step
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
    scale_name = "logit_scale"
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


class ClapForContrastiveTraining(ClapModel):
    """HF `ClapModel` (same weights and keys) trained as LAION-CLAP trains it without its MLP loss:
    one temperature, `logit_scale_a`, in both directions. Its forward returns (audio_embeds,
    text_embeds, logit_scale_a.exp()), what `clip_loss` takes. `logit_scale_t` (ClapModel's
    text-to-audio scale) is frozen and saved equal to the trained one. The audio inputs are the
    feature extractor's `input_features` and `is_longer` (its fusion flag). The text tower pools its
    first token, so captions pad to the batch's longest. The audio tower's BatchNorm normalises with
    the statistics of every rank's rows (`batch_norm.GlobalBatchNorm2d`)."""

    hf_architecture = "ClapModel"
    loss = "clip"
    scale_name = "logit_scale_a"
    max_logit_scale = MAX_LOGIT_SCALE  # LAION-CLAP clamps it at ln 100 too
    pads_text_to_max_length = False
    _no_split_modules = ["ClapTextLayer", "ClapAudioLayer"]  # ClapModel names none

    def __init__(self, config):
        super().__init__(config)
        self.logit_scale_t.requires_grad_(False)
        globalise_batch_norms(self.audio_model)  # its mel input's BatchNorm: global batch statistics

    def forward(self, input_ids, attention_mask, input_features, is_longer=None):
        audio_embeds = self.get_audio_features(input_features=input_features, is_longer=is_longer).pooler_output
        text_embeds = self.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        return audio_embeds, text_embeds, self.logit_scale_a.exp()

    def get_input_embeddings(self):
        return self.text_model.embeddings.word_embeddings


class ClapForSigmoidTraining(ClapForContrastiveTraining):
    """`ClapModel` with the sigmoid loss: `logit_scale_a` unclamped and a learned `logit_bias`
    ([1], what `siglip_loss` takes last). ClapModel has no bias, so the saved model leaves it out:
    its softmax over the candidate labels (the zero-shot pipeline) does not depend on it."""

    loss = "siglip"
    max_logit_scale = None

    def __init__(self, config):
        super().__init__(config)
        self.logit_bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, input_features, is_longer=None):
        return (*super().forward(input_ids, attention_mask, input_features, is_longer), self.logit_bias)


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


# By the saved config's model_type and --loss
TRAINING_CLASSES = {("clip", "clip"): CLIPForContrastiveTraining, ("siglip", "siglip"): SiglipForContrastiveTraining,
                    ("siglip2", "siglip"): Siglip2ForContrastiveTraining, ("clap", "clip"): ClapForContrastiveTraining,
                    ("clap", "siglip"): ClapForSigmoidTraining}


def build_contrastive(args: ModelArgs, modality: str = "image"):
    """(model, tokenizer, media processor) for `args.loss`: loaded from `model_name_or_path`, or
    the tiny default for `modality` ("image": CLIP or SigLIP; "audio": CLAP). The media processor is
    the image processor, or CLAP's feature extractor.

    Build it *before* `Accelerator()`: under ZeRO-3 accelerate registers the DeepSpeed config
    with transformers, and a model constructed afterwards is partitioned at construction with a
    different random init (a different first loss than DDP's and ZeRO-2's).
    """
    if args.model_name_or_path:
        model_type = AutoConfig.from_pretrained(args.model_name_or_path).model_type
        model_class = TRAINING_CLASSES.get((model_type, args.loss))
        if model_class is None:
            losses = [loss for kind, loss in TRAINING_CLASSES if kind == model_type]
            trains = (f"set --loss {' or '.join(losses)}" if losses
                      else f"it trains {', '.join(sorted({kind for kind, _ in TRAINING_CLASSES}))}")
            raise ValueError(f"{args.model_name_or_path} is a {model_type!r} model, not {args.loss}: {trains}")
        model = model_class.from_pretrained(args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        # by what the model's tower takes: CLAP saves a feature extractor, not an image processor
        processor_class = AutoFeatureExtractor if model_modality(model) == "audio" else AutoImageProcessor
        image_processor = processor_class.from_pretrained(args.model_name_or_path)
        if isinstance(model, ClapForSigmoidTraining):  # a saved ClapModel holds no bias
            with torch.no_grad():
                model.logit_bias.fill_(args.logit_bias_init_value)
    elif modality == "audio":
        model, tokenizer, image_processor = _tiny_clap(args)
    elif args.loss == "clip":
        model, tokenizer, image_processor = _tiny_clip(args)
    else:
        model, tokenizer, image_processor = _tiny_siglip(args)
    if modality != model_modality(model):
        raise ValueError(f"the data holds {modality}, and this {model.config.model_type} model takes "
                         f"{model_modality(model)}: give a model that takes {modality}, or other data")
    if args.max_num_patches:
        if not takes_patch_grids(image_processor):
            raise ValueError(f"--max_num_patches sizes SigLIP 2 NaFlex images; this {model.config.model_type} model "
                             "takes fixed-size images: drop the flag")
        image_processor.max_num_patches = args.max_num_patches
    # After loading: CLIP's logit_scale (CLAP's two) is 0-dim, which FSDP and DeepSpeed reject (saved
    # back as it was).
    model.saved_scalar_shapes = {}
    for name, param in list(model.named_parameters(recurse=False)):
        if param.dim() == 0:
            model.saved_scalar_shapes[name] = param.shape
            setattr(model, name, torch.nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))
    model._no_split_modules = fsdp_block_classes(model)  # what fsdp2.yaml wraps
    model.set_attn_implementation(args.attn_implementation or ("sdpa" if model._supports_sdpa else "eager"))
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
        model.logit_scale.fill_(initial_logit_scale(args))
        model.logit_bias.fill_(args.logit_bias_init_value)
    return model, tokenizer, image_processor


def initial_logit_scale(args: ModelArgs) -> float:
    """A tiny model's starting logit scale: --logit_scale_init_value, else CLIP's ln(1/0.07) for the
    softmax loss and the SigLIP paper's ln 10 for the sigmoid loss."""
    if args.logit_scale_init_value is not None:
        return args.logit_scale_init_value
    return 2.6592 if args.loss == "clip" else math.log(10)


def model_modality(model) -> str:
    """What the model's first tower takes: "audio" (CLAP) or "image"."""
    return "audio" if hasattr(model, "audio_model") else "image"


def _tiny_clap(args: ModelArgs):
    """A tiny ClapModel: the text tower of `_tower`, an HTSAT audio tower of `num_layers` Swin
    stages over 16x16 patches of the 256x256 mel image, and CLAP's feature extractor (48 kHz, 64 mel
    bins, a random crop of longer clips: `rand_trunc`, what LAION-CLAP's unfused checkpoints ship)
    reading 2 s windows (the checkpoints' 10 s cost five times the CPU per clip)."""
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or TINY_TOKENIZER)
    # RoBERTa positions start after the pad id: room for pad_token_id + 1 + the longest caption
    # no dropout, as the tiny CLIP and SigLIP: each rank would draw its own masks (ClapConfig's text default: 0.1)
    text_config = dict(_tower(args), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       max_position_embeddings=tokenizer.model_max_length + tokenizer.pad_token_id + 1)
    width = max(32, args.hidden_size // 2 ** (args.num_layers - 1))  # Swin doubles it each stage
    stages = args.num_layers
    audio_config = dict(depths=[1] * stages, num_attention_heads=[max(1, width // 32)] * stages,
                        patch_embeds_hidden_size=width, hidden_size=width * 2 ** (stages - 1),
                        enable_fusion=False, hidden_dropout_prob=0.0, spec_size=256, num_mel_bins=64,
                        window_size=8, patch_size=16, patch_stride=[16, 16])
    config = ClapConfig(text_config=text_config, audio_config=audio_config, projection_dim=args.projection_dim)
    model = ClapForContrastiveTraining(config) if args.loss == "clip" else ClapForSigmoidTraining(config)
    with torch.no_grad():
        model.logit_scale_a.fill_(initial_logit_scale(args))
        model.logit_scale_t.copy_(model.logit_scale_a)
        if args.loss == "siglip":
            model.logit_bias.fill_(args.logit_bias_init_value)
    return model, tokenizer, ClapFeatureExtractor(truncation="rand_trunc", max_length_s=2)


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
        logit_scale_init_value=initial_logit_scale(args),
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
    param, max_value = getattr(unwrapped, unwrapped.scale_name), unwrapped.max_logit_scale
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
    """`save_pretrained` a directory that `CLIPModel`/`SiglipModel`/`ClapModel.from_pretrained` and
    the zero-shot pipeline load (model + tokenizer + image processor or feature extractor).

    `get_state_dict` gathers full weights under FSDP2/ZeRO-3, so every rank must call this.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        for name, shape in unwrapped.saved_scalar_shapes.items():
            state_dict[name] = state_dict[name].reshape(shape)
        if isinstance(unwrapped, ClapForContrastiveTraining):  # ClapModel's keys: one scale, no bias
            state_dict["logit_scale_t"] = state_dict["logit_scale_a"].clone()
            state_dict.pop("logit_bias", None)
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, save_function=accelerator.save)
        # a plain checkpoint: loads without mmrecipes
        unwrapped.config.architectures = [unwrapped.hf_architecture]
        unwrapped.config.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        image_processor.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
