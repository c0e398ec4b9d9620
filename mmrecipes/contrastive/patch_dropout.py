"""FLIP's patch dropout (open_clip's `patch_dropout` / `--force-patch-dropout`): in training, each
image's vision tower sees a random share of its patch tokens, which makes a step cheaper by about
that share.

A forward hook on the tower's embeddings (their output already holds the position embeddings) keeps
a random `1 - p` of each image's patch tokens, at least one, and the class token where the tower has
one (CLIP pools it; SigLIP has none and pools all tokens with its attention head). Evaluation
(`model.eval()`) sees every patch, and the saved model carries no hook.
"""

import inspect

import torch


class PatchDropout:
    def __init__(self, p: float, has_class_token: bool):
        self.p, self.has_class_token = p, has_class_token

    def __call__(self, module, inputs, tokens):
        if not module.training:
            return tokens
        first = 1 if self.has_class_token else 0
        patches = tokens[:, first:]
        count = patches.shape[1]
        keep = max(1, int(count * (1 - self.p)))
        kept = torch.rand(tokens.shape[0], count, device=tokens.device).topk(keep, dim=1).indices.sort(dim=1).values
        patches = patches.gather(1, kept[..., None].expand(-1, -1, patches.shape[-1]))
        return torch.cat([tokens[:, :first], patches], dim=1)


def add_patch_dropout(model, p: float) -> str:
    """Hook patch dropout `p` (0 < p < 1) onto a CLIP or SigLIP model's vision embeddings; returns
    the log line."""
    if not hasattr(model, "vision_model"):
        raise ValueError(f"--patch_dropout drops image patches; this {model.config.model_type} model has no image "
                         "tower: drop it")
    embeddings = model.vision_model.embeddings
    if "spatial_shapes" in inspect.signature(embeddings.forward).parameters:
        raise ValueError("--patch_dropout keeps a share of a fixed grid's tokens; SigLIP 2 NaFlex pads each image's "
                         "own grid (pixel_attention_mask), which it would misalign: drop --patch_dropout")
    has_class_token = hasattr(embeddings, "class_embedding")
    embeddings.register_forward_hook(PatchDropout(p, has_class_token))
    kept = "the class token and " if has_class_token else ""
    return f"patch dropout {p}: training keeps {kept}a random {1 - p:.0%} of each image's patches"
