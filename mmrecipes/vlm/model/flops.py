"""Training FLOPs of an image-text-to-text batch, for MFU."""

from ...throughput import transformer_train_flops
from .families import height_width
from .moe import inactive_expert_params


class VLMFlops:
    """Training FLOPs of an image-text-to-text batch (`flops(batch)`): its tokens (padding left out)
    and the patches its images and clips embed (`image_patches`; the dummy image of a text-only
    batch is not counted).

    LM: 6 N per token (N: the weights a token runs; a mixture of experts' top k of E) when its
    weights train, 4 N when they are frozen (LoRA, the projector preset: the backward still runs
    through the LM for the input gradients, but computes no weight gradients), plus attention at
    `seq_len`. Vision tower: 6 N per patch when it trains, 2 N (forward only) when frozen. Build it
    before `prepare` (ZeRO-3 partitioned parameters report numel 0)."""

    def __init__(self, model, vision_tower_params: int, *, seq_len: int, lm_weights_train: bool, vision_trains: bool):
        # no vision config: a model that only hears (its audio tower is not counted, as no family's is)
        text, self.vision_config = model.config.text_config, getattr(model.config, "vision_config", None)
        decoder = model.get_decoder()
        lm_params = sum(p.numel() for p in decoder.parameters()) - decoder.get_input_embeddings().weight.numel()
        lm_params += model.get_output_embeddings().weight.numel()
        # a mixture of experts: each token runs k of its E experts
        lm_params -= inactive_expert_params(model)
        self.per_token = transformer_train_flops(lm_params, text.num_hidden_layers, text.hidden_size, seq_len) / seq_len
        if not lm_weights_train:
            self.per_token -= 2 * lm_params
        self.per_patch = (6 if vision_trains else 2) * vision_tower_params

    def __call__(self, batch) -> float:
        patches = image_patches(batch, self.vision_config) if self.vision_config is not None else 0
        return batch["num_tokens"] * self.per_token + patches * self.per_patch


def image_patches(batch: dict, vision_config) -> int:
    """Patches the tower embeds for a collated batch's images (not the dummy) and clips, padding
    tiles included (a clip's patches take the same layout as an image's where the tower takes
    both)."""
    channels = getattr(vision_config, "in_channels", None) or getattr(vision_config, "num_channels", 3)
    temporal = getattr(vision_config, "temporal_patch_size", 1)
    height, width = height_width(vision_config.patch_size)
    pixels = [batch[key] for key in ("pixel_values", "pixel_values_videos")
              if key in batch and not (key == "pixel_values" and batch["dummy_image"])]
    return sum(value.numel() for value in pixels) // (channels * temporal * height * width)
