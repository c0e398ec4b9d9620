"""vlm_finetune.py on a mixture-of-experts VLM (the tiny Qwen3-VL-MoE: 4 experts, 2 per token) on 2 CPU processes whose
tokens go to different experts: rank 0's only ever to experts 0 and 1, rank 1's own words to experts 2 and 3 (its
router, embeddings and the writes to one hidden dimension set so, `split_routing`).

- ZeRO-3, full fine-tuning, global-batch load balancing: no hang (the sparse blocks are leaf modules), and every
  step's loss, aux_loss and gradient norm equal DDP's and one process's holding the window;
- FSDP2, LoRA on attention and the fused experts, the model's own balancing: the loss falls, the adapter on the base
  gives the merged model's logits, and the merged model loads with the Auto class with its experts changed;
- README's command, flags as written (ZeRO-3, LoRA at the default --lora_dropout, global-batch balancing), on the tiny
  Qwen3-VL-MoE and Qwen3.5-MoE: it stopped in PEFT ("lora.ParamWrapper does not work with lora_dropout != 0").
"""

import shlex

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers import chat_row, write_chat_parquet
from launch import REPO, VLM_RECIPE, assert_engine, assert_same_curves, losses, run_engine, run_recipe
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.moe import Routing
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from test_family_conformance import collator_row

pytestmark = pytest.mark.launch

RANK0 = [chat_row("Name a colour.", "red"), chat_row("Which colour is the sky?", "blue")]
RANK1 = [chat_row("How many sides has a square?", "four"), chat_row("What comes after one?", "two")]
STEPS = 4
COMMON = ["--max_steps", STEPS, "--logging_steps", 1, "--dataset_name", "parquet", "--dataset_weights", "",
          "--shuffle_buffer_size", 1, "--eval_dataset_name", "", "--ddp_timeout", 60]
RANKS = ["--per_device_train_batch_size", 1, "--gradient_accumulation_steps", 2]
GLOBAL = ["--router_aux_loss_coef", 1.0, "--router_aux_loss_scope", "global_batch"]  # large: it moves the gradients
LORA = ["--use_peft", "true", "--lora_r", 4, "--lora_alpha", 8, "--lora_dropout", 0.0, "--router_aux_loss_coef", 1.0]


def prompt_tokens(processor, rows):
    return {token for row in rows for token in processor(
        text=processor.apply_chat_template(row["messages"]))["input_ids"][0]}


@torch.no_grad()
def split_routing(directory, output_dir):
    """The checkpoint with routing by the sign of hidden dimension 0: every router sends a token to experts 0 and 1
    where it is positive, to 2 and 3 where it is negative; the embeddings make it negative for the tokens only rank
    1's rows hold, and no attention or expert writes to it, so every layer routes on the token alone."""
    model = AutoModelForImageTextToText.from_pretrained(directory)
    processor = AutoProcessor.from_pretrained(directory)
    own = sorted(prompt_tokens(processor, RANK1) - prompt_tokens(processor, RANK0))
    language_model = model.model.language_model
    language_model.embed_tokens.weight[:, 0] = 1.0
    language_model.embed_tokens.weight[own, 0] = -1.0
    for layer in language_model.layers:
        layer.self_attn.o_proj.weight[0] = 0
        layer.mlp.experts.down_proj[:, 0] = 0
        layer.mlp.gate.weight.zero_()
        layer.mlp.gate.weight[:2, 0], layer.mlp.gate.weight[2:, 0] = 0.3, -0.3
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    return output_dir


@pytest.fixture(scope="module")
def split(tiny_vlms, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_split")
    (root / "single").mkdir()
    write_chat_parquet(root / "rank0.parquet", RANK0 * 8)
    write_chat_parquet(root / "rank1.parquet", RANK1 * 8)
    write_chat_parquet(root / "single" / "all.parquet", (RANK0 + RANK1) * 8)  # each window: rank 0's, rank 1's
    return split_routing(tiny_vlms["qwen3_vl_moe"], root / "model"), root


def test_zero3_with_experts_per_rank_gives_one_processs_steps(split):
    """Rank 0's tokens never reach experts 2 and 3, rank 1's do. ZeRO-3 gathers each sparse block whole (a leaf
    module, found from the model), so ranks that pick different experts run the same collectives; with global-batch
    balancing every step equals DDP's and one process's holding the window (batch 4): loss, aux_loss and gradient
    norm."""
    directory, data = split
    model, processor = AutoModelForImageTextToText.from_pretrained(directory), AutoProcessor.from_pretrained(directory)
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    counts = [VLMForTraining(model)(collator([collator_row(labeller, row["messages"], []) for row in rows]),
                                    Routing(2))[0] for rows in (RANK0, RANK1)]
    assert counts[0][2:].sum() == 0 and counts[0][:2].all() and counts[1][2:].all()  # the scenario holds
    truth = run_recipe(*COMMON, *GLOBAL, "--model_name_or_path", directory, "--per_device_train_batch_size", 4,
                       "--gradient_accumulation_steps", 1, "--data_files", data / "single" / "all.parquet",
                       "--output_dir", data / "single_run", recipe=VLM_RECIPE)
    assert truth.returncode == 0, truth.log[-3000:]
    result = run_engine("zero3.yaml", *COMMON, *GLOBAL, *RANKS, "--model_name_or_path", directory,
                        "--data_files", data / "rank*.parquet", "--output_dir", data / "zero3", recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, "zero3.yaml", wrapped="VLMForTraining")
    assert "sparse blocks Qwen3VLMoeTextSparseMoeBlock: each a ZeRO-3 leaf module" in result.log
    assert "load-balancing loss x 1.0 (global-batch" in result.log
    ddp = run_engine("ddp.yaml", *COMMON, *GLOBAL, *RANKS, "--model_name_or_path", directory,
                     "--data_files", data / "rank*.parquet", "--output_dir", data / "ddp", recipe=VLM_RECIPE)
    assert ddp.returncode == 0, ddp.log[-3000:]
    for reference in (truth, ddp):
        assert_same_curves(result.log, reference.log, range(1, STEPS + 1), rel=1e-5, grad_norm=True)
        assert aux_losses(result.log) == pytest.approx(aux_losses(reference.log), rel=1e-6)
    assert len(aux_losses(truth.log)) == STEPS


def test_lora_on_the_experts_under_fsdp2_merges_into_a_model_the_auto_class_loads(split, tmp_path):
    directory, data = split
    result = run_engine("fsdp2.yaml", *COMMON, *LORA, *RANKS, "--model_name_or_path", directory,
                        "--data_files", data / "rank*.parquet", "--output_dir", tmp_path, recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, "fsdp2.yaml", wrapped="VLMForTraining")
    assert losses(result.log)[STEPS] < losses(result.log)[1]
    assert "load-balancing loss x 1.0 (micro-batch" in result.log and aux_losses(result.log)
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(".mlp.experts.lora_A." in name for name in adapter)  # target_parameters reached the fused experts
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    base = AutoModelForImageTextToText.from_pretrained(directory)
    experts = [name for name, _ in base.named_parameters() if name.endswith("mlp.experts.down_proj")]
    assert not torch.equal(merged.get_parameter(experts[0]), base.get_parameter(experts[0]))
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    processor = AutoProcessor.from_pretrained(tmp_path)
    chat = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    inputs = processor(text=processor.apply_chat_template(chat, add_generation_prompt=True), return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(adapted(**inputs).logits, merged(**inputs).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_readmes_moe_lora_command_runs_as_written_under_zero3(tiny_vlms, family, tmp_path):
    command = readme_command("Qwen3-VL-30B-A3B-Instruct")
    assert command[:4] == ["accelerate", "launch", "--config_file", "accelerate_configs/zero3.yaml"]
    model = command.index("--model_name_or_path")
    flags = command[5:model] + command[model + 2:]  # as written, the checkpoint swapped for the tiny one
    assert "--use_peft" in flags and "--lora_dropout" not in flags
    result = run_engine("zero3.yaml", *flags, "--model_name_or_path", tiny_vlms[family], "--max_steps", 2,
                        "--logging_steps", 1, "--per_device_train_batch_size", 2, "--eval_steps", 2,
                        "--eval_generation_rows", 2, "--output_dir", tmp_path, recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, "zero3.yaml", wrapped="VLMForTraining")
    assert "LoRA dropout 0, not --lora_dropout 0.05: the adapters on the fused experts" in result.log
    assert len(aux_losses(result.log)) == 2
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(".mlp.experts.lora_A." in name for name in adapter)


def readme_command(mark: str) -> list[str]:
    """README's shell command that names `mark`, its continued lines joined, as arguments."""
    lines = (REPO / "README.md").read_text().splitlines()
    end = next(index for index, line in enumerate(lines) if mark in line)
    start = end
    while lines[start - 1].rstrip().endswith("\\"):
        start -= 1
    while lines[end].rstrip().endswith("\\"):
        end += 1
    return shlex.split(" ".join(line.rstrip().rstrip("\\") for line in lines[start:end + 1]))


def aux_losses(log: str) -> list[float]:
    return [float(line.split("| aux_loss ")[1].split()[0]) for line in log.splitlines() if "| aux_loss " in line]
