"""Locked towers (LiT, mmrecipes.contrastive.tower_locking) in clip_pretrain.py: the saved model against the recipe's
own initial weights, tensor by tensor. Under DDP (the image tower locked) and FSDP2 (its last layer unlocked)."""

import pytest
from accelerate.utils import set_seed
from transformers import CLIPModel

from launch import run_engine
from mmrecipes.contrastive.arguments import ModelArgs
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.contrastive.tower_locking import LockArgs, lock_towers

RUN = ["--max_steps", 4, "--logging_steps", 2, "--per_device_train_batch_size", 16, "--eval_split", "",
       "--zeroshot_dataset", ""]
UNLOCKED_LAST_LAYER = ("vision_model.encoder.layers.1.", "vision_model.post_layernorm.", "visual_projection.")


def changed_tensors(output_dir) -> set[str]:
    set_seed(42)  # the recipe's seed, set before it builds the model
    initial = build_contrastive(ModelArgs())[0].state_dict()
    saved = CLIPModel.from_pretrained(output_dir).state_dict()
    return {name for name, tensor in saved.items() if name != "logit_scale" and not tensor.equal(initial[name])}


@pytest.mark.launch
@pytest.mark.parametrize("config, flags, trained", [
    ("ddp.yaml", ["--lock_image"], ("text_model.", "text_projection.")),
    ("fsdp2.yaml", ["--lock_image", "--lock_image_unlocked_layers", 1],
     ("text_model.", "text_projection.", *UNLOCKED_LAST_LAYER)),
])
def test_only_the_unlocked_parameters_change(tmp_path, config, flags, trained):
    result = run_engine(config, *RUN, *flags, "--output_dir", tmp_path)
    assert result.returncode == 0, result.log[-3000:]
    assert "locked the image tower" in result.log
    names = set(CLIPModel.from_pretrained(tmp_path).state_dict()) - {"logit_scale"}
    expected = {name for name in names if name.startswith(trained)
                and not name.endswith("position_ids")}  # a buffer, never trained
    assert changed_tensors(tmp_path) == expected


def test_unlocked_layers_need_their_tower_locked_and_must_exist():
    with pytest.raises(ValueError, match="add --lock_image"):
        LockArgs(lock_image_unlocked_layers=1)
    model = build_contrastive(ModelArgs())[0]
    with pytest.raises(ValueError, match="the text tower has 2 layers"):
        lock_towers(model, LockArgs(lock_text=True, lock_text_unlocked_layers=3))
    (line,) = lock_towers(model, LockArgs(lock_text=True, lock_text_unlocked_layers=1))
    assert "trains its last 1 layer(s), final_layer_norm, text_projection" in line
    assert not any(p.requires_grad for p in model.text_model.encoder.layers[0].parameters())
    assert all(p.requires_grad for p in model.text_model.encoder.layers[1].parameters())
