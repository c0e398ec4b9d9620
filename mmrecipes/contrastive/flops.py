"""Training FLOPs of a contrastive (CLIP, SigLIP, SigLIP 2, CLAP) batch, for MFU."""

from ..throughput import transformer_train_flops


class ContrastiveFlops:
    """Training FLOPs of a contrastive batch (`flops(batch)`): each caption at `text_len` tokens and
    each image at its real token count: the fixed grid (plus CLIP's class token) or, for SigLIP 2
    NaFlex, the grid the processor gave it (the batch's `spatial_shapes`; the padding to the batch's
    longest image is not useful work). Build it before `prepare` (ZeRO-3 partitioned parameters
    report numel 0)."""

    def __init__(self, model, text_len: int):
        text = model.config.text_config
        self.per_caption = transformer_train_flops(_encoder_params(model.text_model), text.num_hidden_layers,
                                                   text.hidden_size, text_len)
        self.fixed_tokens = None
        if hasattr(model, "audio_model"):  # CLAP: every clip is the same mel image
            self.per_clip = htsat_train_flops(model.audio_model.audio_encoder, model.config.audio_config)
            return
        vision = model.config.vision_config
        self.vision_params, self.vision_layers, self.vision_width = (
            _encoder_params(model.vision_model), vision.num_hidden_layers, vision.hidden_size)
        if hasattr(vision, "image_size"):
            self.fixed_tokens = ((vision.image_size // vision.patch_size) ** 2
                                 + hasattr(model.vision_model.embeddings, "class_embedding"))

    def per_image(self, tokens: int) -> float:
        return transformer_train_flops(self.vision_params, self.vision_layers, self.vision_width, tokens)

    def __call__(self, batch) -> float:
        rows = len(batch["input_ids"])
        if "input_features" in batch:
            return rows * (self.per_caption + self.per_clip)
        if "spatial_shapes" in batch:
            images = sum(self.per_image(int(tokens)) for tokens in batch["spatial_shapes"].prod(-1))
        else:
            images = rows * self.per_image(self.fixed_tokens)
        return rows * self.per_caption + images


def clip_train_flops_per_sample(model, text_len: int) -> float:
    """Training FLOPs of one image-caption pair of a fixed-size model."""
    flops = ContrastiveFlops(model, text_len)
    return flops.per_caption + flops.per_image(flops.fixed_tokens)


def htsat_train_flops(encoder, config) -> float:
    """Training FLOPs of one clip through CLAP's HTSAT (Swin) encoder: its patches of the mel image,
    then per stage 6 N per token and windowed attention (12 L h T w^2), a quarter of the tokens
    after each patch merging."""
    tokens = (config.spec_size // config.patch_stride[0]) * (config.spec_size // config.patch_stride[1])
    flops, width = 6 * _params(encoder.patch_embed) * tokens, config.patch_embeds_hidden_size
    for stage in encoder.layers:
        window = min(tokens, config.window_size ** 2)
        flops += tokens * (6 * _params(stage.blocks) + 12 * len(stage.blocks) * width * window)
        if stage.downsample is not None:
            tokens, width = tokens // 4, width * 2
            flops += 6 * _params(stage.downsample) * tokens
    return flops


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _encoder_params(tower) -> int:
    return _params(tower.encoder)
