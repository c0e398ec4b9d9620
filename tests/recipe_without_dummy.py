"""vlm_finetune.py as most public trainers run it: a text-only batch skips the vision tower.

    accelerate launch --config_file ... tests/recipe_without_dummy.py [recipe args]

The tests launch this to show that their mixed-modality scenario really fails without the dummy
image (so the passing runs prove something).
"""

import runpy
from pathlib import Path

from mmrecipes.losses import token_cross_entropy_sum
from mmrecipes.vlm import VLMForTraining

with_dummy = VLMForTraining.forward


def forward_skipping_the_tower(self, input_ids, attention_mask, labels, dummy_image, **image_inputs):
    if dummy_image:
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return token_cross_entropy_sum(logits, labels), logits
    return with_dummy(self, input_ids, attention_mask, labels, dummy_image, **image_inputs)


VLMForTraining.forward = forward_skipping_the_tower
runpy.run_path(str(Path(__file__).resolve().parents[1] / "recipes" / "vlm_finetune.py"), run_name="__main__")
