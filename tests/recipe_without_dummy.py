"""vlm_finetune.py as most public trainers run it: a text-only batch skips the vision tower.

    accelerate launch --config_file ... tests/recipe_without_dummy.py [recipe args]

The tests run this to show that their mixed-modality scenarios really fail without the dummy
image (so the passing runs prove something).
"""

import runpy
from pathlib import Path

from mmrecipes.vlm.model.losses import token_cross_entropy_sum
from mmrecipes.vlm.model.outputs import CrossEntropy, Logits, LossSum
from mmrecipes.vlm.model.step import VLMForTraining

with_dummy = VLMForTraining.forward


def skip_tower_on_text_only(self, batch, output):
    if not batch["dummy_image"]:
        return with_dummy(self, batch, output)
    text_inputs = {name: value for name, value in batch.items()
                   if name in self.forward_input_names - self.vision_input_names - {"labels"}}
    logits = self.model(**text_inputs).logits
    if isinstance(output, Logits):
        return logits
    summed = token_cross_entropy_sum(logits, batch["labels"])
    return CrossEntropy(summed) if isinstance(output, LossSum) else summed


class SkipsTowerOnTextOnly(VLMForTraining):
    forward = skip_tower_on_text_only


if __name__ == "__main__":
    VLMForTraining.forward = skip_tower_on_text_only
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "recipes" / "vlm_finetune.py"), run_name="__main__")
