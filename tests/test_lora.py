"""LoRA in vlm_finetune.py (--use_peft): where the adapters go, what is rejected, and, launched on
2 CPU processes with mixed text-only / image ranks (test_vlm_engines.py's scenario), the losses of
one process under every engine, with and without gradient checkpointing, on Llava and Qwen2.5-VL;
the adapter and the merged model it saves; exact resume."""

import pytest
import torch
from accelerate.utils import set_seed
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from launch import VLM_RECIPE, accelerate_launch, engine_line, grad_norms, load_recipe, losses, run_recipe
from mmrecipes.lora import LoraArgs, lora_config
from mmrecipes.vlm import VLMModelArgs, load_vlm
from mmrecipes.vlm_families import dummy_image_inputs, module_groups
from test_vlm_engines import EXPECTED_ENGINE, SCENARIO, image_row, write_scenario

LORA = ["--use_peft", "true", "--lora_r", 4, "--lora_alpha", 8, "--lora_dropout",
        0.0]  # dropout 0: same masks on any rank count
STEPS = 6


def tiny(family_dir=None):
    set_seed(42)  # the recipe's seed: the tiny Llava it builds
    if family_dir is None:
        model, processor = load_vlm(VLMModelArgs())
    else:
        model, processor = AutoModelForImageTextToText.from_pretrained(family_dir), AutoProcessor.from_pretrained(family_dir)
    return model, processor, module_groups(model, dummy_image_inputs(model, processor))


def adapted_layers(model, config):
    peft_model = get_peft_model(model, config)
    return {name.removesuffix(".lora_A.default.weight") for name, _ in peft_model.base_model.model.named_parameters()
            if name.endswith(".lora_A.default.weight")}


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


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    return write_scenario(tmp_path_factory.mktemp("lora_scenario"))


# (family, engine, gradient checkpointing): the matrix the suite runs (all 16 ran by hand, see docs/vlm.md).
RUNS = [(None, "ddp.yaml", False), (None, "fsdp2.yaml", True), (None, "zero2.yaml", False), (None, "zero3.yaml", True),
        ("qwen2_5_vl", "ddp.yaml", True), ("qwen2_5_vl", "zero3.yaml", False)]


@pytest.fixture(scope="module")
def lora_runs(tiny_vlms, scenario, tmp_path_factory):
    runs = {}
    for family in (None, "qwen2_5_vl"):
        model = ["--model_name_or_path", tiny_vlms[family]] if family else []
        output_dir = tmp_path_factory.mktemp(f"lora_single_{family}")
        runs[family, "single"] = run_recipe(*SCENARIO, *LORA, *model, "--per_device_train_batch_size", 4,
                                            "--gradient_accumulation_steps", 1, "--data_files",
                                            scenario / "single" / "all.parquet", "--output_dir", output_dir,
                                            recipe=VLM_RECIPE), output_dir
    for family, config, checkpointing in RUNS:
        model = ["--model_name_or_path", tiny_vlms[family]] if family else []
        output_dir = tmp_path_factory.mktemp(f"lora_{family}_{config[:-5]}")
        runs[family, config] = accelerate_launch(
            config, *SCENARIO, *LORA, *model, "--gradient_checkpointing", str(checkpointing).lower(), "--save_steps", 3,
            "--data_files", scenario / "rank*.parquet", "--output_dir", output_dir, recipe=VLM_RECIPE), output_dir
    return runs


@pytest.mark.parametrize("family, config, checkpointing", RUNS)
def test_lora_under_every_engine_gives_the_losses_of_one_process(lora_runs, family, config, checkpointing):
    """Including ZeRO-3 with gradient checkpointing (non-reentrant: the CheckpointError of
    transformers#47254 / TRL#2514) and per-device batch 1 with a text-only rank."""
    truth, _ = lora_runs[family, "single"]
    assert truth.returncode == 0, truth.log[-3000:]
    result, _ = lora_runs[family, config]
    assert result.returncode == 0, result.log[-3000:]
    assert EXPECTED_ENGINE[config] in engine_line(result.log)
    assert "trainable parameters" in result.log and "frozen" in result.log
    assert sorted(losses(result.log)) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert losses(result.log)[step] == pytest.approx(losses(truth.log)[step], rel=1e-4), f"loss, step {step}"
        assert grad_norms(result.log)[step] == pytest.approx(grad_norms(truth.log)[step],
                                                             rel=1e-4), f"grad, step {step}"
    assert losses(result.log)[STEPS] < losses(result.log)[1]


@pytest.mark.parametrize("family", [None, "qwen2_5_vl"])
def test_adapter_reloads_on_the_base_and_gives_the_merged_models_logits(tiny_vlms, lora_runs, family):
    """output_dir/adapter on the untouched base = the merged model in output_dir; only the adapted
    layers and the projector differ from the base; frozen weights bit-identical."""
    _, output_dir = lora_runs[family, "zero3.yaml" if family else "fsdp2.yaml"]
    model, _, groups = tiny(family and tiny_vlms[family])
    layers = adapted_layers(model, lora_config(model, groups, "projector,language_model", LoraArgs(lora_r=4)))
    base, processor, groups = tiny(family and tiny_vlms[family])
    before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    adapted = PeftModel.from_pretrained(base, output_dir / "adapter").eval()
    merged = AutoModelForImageTextToText.from_pretrained(output_dir).eval()
    assert type(merged) is type(base)
    image = image_row()["images"][0]
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    inputs = processor(text=processor.apply_chat_template(chat, add_generation_prompt=True), images=[[image]],
                       return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(adapted(**inputs).logits, merged(**inputs).logits, rtol=1e-5, atol=1e-5)
    changed = {name for name, tensor in merged.state_dict().items() if not torch.equal(tensor, before[name])}
    projector = {name for name, _ in groups.projector}
    assert changed and changed <= {f"{layer}.weight" for layer in layers} | projector
    assert changed & projector


def test_frozen_weights_hold_no_optimizer_state_and_resume_is_exact(lora_runs, scenario, tmp_path):
    straight, output_dir = lora_runs[None, "ddp.yaml"]
    checkpoint = output_dir / "checkpoints" / "checkpoint-3"
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=False)
    model = load_file(checkpoint / "model.safetensors")
    trainable = [name for name in model if ".lora_" in name or ".modules_to_save." in name]
    assert len(optimizer["state"]) == len(trainable) < len(model)  # adapters and projector copy only
    resumed = accelerate_launch("ddp.yaml", *SCENARIO, *LORA, "--data_files", scenario / "rank*.parquet", "--output_dir",
                                tmp_path, "--resume_from_checkpoint", checkpoint, recipe=VLM_RECIPE)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert sorted(losses(resumed.log)) == [4, 5, 6]
    for step in (4, 5, 6):
        assert losses(resumed.log)[step] == pytest.approx(losses(straight.log)[step], abs=1e-6), f"step {step}"
    saved = load_file(output_dir / "adapter" / "adapter_model.safetensors")
    for name, tensor in load_file(tmp_path / "adapter" / "adapter_model.safetensors").items():
        torch.testing.assert_close(tensor, saved[name], rtol=1e-5, atol=1e-6, msg=name)
