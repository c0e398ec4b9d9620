"""FLIP's patch dropout (mmrecipes.contrastive.patch_dropout) on the tiny CLIP and SigLIP, in process: what the encoder
sees in training and in evaluation, and a recipe run with it."""

import pytest
import torch

from launch import run_recipe
from mmrecipes.contrastive.arguments import ModelArgs
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.contrastive.patch_dropout import add_patch_dropout


def encoder_inputs(model, pixel_values) -> torch.Tensor:
    """The tokens the vision encoder gets for these pixels (what follows the embeddings)."""
    seen = []
    handle = model.vision_model.encoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("inputs_embeds", args[0] if args else None)),
        with_kwargs=True)
    with torch.no_grad():
        model.get_image_features(pixel_values=pixel_values)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("loss, class_token", [("clip", 1), ("siglip", 0)])
def test_training_sees_half_the_patches_and_evaluation_all(loss, class_token):
    torch.manual_seed(0)
    model = build_contrastive(ModelArgs(loss=loss))[0]
    pixels = torch.randn(3, 3, 32, 32)  # 16 patches of 8 px
    model.eval()
    everything = encoder_inputs(model, pixels)
    features = model.get_image_features(pixel_values=pixels).pooler_output
    add_patch_dropout(model, 0.5)
    torch.testing.assert_close(model.get_image_features(pixel_values=pixels).pooler_output, features)  # eval as before
    assert encoder_inputs(model, pixels).shape == everything.shape == (3, class_token + 16, 64)
    model.train()
    kept = encoder_inputs(model, pixels)
    assert kept.shape == (3, class_token + 8, 64)
    positions = []  # where each kept token was among the image's own tokens
    for image in range(3):
        matches = (kept[image][:, None] == everything[image][None]).all(dim=-1)
        assert matches.any(dim=1).all()  # every kept token is one of the image's own
        positions.append(matches.float().argmax(dim=1).tolist())
    assert all(position[:class_token] == [0] * class_token for position in positions)  # the class token, first
    assert len({tuple(position) for position in positions}) > 1  # each image its own draw


@pytest.mark.launch
def test_the_recipe_trains_with_patch_dropout_and_refuses_it_with_the_feature_cache(tmp_path):
    result = run_recipe("--patch_dropout", 0.5, "--max_steps", 4, "--logging_steps", 2, "--eval_split", "",
                        "--zeroshot_dataset", "", "--output_dir", tmp_path / "run")
    assert result.returncode == 0, result.log[-3000:]
    assert "patch dropout 0.5: training keeps the class token and a random 50% of each image's patches" in result.log
    refused = run_recipe("--patch_dropout", 0.5, "--contrastive_accumulation", "feature_cache", "--output_dir",
                         tmp_path / "refused")
    assert refused.returncode != 0 and "would drop other patches than its first" in refused.log
