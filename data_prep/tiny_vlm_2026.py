"""Tiny checkpoints of the image-text-to-text families of 2026, saved in their hub layout (as tiny_vlm.py's):

    python data_prep/tiny_vlm_2026.py --family qwen3_5 --output_dir /tmp/tiny-qwen3_5
    accelerate launch recipes/vlm_finetune.py --model_name_or_path /tmp/tiny-qwen3_5

- `qwen3_5`: Qwen3.5 (Qwen/Qwen3.5-2B and smaller: `qwen3_5_nothink.jinja`): Gated DeltaNet (linear attention
  with a causal convolution) in every layer but the last of each group, gated full attention there; partial,
  interleaved mRoPE; Qwen3-VL's processor and vision tower.
- `qwen3_5_think`: the same model with the template of Qwen3.5-4B and larger (`qwen3_5_think.jinja`), whose
  generation prompt opens a think block the model fills.
- `qwen3_vl_moe`: Qwen3-VL-30B-A3B (Qwen3-VL-8B's template): every decoder MLP a sparse block of 4 experts, 2 per
  token (the checkpoint: 128, 8), the experts fused into 3-D parameters as transformers 5 holds them.
- `qwen3_5_moe`: Qwen3.5-35B-A3B (`qwen3_5_think.jinja`): Qwen3.5's hybrid layers, each MLP a sparse block of 4
  experts, 2 per token, beside a gated shared expert.
"""

from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from tiny_vlm import _qwen, family_main, save_family

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.001)
# Qwen3.5's layer pattern at toy size: a linear-attention layer, then a full-attention one (3:1 in the checkpoints)
HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


def qwen3_5(template_name="qwen3_5_nothink"):
    """Qwen3.5 dense: head_dim 32 with a quarter of it rotated (the checkpoints': 256 and 0.25), the rotated pairs
    split over time, height and width as [2, 1, 1] (theirs: [11, 11, 10]) and interleaved."""
    return _qwen((Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor),
                 template_name, vision=dict(num_position_embeddings=64),
                 rope=dict(mrope_section=[2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.25),
                 text=dict(head_dim=32, **HYBRID), added_tokens=["<think>", "</think>"])


def qwen3_5_think():
    return qwen3_5("qwen3_5_think")


def qwen3_vl_moe():
    return _qwen((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor),
                 "qwen3_vl", vision=dict(num_position_embeddings=64, deepstack_visual_indexes=[0]),
                 rope=dict(mrope_section=[2, 3, 3], mrope_interleaved=True), text=dict(decoder_sparse_step=1, **MOE))


def qwen3_5_moe():
    return _qwen((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor),
                 "qwen3_5_think", vision=dict(num_position_embeddings=64),
                 rope=dict(mrope_section=[2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.25),
                 text=dict(head_dim=32, shared_expert_intermediate_size=32, **HYBRID, **MOE),
                 added_tokens=["<think>", "</think>"])


FAMILIES = {"qwen3_5": qwen3_5, "qwen3_5_think": qwen3_5_think, "qwen3_vl_moe": qwen3_vl_moe,
            "qwen3_5_moe": qwen3_5_moe}


def save_tiny_vlm_2026(family: str, output_dir):
    return save_family(FAMILIES, family, output_dir)


if __name__ == "__main__":
    family_main(__doc__, FAMILIES)
