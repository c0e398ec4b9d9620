"""Locked towers (LiT): a pretrained image or text tower kept frozen while the other trains, as open_clip's
`--lock-image` / `--lock-text` do, optionally with its last layers unlocked.

A locked tower is its transformer (`vision_model` / `text_model`) and its projection (`visual_projection` /
`text_projection`; SigLIP has none, its pooling head sits in the transformer). Unlocking N layers trains the
last N encoder layers and everything the tower runs after them (the final norm, SigLIP's pooling head, the
projection). Frozen parameters get `requires_grad=False` before `accelerator.prepare`, so the optimizer holds no
state for them, DDP reduces no gradient for them, and FSDP2 and ZeRO-3 shard them without gradients.
"""

from dataclasses import dataclass

from .config import CheckedArgs

TOWERS = {"image": ("vision_model", "visual_projection"), "text": ("text_model", "text_projection")}


@dataclass
class LockArgs(CheckedArgs):
    CHECKS = {"lock_image_unlocked_layers": "count_or_zero", "lock_text_unlocked_layers": "count_or_zero"}
    lock_image: bool = False  # freeze the image tower (LiT: a pretrained image tower, a text tower that learns)
    lock_image_unlocked_layers: int = 0  # with --lock_image: its last N layers and what follows them still train
    lock_text: bool = False  # freeze the text tower
    lock_text_unlocked_layers: int = 0  # with --lock_text: its last N layers and what follows them still train

    def __post_init__(self):
        super().__post_init__()
        for tower in TOWERS:
            if getattr(self, f"lock_{tower}_unlocked_layers") and not getattr(self, f"lock_{tower}"):
                raise ValueError(f"--lock_{tower}_unlocked_layers unlocks layers of a locked tower: add "
                                 f"--lock_{tower}, or drop it")


def lock_towers(model, args: LockArgs) -> list[str]:
    """Freeze what `args` locks; returns a log line per locked tower (what still trains in it)."""
    lines = []
    for tower, (body_name, projection_name) in TOWERS.items():
        if not getattr(args, f"lock_{tower}"):
            continue
        body, projection = getattr(model, body_name), getattr(model, projection_name, None)
        layers, unlocked = body.encoder.layers, getattr(args, f"lock_{tower}_unlocked_layers")
        if unlocked > len(layers):
            raise ValueError(f"--lock_{tower}_unlocked_layers {unlocked}: the {tower} tower has {len(layers)} layers")
        parts = [body] + ([projection] if projection is not None else [])
        for part in parts:
            part.requires_grad_(False)
        if unlocked:
            names = list(dict(body.named_children()))
            after = names[names.index("encoder") + 1:]  # the final norm, a pooling head
            for module in [*layers[-unlocked:], *(getattr(body, name) for name in after), *parts[1:]]:
                module.requires_grad_(True)
            what = f"its last {unlocked} layer(s), {', '.join(after + [projection_name] * len(parts[1:]))}"
        frozen = sum(p.numel() for part in parts for p in part.parameters() if not p.requires_grad)
        lines.append(f"locked the {tower} tower: {frozen:,} parameters frozen; "
                     f"{'trains ' + what if unlocked else 'nothing in it trains'}")
    return lines
