"""The VLM recipes' arguments (model, LoRA, chat and preference data, videos, audio, DPO), each with its
value rules; no torch (`--help`)."""

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

from ..arguments import SourceArgs, TrainingArgs
from ..config import CheckedArgs, checked
from ..paths import PLAIN_CHAT_TEMPLATE, TINY_VLM_TOKENIZER, resolve_name
from ..sources import evaluation_source
from ..template_kwargs import parse_template_kwargs

TRAIN_MODULES = ("projector", "projector,language_model", "all")  # what --train_modules may name
CHAT_TEMPLATE_FILE = ("a chat template file is the Jinja text of one template, which renders `messages` (a saved "
                      "model's chat_template.jinja, or TRL's chat_templates/*.jinja)")


def read_chat_template(path: str, flag: str = "--chat_template_path") -> str:
    """The text of a chat template file, or a ValueError naming `flag` and what the file is instead:
    missing, a folder, not UTF-8 text, empty, JSON (a tokenizer_config.json), or text with no Jinja
    in it."""
    file = Path(path)
    if file.is_dir():
        inside = file / "chat_template.jinja"
        hint = f": give the file itself ({inside})" if inside.is_file() else ""
        raise ValueError(f"{flag} {path} is a folder; {CHAT_TEMPLATE_FILE}{hint}")
    try:
        data = file.read_bytes()
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror or error}; {CHAT_TEMPLATE_FILE}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag} {path} is not UTF-8 text (byte {error.start} is 0x{data[error.start]:02x}); "
                         f"{CHAT_TEMPLATE_FILE}") from None
    if "\x00" in text:
        raise ValueError(f"{flag} {path} is a binary file (it holds NUL bytes); {CHAT_TEMPLATE_FILE}")
    if not text.strip():
        raise ValueError(f"{flag} {path} is empty; {CHAT_TEMPLATE_FILE}")
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("chat_template"), str):
        raise ValueError(f"{flag} {path} is JSON (a tokenizer_config.json or chat_template.json): its "
                         f"\"chat_template\" value is the template; write that value to a .jinja file and give it. "
                         f"{CHAT_TEMPLATE_FILE[0].upper()}{CHAT_TEMPLATE_FILE[1:]}")
    if value is not None or not ("{{" in text or "{%" in text):
        raise ValueError(f"{flag} {path} holds no Jinja ({{{{ ... }}}} or {{% ... %}}); {CHAT_TEMPLATE_FILE}")
    return text


@dataclass
class VLMModelArgs(CheckedArgs):
    TINY_SHAPE: ClassVar[tuple[str, ...]] = ("tokenizer_name", "image_size", "patch_size", "vision_hidden_size",
                                             "vision_layers", "text_hidden_size", "text_layers")
    UNUSED_WITH = {"model_name_or_path": TINY_SHAPE, "vision_model_name_or_path": TINY_SHAPE}
    # A saved image-text-to-text directory or hub id (Llava, Qwen2.5-VL, Qwen3-VL, SmolVLM, Gemma 3, ...),
    # loaded with AutoModelForImageTextToText and AutoProcessor; None builds the tiny Llava below
    model_name_or_path: str | None = None
    # a .jinja file replacing the processor's chat template (TRL's name); composing, the language model's
    chat_template_path: str | None = None
    tokenizer_name: str = str(TINY_VLM_TOKENIZER)  # used only with model_name_or_path=None
    # What trains: projector (LLaVA stage 1), projector,language_model (stage 2), all (tower too, at its own lr)
    train_modules: str = checked("projector,language_model", choices=TRAIN_MODULES)
    gradient_checkpointing: bool = False
    # the attention kernel (transformers' attn_implementation): sdpa, eager, flash_attention_2, ...
    attn_implementation: str = "sdpa"
    # Ulysses sequence parallelism: each training sequence split over this many ranks after the vision merge
    # (the VLM recipes; docs/engines.md)
    sequence_parallel_size: int = checked(1, "count")
    image_size: int = checked(32, "count")
    patch_size: int = checked(8, "count")
    vision_hidden_size: int = checked(64, "count")
    vision_layers: int = checked(2, "count")
    text_hidden_size: int = checked(128, "count")
    text_layers: int = checked(2, "count")
    # Or compose a LLaVA (mmrecipes.vlm.model.compose): the vision half of a CLIP or SigLIP checkpoint
    # (clip_pretrain.py's output included) and any causal language model with its tokenizer (embedded:tiny_lm: a tiny
    # base one), joined by a fresh two-layer projector
    vision_model_name_or_path: str | None = None
    language_model_name_or_path: str | None = None
    # the tower's layer the projector reads (LLaVA's penultimate); later ones frozen
    vision_feature_layer: int = -2
    # plain: LLaVA's stage-1 format (the images, then the caption as the only target); None: the language model's own
    # (another template goes to --chat_template_path)
    chat_template: str | None = checked(None, choices=("plain",))

    def __post_init__(self):
        super().__post_init__()
        # embedded:tiny_lm (embedded:tiny_sft_vlm), as the data sources name the embedded data
        self.language_model_name_or_path = self.language_model_name_or_path and resolve_name(
            self.language_model_name_or_path)
        self.model_name_or_path = self.model_name_or_path and resolve_name(self.model_name_or_path)
        parts = (self.vision_model_name_or_path, self.language_model_name_or_path)
        if any(parts) and not all(parts):
            raise ValueError("composing a VLM takes both --vision_model_name_or_path and --language_model_name_or_path")
        if all(parts) and self.model_name_or_path:
            raise ValueError("--model_name_or_path loads a built VLM; --vision_model_name_or_path and "
                             "--language_model_name_or_path compose one: give one or the other")
        if self.chat_template_path:
            # a file that can be one, before any model loads
            read_chat_template(self.chat_template_path)
        if (self.chat_template is not None or self.vision_feature_layer != -2) and not all(parts):
            raise ValueError("--chat_template and --vision_feature_layer shape a composed VLM: give "
                             "--vision_model_name_or_path and --language_model_name_or_path (a built model's template "
                             "goes to --chat_template_path)")

    def check_with(self, parsed):
        """Under --sequence_parallel_size, what cannot run split is refused now, each with its
        reason."""
        if self.sequence_parallel_size == 1:
            return
        data, training = (next((args for cls, args in parsed.items() if issubclass(cls, kind)), None)
                          for kind in (ChatDataArgs, TrainingArgs))  # those the recipe takes
        if data is not None and data.packing:
            raise ValueError("--sequence_parallel_size with --packing: Ulysses attention is causal over the whole "
                             "gathered sequence, so packed samples would see each other; drop --packing")
        if training is not None and training.torch_compile:
            raise ValueError("--sequence_parallel_size with --torch_compile: compiling the blocks around DeepSpeed's "
                             "all-to-all fails in torch 2.14's AOT autograd ('int' object has no attribute 'meta'); "
                             "drop --torch_compile")

    def training_template(self) -> str | None:
        """The chat template the labels are made in when it is not the model's own (--chat_template
        plain: LLaVA's stage-1 format, while the composed model keeps its language model's template
        for stage 2), else None."""
        return PLAIN_CHAT_TEMPLATE.read_text() if self.chat_template == "plain" else None

    def template_source(self) -> str:
        """Where the chat template comes from, for messages about it."""
        # the labels are made in it even where the model keeps --chat_template_path's
        if self.chat_template:
            return f"the {self.chat_template} chat template"
        if self.chat_template_path:
            return self.chat_template_path
        return self.model_name_or_path or self.language_model_name_or_path or self.tokenizer_name


@dataclass
class TunedModelArgs(VLMModelArgs):
    """The model flags of the recipes that sample (GRPO, distillation), whose default model must
    answer sometimes: the tiny Llava after 60 SFT steps (data_prep/tiny_sft_vlm.py)."""

    model_name_or_path: str | None = "embedded:tiny_sft_vlm"


@dataclass
class VLMTrainingArgs(TrainingArgs):
    """The training flags of every VLM recipe: the shared ones (`TrainingArgs`), and the vision
    tower's own rates."""

    weight_decay: float = 0.0
    # the vision tower's, used when --train_modules all
    vision_tower_learning_rate: float = checked(2.0e-6, "learning_rate")
    # 0 keeps AdamW from decaying the tower on steps where it only saw a dummy image (zero gradient)
    vision_tower_weight_decay: float = checked(0.0, "non_negative")


@dataclass
class LoraArgs(CheckedArgs):
    use_peft: bool = False  # train LoRA adapters instead of the weights (TRL's flag names)
    lora_r: int = checked(16, "count")
    lora_alpha: int = checked(32, "count")
    lora_dropout: float = checked(0.05, "fraction")
    # None: every linear layer of the language model (and of the vision tower with --train_modules all);
    # all-linear (PEFT's meaning: the tower and the projector too); or comma-separated module names
    lora_target_modules: str | None = None
    # comma-separated modules trained in full, beside the projector
    lora_modules_to_save: str | None = None


@dataclass
class MoEArgs(CheckedArgs):
    # A mixture-of-experts model's load-balancing loss times this (TRL / LLaMA-Factory's name), logged as aux_loss;
    # 0: off (the log line names the checkpoint's own router_aux_loss_coef). A model without experts refuses it.
    router_aux_loss_coef: float = checked(0.0, "non_negative")
    # micro_batch: the model's own, per micro-batch; global_batch: over the optimizer step on every rank (docs/vlm.md)
    router_aux_loss_scope: str = checked("micro_batch", choices=("micro_batch", "global_batch"))


@dataclass
class VideoArgs(CheckedArgs):
    # frames sampled per second of clip (transformers' video processors: fps)
    video_fps: float = checked(2.0, "positive")
    # at most this many frames per clip (their num_frames)
    video_max_frames: int = checked(8, "count")
    # longer clips are skipped and counted (video_too_long)
    video_max_seconds: float = checked(600.0, "positive")
    # Clips whose frames have more pixels (4K UHD by default) are skipped and counted (too_large), from the header
    # before any frame is decoded: one frame of 200M pixels cost 4.5 s and 614 MB before it was resized
    video_max_pixels: int = checked(3840 * 2160, "count")


@dataclass
class AudioArgs(CheckedArgs):
    # longer audio clips are skipped and counted (audio_too_long): from the header where it says, else as soon as
    # the decoded samples pass it (a clip is never cut: Gemma 4 gives 25 placeholders a second)
    audio_max_seconds: float = checked(600.0, "positive")


@dataclass
class ChatDataArgs(SourceArgs, VideoArgs, AudioArgs):
    """Conversations: the shared data flags (`SourceArgs`), the clips' (`VideoArgs`), the sounds' (`AudioArgs`) and
    the chat pipeline's own."""

    # what auto evaluates beside embedded data
    EMBEDDED_EVAL: ClassVar[str] = "embedded:vlm_shapes/image_chat"
    dataset_name: str = "embedded:vlm_shapes/image_chat,embedded:vlm_shapes/text_chat"
    dataset_weights: str | None = "0.75,0.25"
    # Held-out conversations (answer accuracy). auto: the embedded questions beside the embedded training data;
    # with your own data, --eval_data_files read by the training builder, else none. None turns it off.
    eval_dataset_name: str | None = "auto"
    eval_split: str = "test"
    # Relative image paths resolve against it; None: against the folder of the data file each row comes from
    image_folder: str | None = None
    video_folder: str | None = None  # relative video paths resolve against it (None: as images)
    # Paths that resolve outside that folder ('../', absolute, symlinks out) are skipped and counted
    # (outside_folder) unless this is true
    allow_images_outside_folder: bool = False
    max_length: int = checked(256, "count")  # longer rows are skipped and counted, never truncated
    # Micro-batches of whole rows up to this many tokens (image tokens included) instead of a fixed row
    # count; ranks then carry different row counts (loader.TokenBudgetBatches). Rows over it count as too_long.
    # Under --sequence_parallel_size N it is what one rank holds: a micro-batch takes N times as many tokens.
    max_tokens_per_batch: int | None = checked(None, "count_or_none")
    # rows packed into sequences of up to max_length tokens, each sample attending only to itself
    packing: bool = False
    # The empty think block a reasoning template writes before an answer without reasoning (Qwen3's): context
    # keeps it out of the targets, so a thinking model tuned on plain answers keeps thinking (ms-swift's
    # ignore_empty_think); target trains it, as TRL does, and teaches the model to close its block at once
    empty_think_block: str = checked("context", choices=("context", "target"))
    # Variables every rendering of the chat template gets (TRL's name): a JSON object, or a mapping in YAML, e.g.
    # '{"enable_thinking": false}' trains and samples a hybrid template's no-think mode; a key the template never
    # reads is refused
    chat_template_kwargs: dict | str | None = None

    def __post_init__(self):
        super().__post_init__()
        self.chat_template_kwargs = parse_template_kwargs(self.chat_template_kwargs)
        self.eval_dataset_name, self.evaluation = evaluation_source(
            "eval_dataset_name", self.eval_dataset_name, self.eval_data_files, self.dataset_name, self.EMBEDDED_EVAL)


@dataclass
class PreferenceDataArgs(ChatDataArgs):
    """The SFT recipe's data flags with the embedded preference pairs as defaults."""

    EMBEDDED_EVAL: ClassVar[str] = "embedded:vlm_preferences"
    EMBEDDED_QUESTIONS: ClassVar[str] = "embedded:vlm_shapes/image_chat"
    dataset_name: str = "embedded:vlm_preferences"
    dataset_weights: str | None = None
    # Held-out pairs (reward accuracy), as --eval_dataset_name in vlm_finetune.py: auto is the embedded pairs beside
    # the embedded training pairs; with your own, --eval_data_files read by the training builder, else none
    eval_dataset_name: str | None = "auto"
    # Held-out questions (chat rows, eval_split) whose answers are scored as vlm_finetune.py does; auto as above,
    # with --eval_questions_data_files; None: not scored
    eval_questions: str | None = "auto"
    eval_questions_data_files: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self.eval_questions, questions = evaluation_source(
            "eval_questions", self.eval_questions, self.eval_questions_data_files, self.dataset_name,
            self.EMBEDDED_QUESTIONS)
        self.evaluation += f"; {questions}"
        if self.packing or self.max_tokens_per_batch:
            raise ValueError("--packing and --max_tokens_per_batch split or join rows; DPO scores each whole "
                             "sequence beside its pair: use --per_device_train_batch_size")


LOSS_TYPES = ("sigmoid", "ipo", "robust", "sft")  # the TRL 1.16 loss types this recipe computes


@dataclass
class DPOArgs(CheckedArgs):
    # how far the policy may move from the reference (TRL's name and default)
    beta: float = checked(0.1, "positive")
    # TRL 1.16's loss types, comma-separated, summed with --loss_weights: sigmoid (the DPO paper), ipo (IPO on
    # length-averaged log-probabilities), robust (Robust DPO, with --label_smoothing), sft (the chosen answer's mean
    # token NLL: RPO). sigmoid,sft lets the tiny default learn its answers from scratch; TRL's default is sigmoid.
    loss_type: str = "sigmoid,sft"
    loss_weights: str | None = None  # one per loss type, comma-separated; None: 1.0 each (TRL)
    # robust: the share of preference labels assumed flipped, below 0.5 (TRL)
    label_smoothing: float = checked(0.0, "fraction")
    # Deprecated, TRL < 1.0's name: the weight of sft in --loss_type (0 drops it). Said with its TRL 1.16 spelling.
    rpo_alpha: float | None = checked(None, "non_negative_or_none")
    # The reference's log-probabilities of every training and held-out pair computed in a first pass (repeated on a
    # resume), then the frozen copy let go: training holds one model
    precompute_ref_log_probs: bool = False

    def __post_init__(self):
        super().__post_init__()
        types = [name.strip() for name in self.loss_type.split(",") if name.strip()]
        try:
            weights = [float(weight) for weight in (self.loss_weights or ",".join(["1.0"] * len(types))).split(",")]
        except ValueError:
            weights = []
        if not types or set(types) - set(LOSS_TYPES) or len(set(types)) < len(types):
            raise ValueError(f"--loss_type {self.loss_type!r}: give one or more of {', '.join(LOSS_TYPES)}, "
                             "comma-separated, each once (TRL 1.16's names)")
        if len(weights) != len(types) or not all(math.isfinite(weight) and weight >= 0 for weight in weights):
            raise ValueError(f"--loss_weights {self.loss_weights!r}: give one finite weight, 0 or more, per "
                             f"--loss_type ({len(types)})")
        self.losses, self.deprecations = dict(zip(types, weights)), []
        if self.rpo_alpha is not None:
            self.losses.pop("sft", None)
            self.losses |= {"sft": self.rpo_alpha} if self.rpo_alpha else {}
            self.deprecations.append(f"--rpo_alpha is TRL < 1.0's name: write --loss_type {','.join(self.losses)} "
                                     f"--loss_weights {','.join(map(str, self.losses.values()))}")
        if not any(self.losses.values()):
            raise ValueError(f"--loss_type {self.loss_type} --loss_weights {self.loss_weights} "
                             f"--rpo_alpha {self.rpo_alpha}: every loss weighs 0, so nothing would train; give a "
                             "preference loss a weight above 0")
        if self.label_smoothing and ("ipo" in self.losses or not {"sigmoid", "robust"} & set(self.losses)):
            raise ValueError("--label_smoothing smooths the robust (or the deprecated smoothed sigmoid) loss: drop it "
                             "with --loss_type ipo")
        if self.label_smoothing >= 0.5 and "robust" in self.losses:
            raise ValueError(f"--label_smoothing {self.label_smoothing}: robust DPO needs it below 0.5 (TRL)")
        if self.label_smoothing and "sigmoid" in self.losses:
            self.deprecations.append("--label_smoothing with sigmoid is TRL < 1.0's conservative DPO (TRL 1.16's "
                                     "sigmoid ignores it), kept here; TRL 1.16's label-smoothed loss is --loss_type "
                                     "robust")

    def describe(self) -> str:
        terms = " + ".join(f"{weight:g} x {name}" for name, weight in self.losses.items())
        return "\n".join([f"loss: {terms} (TRL 1.16's loss types), beta {self.beta}",
                          *[f"deprecated: {line}" for line in self.deprecations]])


# TRL 1.16's names for the losses this recipe computes
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class PromptDataArgs(ChatDataArgs):
    """Prompts to sample completions for: TRL's `prompt` (string or conversation) with `images` and
    the columns the reward functions read (`solution`), or chat rows whose last assistant turn is
    the solution."""

    dataset_name: str = "embedded:vlm_shapes/image_chat,embedded:vlm_shapes/text_chat"
    # held-out questions answered by greedy decoding
    eval_generation_rows: int = checked(256, "non_negative")

    def __post_init__(self):
        super().__post_init__()
        if self.packing or self.max_tokens_per_batch:
            raise ValueError("--packing and --max_tokens_per_batch split or join rows; GRPO and distillation sample "
                             "whole completions per prompt: use --per_device_train_batch_size")


@dataclass
class SamplingArgs(CheckedArgs):
    """How completions are sampled, GRPO's and distillation's (TRL 1.16's names; defaults TRL's
    unless said)."""

    temperature: float = checked(1.0, "positive")
    top_p: float = checked(1.0, "probability")
    # a completion stops here, truncated (TRL: 512)
    max_completion_length: int = checked(8, "count")
    # ZeRO-3: gather the whole model on every rank while sampling (fast; a whole model's memory per rank). TRL's
    # default is True; here the layer-at-a-time gathers of training are kept unless asked
    ds3_gather_for_generation: bool = False


@dataclass
class GRPOArgs(SamplingArgs):
    """TRL 1.16's GRPOConfig names; defaults TRL's unless said."""

    num_generations: int = checked(8, "count")  # completions per prompt, one group
    # The clipped surrogate normalised as: grpo, each completion's token mean, averaged; dr_grpo, token sum /
    # (completions x max_completion_length); dapo and bnpo, token sum / tokens; luspo, each completion's token sum,
    # averaged. cispo: the log-probability weighted by the ratio clipped above at epsilon_high (no gradient through
    # it), sapo: a sigmoid gate of the ratio instead of the clip (sapo_temperature_pos/neg), normalised as dapo and
    # grpo. vespo: the log-probability weighted by a gamma function of the completion's ratio w, e^lambda w^k
    # e^(-lambda w) (no gradient through it; k, lambda by the advantage's sign), normalised as dapo. Each over the
    # optimizer step on every rank (TRL's bnpo: per rank).
    loss_type: str = checked("dapo", choices=GRPO_LOSS_TYPES)
    # token: a ratio per token; sequence: one per completion, its tokens' mean log-ratio (GSPO)
    importance_sampling_level: str = checked("token", choices=("token", "sequence"))
    # SAPO's gate where the advantage is positive
    sapo_temperature_pos: float = checked(1.0, "positive")
    sapo_temperature_neg: float = checked(1.05, "positive")  # and where it is not
    # VESPO's power where the advantage is not negative
    vespo_k_pos: float = checked(2.0, "non_negative")
    vespo_lambda_pos: float = checked(3.0, "non_negative")  # and its decay
    vespo_k_neg: float = checked(3.0, "non_negative")  # where it is negative
    vespo_lambda_neg: float = checked(2.0, "non_negative")
    beta: float = checked(0.0, "non_negative")  # weight of the KL to the reference (k3 estimator)
    # the KL weighted by the importance ratio, as TRL 1.16 does by default
    use_bias_correction_kl: bool = True
    # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon: float = checked(0.2, "positive")
    epsilon_high: float | None = checked(None, "non_negative_or_none")  # None: epsilon (DAPO: 0.28)
    # optimizer steps on each batch of completions, against the log-probabilities they were sampled with
    num_iterations: int = checked(1, "count")
    # the advantage divided by the std of its group's rewards, the batch's, or none
    scale_rewards: str = checked("group", choices=SCALE_REWARDS)
    mask_truncated_completions: bool = False  # completions cut at max_completion_length get no loss
    # Built-in: accuracy (exact match with the solution, numbers compared as numbers), format (--format_pattern);
    # or a user function by import path, module:function (TRL's signature), comma-separated
    reward_funcs: str = "accuracy"
    reward_weights: str | None = None  # one per reward function; None: 1.0 each
    format_pattern: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    # seconds one reward function may take to score a rank's completions of a step; then they count as failed
    reward_timeout: float = checked(300.0, "positive")
    # Multi-turn rollouts (TRL's names): functions the model may call, by import path (module:function, comma-
    # separated; type hints and a docstring, as transformers renders them), and/or an environment class
    # (module:Class: one instance per completion, reset(**row) before it, its public methods tools)
    tools: str = ""
    environment_factory: str = ""
    # None: until the completion budget
    max_tool_calling_iterations: int | None = checked(None, "count_or_none")
    # seconds a tool call may take; then it fails, counted
    tool_timeout: float = checked(60.0, "positive")

    def __post_init__(self):
        super().__post_init__()
        if self.num_generations < 2:
            raise ValueError("--num_generations 1: a group of one completion has no spread to learn from; give 2 or "
                             "more")
        self.funcs = [name.strip() for name in self.reward_funcs.split(",") if name.strip()]
        try:
            weights = [float(w) for w in (self.reward_weights or ",".join(["1.0"] * len(self.funcs))).split(",")
                       if w.strip()]
        except ValueError:
            weights = None
        # none: only where an environment may score the completions itself (its get_reward, checked when loaded)
        if (not self.funcs and not self.environment_factory) or weights is None or len(weights) != len(self.funcs) \
                or not all(map(math.isfinite, weights)):
            raise ValueError(f"--reward_weights {self.reward_weights!r}: give one finite weight per --reward_funcs "
                             f"({len(self.funcs)})")
        self.weights = weights
        self.epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        defaults = {field.name: field.default for field in fields(self)}
        given = [f"--{name}" for name in ("max_tool_calling_iterations", "tool_timeout")
                 if getattr(self, name) != defaults[name]]
        if given and not self.tools and not self.environment_factory:
            raise ValueError(f"{' and '.join(given)} without --tools or --environment_factory: there is no tool to "
                             "limit; give the tools, or leave the flag out")

    def check_with(self, parsed):
        max_length = self.other(parsed, PromptDataArgs).max_length
        if self.max_completion_length >= max_length:
            raise ValueError(f"--max_completion_length {self.max_completion_length} leaves no room for a prompt within "
                             f"--max_length {max_length}: raise --max_length")
        save_steps = self.other(parsed, TrainingArgs).save_steps
        # a checkpoint keeps no completions: its resume would sample new ones
        if save_steps % self.num_iterations:
            raise ValueError(f"--save_steps {save_steps}: a multiple of --num_iterations {self.num_iterations}, so "
                             "that every checkpoint falls between two batches of completions")


@dataclass
class DistillArgs(SamplingArgs):
    """On-policy distillation (GKD, Agarwal et al. 2024), TRL's names: beta, temperature and
    max_completion_length as in its DistillationConfig, lmbda and seq_kd as in its GKD trainer."""

    # The frozen teacher: an image-text-to-text checkpoint of the student's vocabulary and processor
    # (embedded:tiny_teacher_vlm: a wider tiny Llava fine-tuned on the embedded conversations,
    # data_prep/)
    teacher_model_name_or_path: str = "embedded:tiny_teacher_vlm"
    # the generalised JSD: 0 the forward KL(teacher || student), 1 the reverse KL (TRL's default),
    # between them the JSD
    beta: float = checked(1.0, "share")
    # the share of steps trained on the student's own samples (on-policy); the others on the
    # dataset's answers
    lmbda: float = checked(0.5, "share")
    # the off-policy steps on the teacher's samples instead of the dataset's answers
    seq_kd: bool = False
    # of the sampling and of both distributions in the divergence
    temperature: float = checked(1.0, "positive")
    # ZeRO-3: gather the whole student on every rank while it samples (as GRPO's flag; the teacher
    # samples layer by layer)
    ds3_gather_for_generation: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.teacher_model_name_or_path = resolve_name(self.teacher_model_name_or_path)
