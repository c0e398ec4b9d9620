"""Training FLOPs of a model, and the MFU that samples/s implies."""

import torch

from .vlm_families import height_width

# Dense bf16 peak (no sparsity) per device; extend it for your hardware or pass --peak_tflops.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def transformer_train_flops(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """6 N FLOPs per token for the matmuls plus 12 L h T for attention (PaLM appendix B), times T tokens."""
    return seq_len * (6 * num_params + 12 * num_layers * hidden_size * seq_len)


class ContrastiveFlops:
    """Training FLOPs of a contrastive batch (`flops(batch)`): each caption at `text_len` tokens and each image at its
    real token count: the fixed grid (plus CLIP's class token) or, for SigLIP 2 NaFlex, the grid the processor gave
    it (the batch's `spatial_shapes`; the padding to the batch's longest image is not useful work). Build it before
    `prepare` (ZeRO-3 partitioned parameters report numel 0)."""

    def __init__(self, model, text_len: int):
        vision, text = model.config.vision_config, model.config.text_config
        self.vision_params, self.vision_layers, self.vision_width = (
            _encoder_params(model.vision_model), vision.num_hidden_layers, vision.hidden_size)
        self.per_caption = transformer_train_flops(_encoder_params(model.text_model), text.num_hidden_layers,
                                                   text.hidden_size, text_len)
        self.fixed_tokens = None
        if hasattr(vision, "image_size"):
            self.fixed_tokens = ((vision.image_size // vision.patch_size) ** 2
                                 + hasattr(model.vision_model.embeddings, "class_embedding"))

    def per_image(self, tokens: int) -> float:
        return transformer_train_flops(self.vision_params, self.vision_layers, self.vision_width, tokens)

    def __call__(self, batch) -> float:
        rows = len(batch["input_ids"])
        if "spatial_shapes" in batch:
            images = sum(self.per_image(int(tokens)) for tokens in batch["spatial_shapes"].prod(-1))
        else:
            images = rows * self.per_image(self.fixed_tokens)
        return rows * self.per_caption + images


def clip_train_flops_per_sample(model, text_len: int) -> float:
    """Training FLOPs of one image-caption pair of a fixed-size model."""
    flops = ContrastiveFlops(model, text_len)
    return flops.per_caption + flops.per_image(flops.fixed_tokens)


def _encoder_params(tower) -> int:
    return sum(p.numel() for p in tower.encoder.parameters())


def peak_flops(peak_tflops: float | None = None) -> float | None:
    """Per-device peak FLOP/s: the given value, a known GPU's bf16 peak, or None (MFU not reported)."""
    if peak_tflops:
        return peak_tflops * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


class VLMFlops:
    """Training FLOPs of an image-text-to-text batch (`flops(batch)`): its tokens (padding left out) and the patches
    its images and clips embed (`image_patches`; the dummy image of a text-only batch is not counted).

    LM: 6 N per token when its weights train, 4 N when they are frozen (LoRA, the projector preset: the backward
    still runs through the LM for the input gradients, but computes no weight gradients), plus attention at
    `seq_len`. Vision tower: 6 N per patch when it trains, 2 N (forward only) when frozen. Build it before
    `prepare` (ZeRO-3 partitioned parameters report numel 0)."""

    def __init__(self, model, vision_tower_params: int, *, seq_len: int, lm_weights_train: bool, vision_trains: bool):
        text, self.vision_config = model.config.text_config, model.config.vision_config
        decoder = model.get_decoder()
        lm_params = sum(p.numel() for p in decoder.parameters()) - decoder.get_input_embeddings().weight.numel()
        lm_params += model.get_output_embeddings().weight.numel()
        self.per_token = transformer_train_flops(lm_params, text.num_hidden_layers, text.hidden_size, seq_len) / seq_len
        if not lm_weights_train:
            self.per_token -= 2 * lm_params
        self.per_patch = (6 if vision_trains else 2) * vision_tower_params

    def __call__(self, batch) -> float:
        return batch["num_tokens"] * self.per_token + image_patches(batch, self.vision_config) * self.per_patch


def image_patches(batch: dict, vision_config) -> int:
    """Patches the tower embeds for a collated batch's images (not the dummy) and clips, padding tiles included
    (a clip's patches take the same layout as an image's where the tower takes both)."""
    channels = getattr(vision_config, "in_channels", None) or getattr(vision_config, "num_channels", 3)
    temporal = getattr(vision_config, "temporal_patch_size", 1)
    height, width = height_width(vision_config.patch_size)
    pixels = [batch[key] for key in ("pixel_values", "pixel_values_videos")
              if key in batch and not (key == "pixel_values" and batch["dummy_image"])]
    return sum(value.numel() for value in pixels) // (channels * temporal * height * width)
