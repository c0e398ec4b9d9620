"""Vision tower, projector and language model of any image-text-to-text family, found from one dummy
backward; the audio tower too, from a second, where the model hears."""

from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import torch

from .audio_rows import audio_step
from .families import PROJECTORS, audio_inputs, lm_features, vision_inputs


@dataclass
class ModuleGroups:
    """The model's parameters by part, found by `module_groups`: (name, parameter) pairs."""

    vision_tower: list = field(default_factory=list)
    projector: list = field(default_factory=list)
    language_model: list = field(default_factory=list)
    audio_tower: list = field(default_factory=list)  # a model that hears (its projector: in `projector`)
    # names: trainable parameters no forward path reaches
    unreached: list = field(default_factory=list)
    projector_by: str = "rule"  # or "table" (PROJECTORS)

    def items(self):
        return [("vision_tower", self.vision_tower), ("projector", self.projector),
                ("language_model", self.language_model)] + ([("audio_tower", self.audio_tower)] if self.audio_tower
                                                            else [])

    def describe(self) -> str:
        parts = []
        for name, params in self.items():
            modules = ", ".join(covering_modules([n for n, _ in params], self._all_names())) or "-"
            parts.append(f"{name} {sum(p.numel() for _, p in params):,} params ({modules})")
        return f"module groups: {'; '.join(parts)} [projector by {self.projector_by}]"

    def _all_names(self):
        return {n: group for group, params in self.items() for n, _ in params}


def module_groups(model, dummy_inputs: dict) -> ModuleGroups:
    """Vision tower, projector and language model of any family, from one dummy backward (before
    `prepare`).

    - language model: `get_decoder()` plus the output embeddings;
    - vision step: the parameters that one backward of the dummy's `lm_features` reaches. Trainable
      parameters of neither (CLIP's `post_layernorm`, which only feeds a pooled output Llava
      discards; the tower's last layer at LLaVA's `vision_feature_layer=-2`) never get a gradient,
      so DDP would wait for them forever: they are listed in `unreached` for the caller to freeze;
    - projector: the part of the vision step that feeds the language model. The tower is the largest
      module holding the vision encoder's blocks (`_no_split_modules`) and nothing of the language
      model; the projector is every vision parameter outside it (Llava's `multi_modal_projector`,
      Idefics3's `connector`, LLaVA-OneVision's `image_newline`), plus the tower's direct
      sub-modules that hold no block and output the language model's width (Qwen's
      `visual.merger`, Qwen3-VL's deepstack mergers). Where the tower is as wide as the language
      model that width says nothing, and `PROJECTORS` decides by model type;
    - audio tower (a model that hears: `families.audio_inputs`): the parameters one backward of the
      dummy sound's features reaches inside the largest module holding the audio encoder's blocks and
      nothing of the language model; what that backward reaches outside it (Gemma 4's `embed_audio`)
      is projector, else the tower's own last layer to the language model's width (Qwen2.5-Omni's
      `audio_tower.proj`), found as Qwen's `visual.merger` is.
    """
    language_model = {id(p) for p in [*model.get_decoder().parameters(), *model.get_output_embeddings().parameters()]}
    not_image = {"pixel_values_videos", *audio_inputs(model)}
    image_inputs = {name: value for name, value in dummy_inputs.items() if name not in not_image}
    modules = dict(model.named_modules())
    reached, towers, projector_prefixes, projector_by = set(), set(), [], "rule"  # a model that only hears
    if vision_inputs(model):
        widths, reached = _step_of(model, model.get_image_features, image_inputs)
        vision_blocks, towers = _vision_towers(model, modules, widths, language_model)
        projector_prefixes, projector_by = _projector_prefixes(model, modules, widths, vision_blocks, towers)
    audio_towers, audio_projectors, heard = _audio_towers(model, modules, dummy_inputs, language_model)
    groups = ModuleGroups(projector_by=projector_by)
    for name, param in model.named_parameters():
        if id(param) in language_model:
            groups.language_model.append((name, param))
            continue
        in_audio_tower = any(name.startswith(tower + ".") for tower in audio_towers)
        if id(param) in heard or in_audio_tower:
            if param.requires_grad and id(param) not in heard:  # Qwen2.5-Omni's audio_bos_eos_token
                groups.unreached.append(name)
            in_projector = not in_audio_tower or any(name.startswith(prefix + ".") for prefix in audio_projectors)
            (groups.projector if in_projector else groups.audio_tower).append((name, param))
            continue
        if param.requires_grad and id(param) not in reached:
            groups.unreached.append(name)
        in_tower = any(name.startswith(tower + ".") for tower in towers)
        if any(name == prefix or name.startswith(prefix + ".") for prefix in projector_prefixes) or (
                projector_by == "rule" and not in_tower):
            groups.projector.append((name, param))
        else:
            groups.vision_tower.append((name, param))
    return groups


def _audio_towers(model, modules: dict, dummy_inputs: dict, language_model: set) -> tuple[set[str], list[str], set]:
    """(the audio towers, their projector modules inside them, the ids of the parameters the dummy sound's backward
    reaches outside the language model), or (set(), [], set()) for a model that does not hear. The projector inside
    a tower is found as the vision tower's (`_inner_projectors`: the Qwen2.5-Omni tower's `proj`), where nothing
    outside the towers feeds the language model (Gemma 4's `embed_audio` does)."""
    names = [name for name in audio_inputs(model) if name in dummy_inputs]
    if not names:
        return set(), [], set()
    widths, reached = _step_of(model, audio_step(model.base_model),
                               {name: dummy_inputs[name] for name in names})
    blocks, towers = _vision_towers(model, modules, widths, language_model)
    heard = reached - language_model
    inside = {id(p) for tower in towers for p in modules[tower].parameters()}
    lm_width = model.get_input_embeddings().embedding_dim
    projectors = _inner_projectors(modules, widths, blocks, towers, lm_width) if heard <= inside else []
    return towers, projectors, heard


def _step_of(model, encode, inputs: dict) -> tuple[dict, set]:
    """One forward and backward of `encode(**inputs)`'s `lm_features` (the dummy image's, or sound's): (the output
    width of each module it calls, the ids of the parameters its backward reaches)."""
    widths = {}

    def record(name, module, args, output):
        widths.setdefault(name, _width(output))

    handles = [module.register_forward_hook(partial(record, name)) for name, module in model.named_modules()]
    try:
        features = lm_features(encode(**inputs, return_dict=True))
    finally:
        for handle in handles:
            handle.remove()
    torch.cat([feature.flatten() for feature in features]).sum().backward()
    reached = {id(p) for p in model.parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return widths, reached


def _vision_towers(model, modules: dict, widths: dict, language_model: set) -> tuple[list[str], set[str]]:
    """(the encoder blocks the vision step called that hold nothing of the language model, the
    towers: the largest modules holding them and nothing of the language model)."""
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    called_blocks = [name for name in widths if type(modules[name]).__name__ in blocks and name]
    vision_blocks = [name for name in called_blocks
                     if not any(id(p) in language_model for p in modules[name].parameters())]
    return vision_blocks, {_highest_vision_ancestor(name, modules, language_model) for name in vision_blocks}


def _projector_prefixes(model, modules: dict, widths: dict, vision_blocks: list[str], towers: set[str]):
    """(the module paths of the projector inside the towers, "rule"), or, where the towers' widths
    cannot tell (a tower as wide as the language model) or no tower was found, (PROJECTORS' entry
    for the model type, "table")."""
    lm_width = model.get_input_embeddings().embedding_dim
    if any(widths[name] == lm_width for name in vision_blocks) or not towers:
        prefixes = list(PROJECTORS.get(model.config.model_type, ()))
        if not prefixes:
            raise ValueError(
                f"Cannot tell the projector of model type {model.config.model_type!r} from its vision tower "
                f"(the tower is as wide as the language model, {lm_width}): add its projector modules to "
                "PROJECTORS in mmrecipes/vlm/model/families.py")
        return prefixes, "table"
    return _inner_projectors(modules, widths, vision_blocks, towers, lm_width), "rule"


def _inner_projectors(modules: dict, widths: dict, blocks: list[str], towers: set[str], lm_width: int) -> list[str]:
    """The towers' direct sub-modules (a ModuleList's items too) that hold no encoder block, have parameters and
    output the language model's width."""
    prefixes = []
    for tower in towers:
        for child, module in modules[tower].named_children():
            inner = [f"{tower}.{child}"] + ([f"{tower}.{child}.{i}" for i, _ in module.named_children()]
                                            if isinstance(module, torch.nn.ModuleList) else [])
            for name in inner:
                holds_block = any(b == name or b.startswith(name + ".") for b in blocks)
                has_parameters = any(True for _ in modules[name].parameters())
                if not holds_block and widths.get(name) == lm_width and has_parameters:
                    prefixes.append(name)
    return prefixes


def _width(output):
    """Last dimension of a module's (first) output tensor, or None."""
    while isinstance(output, (tuple, list)) and output:
        output = output[0]
    if hasattr(output, "last_hidden_state"):
        output = output.last_hidden_state
    return output.shape[-1] if isinstance(output, torch.Tensor) and output.ndim else None


def _highest_vision_ancestor(name, modules, language_model):
    """The largest module above `name` that holds no language-model parameter."""
    parts = name.split(".")
    best = name
    for end in range(len(parts) - 1, 0, -1):
        ancestor = ".".join(parts[:end])
        if any(id(p) in language_model for p in modules[ancestor].parameters()):
            break
        best = ancestor
    return best


def covering_modules(names, all_names):
    """The fewest module paths whose parameters are exactly `names` (for the log line)."""
    names, total, inside = set(names), Counter(), Counter()
    for name in all_names:
        parts = name.split(".")
        for end in range(1, len(parts)):
            prefix = ".".join(parts[:end])
            total[prefix] += 1
            inside[prefix] += name in names
    covered = {}
    for name in sorted(names):
        parts, best = name.split("."), name
        for end in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:end])
            if inside[prefix] != total[prefix]:
                break
            best = prefix
        covered[best] = None
    return list(covered)


def apply_train_modules(groups: ModuleGroups, train_modules: str) -> dict[str, list[torch.nn.Parameter]]:
    """Freeze what `train_modules` does not name, and every unreached parameter; returns the
    trainable parameters by group (vision_tower, projector, language_model, audio_tower: the towers with `all`).

    Frozen parameters get `requires_grad=False` before `accelerator.prepare`, so DDP needs no
    `find_unused_parameters`, FSDP2 and ZeRO-3 skip their gradients, and the optimizer (built
    from the returned groups) holds no state for them.
    """
    names = {"projector"} | ({"language_model"} if "language_model" in train_modules else set())
    if train_modules == "all":
        names = {"projector", "language_model", "vision_tower", "audio_tower"}
    unreached = set(groups.unreached)
    trainable = {}
    for name, params in groups.items():
        for param_name, param in params:
            param.requires_grad_(name in names and param_name not in unreached)
        if name in names:
            trainable[name] = [param for param_name, param in params if param_name not in unreached]
    return trainable
