"""The tiny default CLIP (built from a config, nothing downloaded) and what every engine needs of it."""

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType
from transformers import AutoImageProcessor, AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

from .distributed import fsdp_block_classes

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = REPO_ROOT / "data" / "tokenizer"
MAX_LOGIT_SCALE = math.log(100)  # CLIP clamps the temperature at 100


@dataclass
class ModelArgs:
    model_name_or_path: str | None = None  # a saved CLIP directory or hub id; None builds the tiny CLIP below
    tokenizer_name: str = str(TINY_TOKENIZER)  # used only with model_name_or_path=None
    image_size: int = 32
    patch_size: int = 8
    hidden_size: int = 64
    num_layers: int = 2
    projection_dim: int = 64
    logit_scale_init_value: float = 2.6592  # ln(1/0.07), as CLIP


class CLIPForContrastiveTraining(CLIPModel):
    """HF `CLIPModel` (same weights and keys) whose forward returns what a gathered loss needs.

    `forward` returns (image_embeds, text_embeds, logit_scale.exp()): the scale must be read
    inside the forward, where FSDP2 and ZeRO-3 have the parameter unsharded. Two changes make
    it acceptable to every engine (CPU_ENGINES.md): FSDP and DeepSpeed reject 0-dim parameters,
    so `build_clip` reshapes `logit_scale` to [1] once the weights are loaded (`save_clip` writes
    it back as []), and accelerate's FSDP2 path calls `get_input_embeddings()`, which CLIPModel
    does not implement.
    """

    def forward(self, input_ids, attention_mask, pixel_values):
        image_embeds = self.get_image_features(pixel_values=pixel_values).pooler_output
        text_embeds = self.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        return F.normalize(image_embeds, dim=-1), F.normalize(text_embeds, dim=-1), self.logit_scale.exp()

    def get_input_embeddings(self):
        return self.text_model.embeddings.token_embedding


def build_clip(args: ModelArgs):
    """(model, tokenizer, image_processor): loaded from `model_name_or_path`, or the tiny default.

    Build it *before* `Accelerator()`: under ZeRO-3 accelerate registers the DeepSpeed config
    with transformers, and a model constructed afterwards is partitioned at construction with a
    different random init (CPU_ENGINES.md).
    """
    if args.model_name_or_path:
        model = CLIPForContrastiveTraining.from_pretrained(args.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        image_processor = AutoImageProcessor.from_pretrained(args.model_name_or_path)
    else:
        model, tokenizer, image_processor = _tiny_clip(args)
    # After loading: the checkpoint's logit_scale is 0-dim, which FSDP and DeepSpeed reject.
    model.logit_scale = torch.nn.Parameter(model.logit_scale.detach().reshape(1))
    model._no_split_modules = fsdp_block_classes(model)  # what fsdp2.yaml wraps
    return model, tokenizer, image_processor


def _tiny_clip(args: ModelArgs):
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    tower = dict(hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                 num_hidden_layers=args.num_layers, num_attention_heads=max(1, args.hidden_size // 32))
    config = CLIPConfig(
        text_config=dict(
            tower, vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
            # CLIP pools the text tower at the first eos_token_id (FIELD_NOTES §6).
            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(tower, image_size=args.image_size, patch_size=args.patch_size),
        projection_dim=args.projection_dim,
        logit_scale_init_value=args.logit_scale_init_value,
    )
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": args.image_size}, crop_size={"height": args.image_size, "width": args.image_size}
    )
    return CLIPForContrastiveTraining(config), tokenizer, image_processor


@torch.no_grad()
def clamp_logit_scale_(accelerator, model, max_value: float = MAX_LOGIT_SCALE):
    """Clamp the logit scale after the optimizer step, on every copy the engine keeps.

    Clamping is elementwise, so each rank clamping the part it holds is exact. DDP: the
    parameter. FSDP2: this rank's DTensor shard. DeepSpeed keeps an fp32 master copy in the
    optimizer that the next step starts from: clamp it too (ZeRO-1/2: partitioned master, full
    model copy; ZeRO-3: both partitioned, plus a full copy of small parameters).
    Call it on every rank: under ZeRO-1/2 it runs collectives.
    """
    param = accelerator.unwrap_model(model).logit_scale
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        param.data.clamp_(max=max_value)
        return
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_local_fp32_param, safe_set_full_fp32_param,
                                 safe_set_local_fp32_param)

    if hasattr(param, "ds_id"):  # ZeRO-3
        safe_set_local_fp32_param(param, safe_get_local_fp32_param(param).clamp(max=max_value))
        param.ds_tensor.data.clamp_(max=max_value)
    else:
        safe_set_full_fp32_param(param, safe_get_full_fp32_param(param).clamp(max=max_value))
    # The model's full copy: ZeRO-1/2 always, ZeRO-3 for small "persistent" parameters it keeps
    # gathered (empty, so a no-op, otherwise).
    param.data.clamp_(max=max_value)


def save_clip(accelerator, model, tokenizer, image_processor, output_dir):
    """`save_pretrained` a loadable CLIP directory (model + tokenizer + image processor).

    `get_state_dict` gathers full weights under FSDP2/ZeRO-3, so every rank must call this.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        state_dict["logit_scale"] = state_dict["logit_scale"].reshape(())
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, save_function=accelerator.save)
        unwrapped.config.architectures = ["CLIPModel"]  # a plain CLIP checkpoint: loads without mmrecipes
        unwrapped.config.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        image_processor.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
