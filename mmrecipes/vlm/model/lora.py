"""LoRA adapters for any image-text-to-text family, with TRL's flag names, correct under every
engine (docs/vlm.md, "LoRA").

Where the adapters go follows the module groups, not a list of names: every linear layer of the
language model by default, and a mixture of experts' fused expert weights (`target_parameters`); the
towers' too with `--train_modules all` (PEFT's `all-linear` keeps PEFT's meaning); the projector
trained in full beside them (`modules_to_save`), everything else frozen before `prepare`. The
adapters are injected into the model object itself, which is what trains; `save_lora` writes the
adapter (`output_dir/adapter`) and the merged model.
"""

import os
from copy import deepcopy

import torch
from peft import LoraConfig, get_peft_model
from transformers.modeling_utils import set_zero3_state

from ..arguments import LoraArgs
from .module_groups import ModuleGroups, covering_modules
from .moe import sparse_block_classes


def lora_config(model, groups: ModuleGroups, train_modules: str, args: LoraArgs) -> LoraConfig:
    """This run's LoraConfig; a name that matches nothing is rejected before the first step."""
    if train_modules == "projector":
        raise ValueError("--use_peft with --train_modules projector leaves LoRA nothing to adapt (LLaVA stage 1 trains "
                         "the projector in full): use --train_modules projector,language_model or all")
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    if args.lora_target_modules is None:
        head = model.get_output_embeddings()
        parts = [groups.language_model] + ([groups.vision_tower, groups.audio_tower] if train_modules == "all" else [])
        inside = {name for part in parts for name, _ in part}
        targets = [name for name in linear if model.get_submodule(name) is not head and f"{name}.weight" in inside]
    elif args.lora_target_modules == "all-linear":
        targets = "all-linear"
    else:
        targets = [name.strip() for name in args.lora_target_modules.split(",")]
        missing = [t for t in targets if not any(name == t or name.endswith("." + t) for name in linear)]
        if missing:
            leaves = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise ValueError(f"--lora_target_modules {args.lora_target_modules!r}: no linear layer is called "
                             f"{', '.join(missing)} (the model's linear layers: {', '.join(leaves)})")
    extra = [name.strip() for name in (args.lora_modules_to_save or "").split(",") if name.strip()]
    modules = dict(model.named_modules())
    if unknown := [name for name in extra if name not in modules]:
        raise ValueError(f"--lora_modules_to_save: the model has no module {', '.join(unknown)}")
    experts = expert_parameters(model, groups) if args.lora_target_modules is None else None
    # PEFT's adapters on a parameter (ParamWrapper) refuse dropout, and a config holds one dropout for every adapter
    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0 if experts else args.lora_dropout,
                      target_modules=targets, target_parameters=experts,
                      modules_to_save=projector_modules(model, groups) + extra)


def dropout_note(config: LoraConfig, args: LoraArgs) -> str | None:
    """The log line where the adapters train without the dropout asked for: a mixture of experts'
    fused experts carry adapters (`expert_parameters`), which PEFT runs without dropout, and one
    config holds one dropout."""
    if config.target_parameters and args.lora_dropout:
        return (f"LoRA dropout 0, not --lora_dropout {args.lora_dropout}: the adapters on the fused experts "
                "(PEFT's target_parameters) take none, and one adapter config holds one dropout for all; "
                "--lora_target_modules (linear layers only, no expert adapters) keeps it")
    return None


def expert_parameters(model, groups: ModuleGroups) -> list[str] | None:
    """The language model's fused experts: transformers 5 holds each MoE layer's experts as 3-D
    parameters of its sparse block, which no `target_modules` reaches (PEFT #3009); PEFT's
    `target_parameters` does."""
    inside = {name for name, _ in groups.language_model}
    blocks = tuple(sparse_block_classes(model))
    names = [f"{block_name}.{name}" for block_name, block in model.named_modules()
             if blocks and isinstance(block, blocks)
             for name, param in block.named_parameters() if param.ndim == 3 and f"{block_name}.{name}" in inside]
    return names or None


def projector_modules(model, groups: ModuleGroups) -> list[str]:
    """The projector's modules at a granularity PEFT can wrap: a ModuleList's items, not the
    list."""
    modules = dict(model.named_modules())
    names = []
    for name in covering_modules([n for n, _ in groups.projector], [n for n, _ in model.named_parameters()]):
        if name not in modules:
            continue  # a bare parameter (LLaVA-OneVision's image_newline)
        module = modules[name]
        is_list = isinstance(module, torch.nn.ModuleList)
        names += [f"{name}.{i}" for i, _ in module.named_children()] if is_list else [name]
    return names


def add_lora(model, groups: ModuleGroups, train_modules: str, args: LoraArgs):
    """(the PeftModel, the trainable parameters by group): adapters on the LM's layers (and the
    tower's with `all`, at the tower's learning rate), the projector's trainable copy; all else
    frozen."""
    config = lora_config(model, groups, train_modules, args)
    towers = {name: group for group in ("vision_tower", "audio_tower") for name, _ in getattr(groups, group)}
    peft_model = get_peft_model(model, config)
    trainable = {"vision_tower": [], "projector": [], "language_model": [], "audio_tower": []}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if ".modules_to_save." in name:
            trainable["projector"].append(param)
        elif (tower := towers.get(name.split(".lora_")[0] + ".weight")) is not None:  # the adapter of a tower layer
            trainable[tower].append(param)
        else:
            trainable["language_model"].append(param)
    if train_modules == "all":
        check_towers_reached(model, groups, trainable, args)
    return peft_model, {name: params for name, params in trainable.items() if params}


def check_towers_reached(model, groups: ModuleGroups, trainable: dict, args: LoraArgs):
    """Refuse --train_modules all whose LoRA targets reach no linear layer of a tower (the usual
    q_proj,...,down_proj preset misses Gemma 4's towers and the Qwen2.5-Omni audio tower's fc1/fc2):
    the tower would stay frozen while the run says it trains."""
    for tower in ("vision_tower", "audio_tower"):
        names = {name.removesuffix(".weight") for name, _ in getattr(groups, tower)}
        if not names or trainable[tower]:
            continue
        leaves = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear) and name in names})
        raise ValueError(f"--use_peft with --train_modules all: --lora_target_modules {args.lora_target_modules!r} "
                         f"reaches no linear layer of the {tower.replace('_', ' ')}, which would stay frozen: add "
                         f"its layers ({', '.join(leaves)}) or give all-linear")


def describe_trainable(model) -> str:
    """The log line: how many parameters train and how many are frozen."""
    trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return f"trainable parameters {trains:,} ({trains / (trains + frozen):.2%}), frozen {frozen:,}"


def save_lora(peft_config: LoraConfig, inner, state_dict: dict, processor, output_dir):
    """On the main process, from the gathered full state dict (any engine): the adapter in
    `output_dir/adapter`, the merged model in `output_dir`, each with the processor (its chat
    template) and the input's generation config (its stop tokens and sampling settings).

    The adapters are put back on a copy of the model built on the meta device (no memory, no init)
    and loaded with `assign`, so the sharded engines need no unsharded live model. Under ZeRO-3,
    transformers would build it (and its sub-models) inside `deepspeed.zero.Init`, a collective the
    other ranks never join: `set_zero3_state` tells it that one is already open.
    """
    with torch.device("meta"), set_zero3_state():
        copy = type(inner)(inner.config)
    # built from the config, it has the defaults only
    copy.generation_config = deepcopy(inner.generation_config)
    peft_copy = get_peft_model(copy, peft_config)
    copy.load_state_dict(state_dict, assign=True, strict=False)
    copy.tie_weights()
    if missing := [name for name, p in copy.named_parameters() if p.is_meta]:
        raise RuntimeError(f"the gathered state dict lacks {missing[:5]}")
    adapter_dir = os.path.join(output_dir, "adapter")
    peft_copy.save_pretrained(adapter_dir)
    # what the base model alone would not stop on
    copy.generation_config.save_pretrained(adapter_dir)
    processor.save_pretrained(adapter_dir)  # the chat template the adapter was trained with
    merged = peft_copy.merge_and_unload()
    merged.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
