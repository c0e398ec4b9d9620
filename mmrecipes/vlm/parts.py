"""What a VLM recipe trains, in one call before `Accelerator()`: the model and its processor, the stop and placeholder
ids, the dummy image, the module groups and what of them trains (the freezing preset, or LoRA), the engine's input
gradients and ZeRO-3 leaf modules (a mixture of experts' sparse blocks), the FLOPs per batch; and the log lines that
say so. The recipe keeps the Accelerate skeleton."""

import copy
from dataclasses import dataclass

import torch

from ..arguments import TrainingArgs
from ..training import optimizer_groups
from .arguments import LoraArgs, VLMModelArgs
from .families import dummy_image_inputs, placeholder_token_ids
from .flops import VLMFlops
from .lora import add_lora, describe_trainable
from .models import VLMForTraining, apply_train_modules, load_vlm, stop_token_ids
from .module_groups import ModuleGroups, module_groups
from .moe import sparse_block_classes


@dataclass
class VLMParts:
    model: torch.nn.Module  # the AutoModelForImageTextToText (LoRA adapters injected into it)
    processor: object
    stops: list[int]  # the tokens that end an assistant turn
    placeholders: list[int]  # image and video placeholder ids: never sampled nor decoded
    dummy_inputs: dict  # the dummy image a text-only batch carries
    groups: ModuleGroups
    trainable: dict[str, list[torch.nn.Parameter]]  # by group
    peft_model: object = None  # with LoRA: the PeftModel describing the adapters (their switch, their config)
    flops: VLMFlops | None = None  # a batch's training FLOPs (MFU)
    frozen_copy: VLMForTraining | None = None  # a reference's starting weights, copied before `prepare`
    sparse_blocks: tuple[str, ...] = ()  # a mixture of experts' router-and-experts classes: ZeRO-3 leaf modules

    @property
    def peft_config(self):
        return self.peft_model.peft_config["default"] if self.peft_model is not None else None

    def optimizer_groups(self, args: TrainingArgs) -> list[dict]:
        """AdamW groups of the trainable parameters (frozen ones hold no state); the tower, if it trains, at its own
        lr and weight decay (--vision_tower_learning_rate, --vision_tower_weight_decay)."""
        return optimizer_groups(self.trainable, learning_rate=args.learning_rate, weight_decay=args.weight_decay,
                                own_rates={"vision_tower": (args.vision_tower_learning_rate,
                                                            args.vision_tower_weight_decay)})

    def describe(self) -> str:
        lines = [self.groups.describe(), describe_trainable(self.model)]
        if self.sparse_blocks:
            lines.append(f"sparse blocks {', '.join(self.sparse_blocks)}: each a ZeRO-3 leaf module (gathered as one, "
                         "whichever experts a rank's tokens pick); a load-balancing loss only in vlm_finetune.py "
                         "(--router_aux_loss_coef): vlm_dpo.py and vlm_grpo.py add none")
        if self.groups.unreached:
            lines.append(f"froze {len(self.groups.unreached)} parameters no forward path reaches: "
                         + ", ".join(self.groups.unreached))
        return "\n".join(lines)


def vlm_parts(model_args: VLMModelArgs, lora_args: LoraArgs, *, seq_len: int, frozen_copy: bool = False) -> VLMParts:
    """Load the model (`load_vlm`), find its groups from one dummy backward, freeze what --train_modules leaves out
    and every parameter no forward path reaches (DDP would wait for their gradients), add LoRA adapters where asked
    (everything but them and the projector frozen), and count the FLOPs now (after `prepare` ZeRO-3's parameters
    report numel 0). `frozen_copy`: keep a frozen copy of the starting weights for a reference model without LoRA
    (`reference.Reference.build` shards it like the policy after `prepare`). Call it before `Accelerator()`: under
    ZeRO-3 a model built afterwards is partitioned and re-initialised."""
    model, processor = load_vlm(model_args)
    dummy_inputs = dummy_image_inputs(model, processor)
    groups = module_groups(model, dummy_inputs)
    trainable = apply_train_modules(groups, model_args.train_modules)
    peft_model = None
    if lora_args.use_peft:  # adapters injected into `model` itself
        peft_model, trainable = add_lora(model, groups, model_args.train_modules, lora_args)
    if blocks := sparse_block_classes(model):  # ranks route to different experts: gather each block whole
        from deepspeed.utils import set_z3_leaf_modules  # here: seconds to import, for MoE models only

        set_z3_leaf_modules(model, sorted(blocks, key=lambda block: block.__name__))
    if model_args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if not model.get_input_embeddings().weight.requires_grad:
        # A frozen embedding (LoRA, the projector preset) gives a text-only batch an LM input without grad: its
        # backward would skip the LM where an image batch's runs through it, so ZeRO-3 and FSDP2 ranks would
        # gather different parameters (and checkpointed layers would get no gradients).
        model.enable_input_require_grads()
    flops = VLMFlops(model, sum(p.numel() for _, p in groups.vision_tower), seq_len=seq_len,
                     lm_weights_train="language_model" in trainable and peft_model is None,
                     vision_trains="vision_tower" in trainable)
    copied = None
    if frozen_copy and peft_model is None:  # with LoRA the reference is the policy, its adapters disabled
        copied = copy.deepcopy(VLMForTraining(model)).requires_grad_(False).eval()
    return VLMParts(model, processor, stop_token_ids(model, processor), placeholder_token_ids(model, processor),
                    dummy_inputs, groups, trainable, peft_model, flops, copied,
                    tuple(sorted(block.__name__ for block in blocks)))
