"""What a VLM recipe trains, in one call before `Accelerator()`: the model and its processor (linear
attention's mixers made segment-aware for packing: `segments`), the stop and placeholder ids, the
dummy image, the module groups and what of them trains (the freezing preset, or LoRA), the engine's
input gradients and ZeRO-3 leaf modules (a mixture of experts' sparse blocks), the FLOPs per batch;
and the log lines that say so; `load_vlm`: a saved checkpoint (`loading`), a Llava composed from
parts (`compose`) or the tiny Llava. The recipe keeps the Accelerate skeleton."""

import copy
import logging
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

from ...images import to_device
from ...training import optimizer_groups
from ..arguments import LoraArgs, VLMModelArgs, VLMTrainingArgs, read_chat_template
from ..rows.collate import ChatCollator, probe_rows
from .audio_rows import AudioRows
from .compose import compose_llava, replaced_template
from .families import audio_inputs, dummy_image_inputs, placeholder_token_ids, stateful_mixers
from .flops import VLMFlops
from .loading import load_pretrained, set_attention, stop_token_ids, thinker_note
from .lora import add_lora, describe_trainable, dropout_note
from .module_groups import ModuleGroups, apply_train_modules, module_groups
from .moe import sparse_block_classes
from .outputs import Logits
from .segments import SegmentAwareMixers, apply_segment_aware_mixers
from .step import VLMForTraining

logger = logging.getLogger(__name__)


@dataclass
class VLMParts:
    model: torch.nn.Module  # the AutoModelForImageTextToText (LoRA adapters injected into it)
    processor: object
    stops: list[int]  # the tokens that end an assistant turn
    placeholders: list[int]  # image and video placeholder ids: never sampled nor decoded
    dummy_inputs: dict  # the dummy image a text-only batch carries
    groups: ModuleGroups
    trainable: dict[str, list[torch.nn.Parameter]]  # by group
    # with LoRA: the PeftModel describing the adapters (their switch, their config)
    peft_model: object = None
    flops: VLMFlops | None = None  # a batch's training FLOPs (MFU)
    # a reference's starting weights, copied before `prepare`
    frozen_copy: VLMForTraining | None = None
    # a mixture of experts' router-and-experts classes: ZeRO-3 leaf modules
    sparse_blocks: tuple[str, ...] = ()
    # what the run does otherwise than its flags say, and why (describe)
    notes: tuple[str, ...] = ()
    # linear attention's mixers, made to keep packed samples apart (None: the model has none)
    segments: SegmentAwareMixers | None = None
    # the longest clip (s) its audio tower reads (None: any length; `AudioRows.window_seconds`)
    audio_window: float | None = None

    @property
    def hears(self) -> bool:
        """The model trains on audio rows (`families.audio_inputs`: an audio tower, a feature extractor)."""
        return bool(audio_inputs(self.model, self.processor))

    @property
    def peft_config(self):
        return self.peft_model.peft_config["default"] if self.peft_model is not None else None

    def optimizer_groups(self, args: VLMTrainingArgs) -> list[dict]:
        """AdamW groups of the trainable parameters (frozen ones hold no state); the tower, if it
        trains, at its own lr and weight decay (--vision_tower_learning_rate,
        --vision_tower_weight_decay)."""
        return optimizer_groups(self.trainable, learning_rate=args.learning_rate, weight_decay=args.weight_decay,
                                own_rates={"vision_tower": (args.vision_tower_learning_rate,
                                                            args.vision_tower_weight_decay)})

    def clip_seconds(self, asked: float) -> float:
        """--audio_max_seconds (`asked`) at most `audio_window`, said in the log where it is lowered: a longer clip is
        counted audio_too_long, never cut."""
        if self.audio_window is None or asked <= self.audio_window:
            return asked
        logger.warning("%s's audio tower reads clips of at most %g s (its feature extractor's window): "
                       "--audio_max_seconds %g lowered to %g, longer clips are counted audio_too_long",
                       type(self.model).__name__, self.audio_window, asked, self.audio_window)
        return self.audio_window

    def check_packing(self, labeller):
        """`check_packing` of this model (--packing), before the first step."""
        check_packing(self.model, labeller, self.dummy_inputs)

    def describe(self) -> str:
        lines = [self.groups.describe(), describe_trainable(self.model)]
        if self.sparse_blocks:
            lines.append(f"sparse blocks {', '.join(self.sparse_blocks)}: each a ZeRO-3 leaf module (gathered as one, "
                         "whichever experts a rank's tokens pick); a load-balancing loss only in vlm_finetune.py "
                         "(--router_aux_loss_coef): vlm_dpo.py and vlm_grpo.py add none")
        lines += list(self.notes)
        if self.segments is not None:
            lines.append(self.segments.describe())
        if self.groups.unreached:
            lines.append(f"froze {len(self.groups.unreached)} parameters no forward path reaches: "
                         + ", ".join(self.groups.unreached))
        return "\n".join(lines)


@torch.no_grad()
def check_packing(model, labeller, dummy_inputs):
    """Raise unless an image conversation and a text one, packed into one sequence, give the logits
    each gives alone (the model keeps packed samples apart), naming the layers that carry a state
    from one sample into the next."""
    rows, step, training = probe_rows(labeller), VLMForTraining(model), model.training
    model.eval()
    try:
        packed = step(to_device(ChatCollator(0, dummy_inputs, packing=True)(rows), "cpu"), Logits())
        alone = torch.cat([step(to_device(ChatCollator(0, dummy_inputs)([row]), "cpu"), Logits()) for row in rows],
                          dim=1)
    finally:
        model.train(training)
    if not torch.allclose(packed, alone, rtol=1e-4, atol=1e-4):
        mixers = stateful_mixers(model)
        why = (f"; its {' and '.join(mixers)} carry their state from one sample into the next: they do not pass each "
               "token's segment (seq_idx) on to their mixers") if mixers else ""
        raise ValueError(f"--packing: {type(model).__name__} does not keep packed samples apart (its logits differ by "
                         f"{(packed - alone).abs().max().item():.3g} from the samples run alone{why}): drop "
                         "--packing, or keep --max_tokens_per_batch without it")


def vlm_parts(model_args: VLMModelArgs, lora_args: LoraArgs, *, seq_len: int, frozen_copy: bool = False) -> VLMParts:
    """Load the model (`load_vlm`), find its groups from one dummy backward, freeze what
    --train_modules leaves out and every parameter no forward path reaches (DDP would wait for their
    gradients), add LoRA adapters where asked (everything but them and the projector frozen), and
    count the FLOPs now (after `prepare` ZeRO-3's parameters report numel 0). `frozen_copy`: keep a
    frozen copy of the starting weights for a reference model without LoRA
    (`reference.Reference.build` shards it like the policy after `prepare`). Call it before
    `Accelerator()`: under ZeRO-3 a model built afterwards is partitioned and re-initialised."""
    model, processor = load_vlm(model_args)
    segments = apply_segment_aware_mixers(model)  # process-wide, in transformers' modules: listed in describe
    dummy_inputs = dummy_image_inputs(model, processor)
    window = None
    if hears := audio_inputs(model, processor):
        audio = AudioRows(model, hears)
        audio.check_family(dummy_inputs)
        window = audio.window_seconds(processor)
    groups = module_groups(model, dummy_inputs)
    trainable = apply_train_modules(groups, model_args.train_modules)
    peft_model, notes = None, [thinker_note(model_args.model_name_or_path, model)]
    if lora_args.use_peft:  # adapters injected into `model` itself
        peft_model, trainable = add_lora(model, groups, model_args.train_modules, lora_args)
        notes.append(dropout_note(peft_model.peft_config["default"], lora_args))
    # ranks route to different experts: gather each block whole
    if blocks := sparse_block_classes(model):
        # here: seconds to import, for MoE models only
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, sorted(blocks, key=lambda block: block.__name__))
    if model_args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if not model.get_input_embeddings().weight.requires_grad:
        # A frozen embedding (LoRA, the projector preset) gives a text-only batch an LM input without grad: its
        # backward would skip the LM where an image batch's runs through it, so ZeRO-3 and FSDP2 ranks would
        # gather different parameters (and checkpointed layers would get no gradients).
        model.enable_input_require_grads()
    flops = VLMFlops(model, sum(p.numel() for _, p in groups.vision_tower), seq_len=seq_len,
                     lm_weights_train="language_model" in trainable and peft_model is None,
                     vision_trains="vision_tower" in trainable)
    copied = None
    # with LoRA the reference is the policy, its adapters disabled
    if frozen_copy and peft_model is None:
        copied = copy.deepcopy(VLMForTraining(model)).requires_grad_(False).eval()
    return VLMParts(model=model, processor=processor, stops=stop_token_ids(model, processor),
                    placeholders=placeholder_token_ids(model, processor), dummy_inputs=dummy_inputs, groups=groups,
                    trainable=trainable, peft_model=peft_model, flops=flops, frozen_copy=copied,
                    sparse_blocks=tuple(sorted(block.__name__ for block in blocks)), notes=tuple(filter(None, notes)),
                    segments=segments, audio_window=window)


def load_vlm(args: VLMModelArgs):
    """(model, processor): any `AutoModelForImageTextToText` checkpoint, a Llava composed from a
    vision tower and a language model (`mmrecipes.vlm.model.compose`), or the tiny Llava built from
    a config.

    A family the recipe cannot train is rejected from its config, before any weight is read.
    Build it *before* `Accelerator()` (under ZeRO-3 a model built afterwards is partitioned and
    re-initialised, as for CLIP).
    """
    if args.vision_model_name_or_path:
        model, processor = compose_llava(args.vision_model_name_or_path, args.language_model_name_or_path,
                                         vision_feature_layer=args.vision_feature_layer,
                                         chat_template=args.chat_template, chat_template_path=args.chat_template_path)
    elif args.model_name_or_path:
        model, processor = load_pretrained(args.model_name_or_path)
    else:
        model, processor = _tiny_llava(args)
    # compose_llava took it as the LM's
    if args.chat_template_path and not args.vision_model_name_or_path:
        template = read_chat_template(args.chat_template_path)
        processor.chat_template = replaced_template(processor.chat_template, template)
    set_attention(model, args.attn_implementation)
    return model, processor


def _tiny_llava(args: VLMModelArgs):
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    image_token_id = tokenizer.convert_tokens_to_ids(tokenizer.image_token)
    vision = dict(model_type="clip_vision_model", hidden_size=args.vision_hidden_size,
                  intermediate_size=4 * args.vision_hidden_size, num_hidden_layers=args.vision_layers,
                  num_attention_heads=max(1, args.vision_hidden_size // 32), image_size=args.image_size,
                  patch_size=args.patch_size)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=args.text_hidden_size,
                intermediate_size=4 * args.text_hidden_size, num_hidden_layers=args.text_layers,
                num_attention_heads=max(1, args.text_hidden_size // 32),
                max_position_embeddings=tokenizer.model_max_length,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_token_id,
        # The last layer (not LLaVA's -2): a -2 layer here would leave the tower's last layer
        # unused.
        vision_feature_layer=-1, vision_feature_select_strategy="default",
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    image_processor = CLIPImageProcessor(size={"shortest_edge": args.image_size},
                                         crop_size={"height": args.image_size, "width": args.image_size})
    # What AutoProcessor and the image-text-to-text pipeline need of the saved directory:
    # patch_size, CLIP's one extra (CLS) token, the model's feature select strategy, the image token
    # (else "Image features and image tokens do not match").
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=args.patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               image_token=tokenizer.image_token, chat_template=tokenizer.chat_template)
    return model, processor
