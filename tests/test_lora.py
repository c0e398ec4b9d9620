"""LoRA in vlm_finetune.py (--use_peft), in one process: where the adapters go and what is rejected before
the first step. The launched runs (mixed text-only / image ranks under the engines, the adapter and
the merged model saved, exact resume) are in test_vlm_engines.py."""

import pytest
import torch

from helpers import adapted_layers, tiny
from launch import VLM_RECIPE, load_recipe
from mmrecipes.vlm.arguments import LoraArgs
from mmrecipes.vlm.model.lora import lora_config


@pytest.mark.parametrize("family", [None, "qwen2_5_vl"])
def test_adapters_go_on_the_language_model_and_all_linear_would_touch_the_tower(tiny_vlms, family):
    """Default: exactly the LM's linear layers (not the head). `all` adds the tower's. PEFT's all-linear
    also adapts the vision tower and the projector, which TRL users exclude by hand."""
    model, _, groups = tiny(family and tiny_vlms[family])
    lm = {name.removesuffix(".weight") for name, _ in groups.language_model}
    tower = {name.removesuffix(".weight") for name, _ in groups.vision_tower}
    linear = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    config = lora_config(model, groups, "projector,language_model", LoraArgs(lora_r=4))
    projector = {name for name, _ in groups.projector}
    assert config.modules_to_save and all(any(p.startswith(m + ".") for p in projector) for m in config.modules_to_save)
    default = adapted_layers(model, config)
    assert default == (linear & lm) - {"lm_head"}

    model, _, groups = tiny(family and tiny_vlms[family])
    with_tower = adapted_layers(model, lora_config(model, groups, "all", LoraArgs(lora_r=4)))
    assert with_tower == default | (linear & tower)

    model, _, groups = tiny(family and tiny_vlms[family])
    all_linear = adapted_layers(model, lora_config(model, groups, "projector,language_model",
                                                   LoraArgs(lora_r=4, lora_target_modules="all-linear")))
    assert all_linear & tower  # what the default avoids


def test_bad_lora_settings_are_rejected_before_the_first_step(tmp_path):
    model, _, groups = tiny()
    with pytest.raises(ValueError, match="--lora_target_modules 'q_proj,attention': no linear layer is called "
                                         "attention \\(the model's linear layers: down_proj, fc1, fc2"):
        lora_config(model, groups, "projector,language_model", LoraArgs(lora_target_modules="q_proj,attention"))
    with pytest.raises(ValueError, match="--lora_modules_to_save: the model has no module model.head"):
        lora_config(model, groups, "projector,language_model", LoraArgs(lora_modules_to_save="model.head"))
    with pytest.raises(ValueError, match="--use_peft with --train_modules projector leaves LoRA nothing to adapt"):
        load_recipe(VLM_RECIPE).main(["--use_peft", "true", "--train_modules", "projector", "--report_to", "none",
                                      "--output_dir", str(tmp_path)])
