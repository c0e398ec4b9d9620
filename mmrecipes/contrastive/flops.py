"""Training FLOPs of a contrastive (CLIP, SigLIP, SigLIP 2) batch, for MFU."""

from ..throughput import transformer_train_flops


class ContrastiveFlops:
    """Training FLOPs of a contrastive batch (`flops(batch)`): each caption at `text_len` tokens and
    each image at its real token count: the fixed grid (plus CLIP's class token) or, for SigLIP 2
    NaFlex, the grid the processor gave it (the batch's `spatial_shapes`; the padding to the batch's
    longest image is not useful work). Build it before `prepare` (ZeRO-3 partitioned parameters
    report numel 0)."""

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
