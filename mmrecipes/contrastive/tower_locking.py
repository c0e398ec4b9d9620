"""Locked towers (LiT): a pretrained image or text tower kept frozen while the other trains, as
open_clip's `--lock-image` / `--lock-text` do, optionally with its last layers unlocked.

A locked tower is its transformer (`vision_model` / `text_model`) and its projection
(`visual_projection` / `text_projection`; SigLIP has none, its pooling head sits in the
transformer). Unlocking N layers trains the last N encoder layers and everything the tower runs
after them (the final norm, SigLIP's pooling head, the projection). Frozen parameters get
`requires_grad=False` before `accelerator.prepare`, so the optimizer holds no state for them, DDP
reduces no gradient for them, and FSDP2 and ZeRO-3 shard them without gradients.
"""

from dataclasses import dataclass

from ..config import CheckedArgs, checked

TOWERS = {"image": ("vision_model", "visual_projection"), "text": ("text_model", "text_projection")}


@dataclass
class LockArgs(CheckedArgs):
    # freeze the image tower (LiT: a pretrained image tower, a text tower that learns)
    lock_image: bool = False
    # with --lock_image: its last N layers and what follows them still train
    lock_image_unlocked_layers: int = checked(0, "count_or_zero")
    lock_text: bool = False  # freeze the text tower
    # with --lock_text: its last N layers and what follows them still train
    lock_text_unlocked_layers: int = checked(0, "count_or_zero")

    def __post_init__(self):
        super().__post_init__()
        for tower in TOWERS:
            if getattr(self, f"lock_{tower}_unlocked_layers") and not getattr(self, f"lock_{tower}"):
                raise ValueError(f"--lock_{tower}_unlocked_layers unlocks layers of a locked tower: add "
                                 f"--lock_{tower}, or drop it")


def lock_towers(model, args: LockArgs) -> list[str]:
    """Freeze what `args` locks; returns a log line per locked tower (what still trains in it)."""
    lines = []
    for name, (body_name, projection_name) in TOWERS.items():
        if not getattr(args, f"lock_{name}"):
            continue
        body = getattr(model, body_name, None)
        if body is None:
            raise ValueError(f"--lock_{name}: this {model.config.model_type} model has no {name} tower: drop it")
        layers = getattr(body.encoder, "layers", None) or body.encoder.layer  # CLAP's RoBERTa text: layer
        unlocked = getattr(args, f"lock_{name}_unlocked_layers")
        if unlocked > len(layers):
            raise ValueError(f"--lock_{name}_unlocked_layers {unlocked}: the {name} tower has {len(layers)} layers")
        children = list(dict(body.named_children()))
        # What runs after the layers: the final norm, a pooling head, the projection (a model
        # attribute)
        after = {child: getattr(body, child) for child in children[children.index("encoder") + 1:]}
        tower = [body]
        if hasattr(model, projection_name):
            after[projection_name] = getattr(model, projection_name)
            tower.append(after[projection_name])
        for module in tower:
            module.requires_grad_(False)
        if unlocked:
            for module in [*layers[-unlocked:], *after.values()]:
                module.requires_grad_(True)
        frozen = sum(p.numel() for module in tower for p in module.parameters() if not p.requires_grad)
        trains = f"trains its last {unlocked} layer(s), {', '.join(after)}" if unlocked else "nothing in it trains"
        lines.append(f"locked the {name} tower: {frozen:,} parameters frozen; {trains}")
    return lines
