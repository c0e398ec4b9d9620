"""The recipes' arguments: one small dataclass per component, each with its value rules (`CheckedArgs`).

Flags and YAML keys are these fields (`mmrecipes.config.parse_args`); their comments are the `--help` text. This
module imports neither torch nor transformers' models, so a recipe parses its flags, `--help` included, before it
loads them (under a second, where every import took 4-5 s here and 38-58 s on a cold disk). The components keep
their code in their own modules (`mmrecipes.training`, `mmrecipes.chat_data`, ...), which import their arguments
from here.
"""

import math
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .config import CheckedArgs
from .paths import TINY_VLM_TOKENIZER, resolve_name
from .sources import evaluation_source, source_weights, split_sources


@dataclass
class TrainingArgs(CheckedArgs):
    """Arguments every recipe shares; a recipe subclasses it to add its own and change defaults."""

    CHECKS = {**dict.fromkeys(("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
                               "per_device_eval_batch_size", "eval_steps", "logging_steps", "ddp_timeout"), "count"),
              **dict.fromkeys(("global_batch_size", "save_total_limit"), "count_or_none"),
              **dict.fromkeys(("warmup_steps", "save_steps", "max_skipped_steps"), "count_or_zero"),
              "learning_rate": "learning_rate", "weight_decay": "non_negative", "max_grad_norm": "non_negative_or_none",
              "peak_tflops": "positive_or_none", "adam_beta1": "fraction", "adam_beta2": "fraction",
              "adam_epsilon": "positive"}

    output_dir: str = "outputs/run"
    max_steps: int = 300  # optimizer steps
    per_device_train_batch_size: int = 64
    global_batch_size: int | None = None  # if set: per-device batch = global / (data ranks * accumulation)
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2.0e-3
    weight_decay: float = 0.1
    adam_beta1: float = 0.9  # AdamW's betas and eps (HF TrainingArguments' names; open_clip's ViTs: 0.98, 1e-6)
    adam_beta2: float = 0.999
    adam_epsilon: float = 1.0e-8
    warmup_steps: int = 20
    lr_scheduler_type: str = "cosine"  # any of transformers' get_scheduler types the loop can step
    # JSON of the scheduler's own arguments, e.g. '{"num_decay_steps": 60}' for warmup_stable_decay
    lr_scheduler_kwargs: str | None = None
    max_grad_norm: float | None = 1.0  # 0 or None: no clipping (the norm is still logged and checked)
    mixed_precision: str = "auto"  # auto: bf16 on GPUs that support it, else fp32; or no / bf16 / fp16
    seed: int = 42
    per_device_eval_batch_size: int = 128
    eval_steps: int = 100
    logging_steps: int = 20
    save_steps: int = 0  # 0: save only the final model (and a checkpoint on preemption)
    save_total_limit: int | None = None  # keep only the newest K complete checkpoints (K >= 1)
    # "latest" (the newest complete checkpoint that validates; none yet: start fresh) or a checkpoint directory
    resume_from_checkpoint: str | None = None
    # Resume model, optimizer and schedule but read the data from the beginning (HF Trainer's flag): for
    # a checkpoint saved with other data, data layout or seed, which is otherwise refused
    ignore_data_skip: bool = False
    # On these signals: checkpoint at the next optimizer step, exit 75 (mmrecipes.step_guard); "" for none
    preemption_signals: str = "SIGTERM,SIGUSR1"
    max_skipped_steps: int = 5  # non-finite steps in a row (each skipped) before the run stops
    report_to: str = "auto"  # tensorboard when installed; or wandb, none
    peak_tflops: float | None = None  # per-device peak for the MFU estimate; default: known GPUs
    ddp_timeout: int = 1800  # seconds a collective may wait before the run fails instead of hanging
    # torch.compile (inductor) each transformer block in place (compile_blocks); the first steps
    # are slow while it compiles
    torch_compile: bool = False
    fused_adamw: bool | None = None  # one kernel for the whole update; default: on CUDA only

    def __post_init__(self):
        super().__post_init__()
        names = [name.strip() for name in self.preemption_signals.split(",") if name.strip()]
        unknown = [name for name in names if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP")]
        if unknown:
            raise ValueError(f"--preemption_signals {self.preemption_signals!r}: {', '.join(unknown)} is not a signal "
                             "a process can catch; write names such as SIGTERM,SIGUSR1 (or '' for none)")
        import torch  # here, not at the top: --help loads no torch

        from .training import lr_scheduler

        if self.mixed_precision == "fp16" and not torch.cuda.is_available():  # accelerate computes fp32 there
            raise ValueError("--mixed_precision fp16 needs a GPU: on a CPU the run would compute in fp32 while its "
                             "engine line said fp16. Use --mixed_precision no (or bf16)")
        if not self.max_grad_norm:
            self.max_grad_norm = math.inf  # clip_grad_norm_ then only measures (and DeepSpeed clips nothing)
        lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), self)  # refused now, not at step 1


@dataclass
class ModelArgs(CheckedArgs):
    CHECKS = dict.fromkeys(("image_size", "patch_size", "hidden_size", "num_layers", "projection_dim"), "count") | {
        "patch_dropout": "fraction", "max_num_patches": "patches"}
    UNUSED_WITH = {"model_name_or_path": ("tokenizer_name", "image_size", "patch_size", "hidden_size", "num_layers",
                                          "projection_dim")}
    # clip: CLIPModel with clip_loss (softmax over the batch); siglip: SiglipModel or Siglip2Model with siglip_loss
    # (sigmoid per pair)
    loss: str = field(default="clip", metadata={"choices": ["clip", "siglip"]})
    model_name_or_path: str | None = None  # a saved CLIP/SigLIP/SigLIP 2 directory or hub id; None builds a tiny one
    # SigLIP 2 NaFlex: each image resized to at most this many patches, its aspect ratio kept. With --loss siglip
    # and no model_name_or_path it builds a tiny Siglip2Model; with a SigLIP 2 checkpoint it replaces its
    # processor's limit (the position embeddings are resized to each image's grid either way).
    max_num_patches: int | None = None
    # The rest shape the tiny model only (model_name_or_path=None).
    tokenizer_name: str | None = None  # default: the embedded tiny one (SigLIP 2: of its own class, Siglip2Tokenizer)
    image_size: int = 32
    patch_size: int = 8
    hidden_size: int = 64
    num_layers: int = 2
    projection_dim: int = 64  # CLIP only: SigLIP has no projection
    logit_scale_init_value: float | None = None  # default ln(1/0.07) (CLIP) or ln(10) (SigLIP paper)
    logit_bias_init_value: float = -10.0  # SigLIP only (paper)
    # sdpa: PyTorch's fused attention (flash/memory-efficient kernels on CUDA); eager: the reference
    # math; flash_attention_2 needs the flash-attn package. Checked when the model is built.
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~1/3 more compute
    # FLIP's patch dropout: training keeps a random 1 - p of each image's patches (mmrecipes.patch_dropout)
    patch_dropout: float = 0.0
    # A checkpoint-N directory (any engine's, any number of processes) whose model weights start this run, which
    # is new: step 0, a fresh optimizer and schedule, the data from the start (resuming: --resume_from_checkpoint)
    init_from_checkpoint: str | None = None


@dataclass
class DataArgs(CheckedArgs):
    CHECKS = {"max_caption_length": "count_or_none", "max_image_pixels": "count", "max_image_aspect_ratio": "positive",
              "shuffle_buffer_size": "count", "dataloader_num_workers": "count_or_zero_or_none",
              "max_patches_per_batch": "count_or_none"}
    # hub id, local dataset dir, a builder ('parquet', 'imagefolder'), or embedded:<folder> for the embedded data;
    # comma-separated: several sources, mixed
    dataset_name: str = "embedded:shapes"
    # Sampling probabilities of comma-separated sources (as the VLM recipe's); None: equal. Each source's rows
    # trained are counted in the log (rows_<source>); evaluation reads the first source's eval split.
    dataset_weights: str | None = None
    dataset_config_name: str | None = None
    # Training files for a builder: globs, brace ranges ({00000..00099}), comma-separated, local or
    # fsspec URLs (expand_data_files). The eval files go in eval_data_files.
    data_files: str | None = None
    eval_data_files: str | None = None
    train_split: str = "train"
    eval_split: str | None = "test"  # None (or an empty eval set) turns evaluation off
    image_column: str = "image"
    caption_column: str = "text"
    max_caption_length: int | None = None  # tokens; default the tokenizer's model_max_length
    max_image_pixels: int = 50_000_000  # larger images are skipped before they are decoded
    # longer side / shorter side; more elongated images are skipped before they are decoded (the resize
    # to the processor's short side would make them huge)
    max_image_aspect_ratio: float = 50.0
    shuffle_buffer_size: int = 1000  # rows per shuffled block (ResumableShuffle)
    # None: chosen per rank (default_num_workers): none on a CPU, where the step already uses every core
    # (on 2 cores one worker halves data_wait but makes the default run slower: bench/data_loading.py);
    # with CUDA one per spare core, at most one per shard. One worker keeps the sample order of none;
    # more split the shards between them (a checkpoint holds each one's position: docs/long_runs.md).
    dataloader_num_workers: int | None = None
    # open_clip's training crop (its --aug-cfg defaults): a random 90-100% of each image's area at an aspect
    # ratio of 3/4 to 4/3, resized to the processor's size, instead of its eval resize and centre crop.
    # Evaluation is not augmented; each row's crop follows from its place in the stream (exact resume).
    train_augment: bool = False
    # SigLIP 2 NaFlex: each training micro-batch holds whole rows, in stream order, up to this many image patches
    # together (images of fewer patches, more rows); per_device_train_batch_size then only sets how many rows are
    # preprocessed at a time. Ranks may hold different row counts: siglip_loss stays exact.
    max_patches_per_batch: int | None = None

    def __post_init__(self):
        super().__post_init__()
        source_weights(self.dataset_weights, len(self.training_sources()), explicit=self.dataset_weights is not None)

    def training_sources(self) -> list[tuple]:
        """(name, config, split, data_files) of each training source."""
        return split_sources(self.dataset_name, self.dataset_config_name, self.train_split, self.data_files)

    def counted(self) -> tuple[str, ...]:
        """What a batch's `data_counts` holds: `COUNTED`, then the rows of each source where there are several."""
        from .data import COUNTED  # the pipeline's own module imports torch: not needed by --help
        sources = self.training_sources()
        if len(sources) == 1:
            return COUNTED
        labels = [Path(resolve_name(name).rstrip("/")).name or name for name, *_ in sources]
        labels = labels if len(set(labels)) == len(labels) else [str(index) for index in range(len(sources))]
        return COUNTED + tuple(f"rows_{label}" for label in labels)


DEFAULT_TEMPLATES = ("a photo of a {}.|a photo of the {}.|a rendering of a {}.|a {}.|a picture of a small {}.|"
                     "a picture of a large {}.")


@dataclass
class ZeroShotArgs(CheckedArgs):
    CHECKS = {"per_device_zeroshot_batch_size": "count"}
    EMBEDDED_SET: ClassVar[str] = "embedded:shapes_zeroshot"
    # A hub id, a builder with --zeroshot_data_files, or a local directory (an image folder with one
    # sub-folder per class is read as imagefolder); auto: the embedded shapes beside the embedded training data
    # only; None turns zero-shot evaluation off.
    zeroshot_dataset: str | None = "auto"
    zeroshot_data_files: str | None = None
    zeroshot_split: str | None = None  # default: test, or the only split there is
    zeroshot_image_column: str = "image"
    zeroshot_label_column: str = "label"
    zeroshot_class_names: str | None = None  # comma-separated; default: the label column's ClassLabel names
    zeroshot_templates: str = DEFAULT_TEMPLATES  # "|"-separated, each with one {} for the class name
    per_device_zeroshot_batch_size: int = 64

    def __post_init__(self):
        super().__post_init__()
        if self.zeroshot_data_files and self.zeroshot_dataset == "auto":
            raise ValueError("--zeroshot_data_files is read by the builder --zeroshot_dataset names: set it (e.g. "
                             "--zeroshot_dataset imagefolder)")


@dataclass
class VLMModelArgs(CheckedArgs):
    CHECKS = dict.fromkeys(("image_size", "patch_size", "vision_hidden_size", "vision_layers", "text_hidden_size",
                            "text_layers"), "count")
    UNUSED_WITH = {"model_name_or_path": ("tokenizer_name", *CHECKS)}
    # A saved image-text-to-text directory or hub id (Llava, Qwen2.5-VL, Qwen3-VL, SmolVLM, Gemma 3, ...),
    # loaded with AutoModelForImageTextToText and AutoProcessor; None builds the tiny Llava below
    model_name_or_path: str | None = None
    chat_template_path: str | None = None  # a .jinja file replacing the processor's chat template (TRL's name)
    tokenizer_name: str = str(TINY_VLM_TOKENIZER)  # used only with model_name_or_path=None
    # What trains: projector (LLaVA stage 1), projector,language_model (stage 2), all (tower too, at its own lr)
    train_modules: str = "projector,language_model"
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"  # as for CLIP (mmrecipes.models.ModelArgs)
    image_size: int = 32
    patch_size: int = 8
    vision_hidden_size: int = 64
    vision_layers: int = 2
    text_hidden_size: int = 128
    text_layers: int = 2


@dataclass
class LoraArgs(CheckedArgs):
    CHECKS = {"lora_r": "count", "lora_alpha": "count", "lora_dropout": "fraction"}
    use_peft: bool = False  # train LoRA adapters instead of the weights (TRL's flag names)
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    # None: every linear layer of the language model (and of the vision tower with --train_modules all);
    # all-linear (PEFT's meaning: the tower and the projector too); or comma-separated module names
    lora_target_modules: str | None = None
    lora_modules_to_save: str | None = None  # comma-separated modules trained in full, beside the projector


@dataclass
class VideoArgs(CheckedArgs):
    CHECKS = {"video_fps": "positive", "video_max_frames": "count", "video_max_seconds": "positive",
              "video_max_pixels": "count"}
    video_fps: float = 2.0  # frames sampled per second of clip (transformers' video processors: fps)
    video_max_frames: int = 8  # at most this many frames per clip (their num_frames)
    video_max_seconds: float = 600.0  # longer clips are skipped and counted (video_too_long)
    # Clips whose frames have more pixels (4K UHD by default) are skipped and counted (too_large), from the header
    # before any frame is decoded: one frame of 200M pixels cost 4.5 s and 614 MB before it was resized
    video_max_pixels: int = 3840 * 2160


@dataclass
class ChatDataArgs(VideoArgs):
    CHECKS = VideoArgs.CHECKS | {
        "max_length": "count", "max_tokens_per_batch": "count_or_none", "max_image_pixels": "count",
        "max_image_aspect_ratio": "positive", "shuffle_buffer_size": "count",
        "dataloader_num_workers": "count_or_zero_or_none"}
    EMBEDDED_EVAL: ClassVar[str] = "embedded:vlm_shapes/image_chat"  # what auto evaluates beside embedded data
    # Comma-separated sources (hub ids, local dataset dirs, one builder name with --data_files, or
    # embedded:<folder> for the embedded data)
    dataset_name: str = "embedded:vlm_shapes/image_chat,embedded:vlm_shapes/text_chat"
    # Sampling probabilities of the sources (datasets.interleave_datasets); None: equal
    dataset_weights: str | None = "0.75,0.25"
    dataset_config_name: str | None = None
    data_files: str | None = None  # training files of a single builder source ('json', 'parquet'): a glob
    train_split: str = "train"
    # Held-out conversations (answer accuracy). auto: the embedded questions beside the embedded training data;
    # with your own data, --eval_data_files read by the training builder, else none. None turns it off.
    eval_dataset_name: str | None = "auto"
    eval_data_files: str | None = None
    eval_split: str = "test"
    # Relative image paths resolve against it; None: against the folder of the data file each row comes from
    image_folder: str | None = None
    video_folder: str | None = None  # relative video paths resolve against it (None: as images)
    # Paths that resolve outside that folder ('../', absolute, symlinks out) are skipped and counted
    # (outside_folder) unless this is true
    allow_images_outside_folder: bool = False
    max_length: int = 256  # longer rows are skipped and counted, never truncated
    # Micro-batches of whole rows up to this many tokens (image tokens included) instead of a fixed row
    # count; ranks then carry different row counts (mmrecipes.packing). Rows over it count as too_long.
    max_tokens_per_batch: int | None = None
    packing: bool = False  # rows packed into sequences of up to max_length tokens, each sample attending only to itself
    max_image_pixels: int = 50_000_000
    max_image_aspect_ratio: float = 50.0  # as for CLIP (mmrecipes.data.DataArgs)
    shuffle_buffer_size: int = 1000
    # None: mmrecipes.data.default_num_workers, which on a CPU gives 1 here: per-row chat templates cost
    # more than the step, and one worker overlaps them (measured: 150 -> 210 samples/s on 2 cores).
    dataloader_num_workers: int | None = None

    def __post_init__(self):
        super().__post_init__()
        source_weights(self.dataset_weights, len(self.training_sources()),
                       explicit=self.dataset_weights != type(self).dataset_weights)
        self.eval_dataset_name, self.evaluation = evaluation_source(
            "eval_dataset_name", self.eval_dataset_name, self.eval_data_files, self.dataset_name, self.EMBEDDED_EVAL)

    def training_sources(self) -> list[tuple]:
        """(name, config, split, data_files) of each training source."""
        return split_sources(self.dataset_name, self.dataset_config_name, self.train_split, self.data_files)


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
    CHECKS = {"beta": "positive", "label_smoothing": "fraction", "rpo_alpha": "non_negative_or_none"}
    beta: float = 0.1  # how far the policy may move from the reference (TRL's name and default)
    # TRL 1.16's loss types, comma-separated, summed with --loss_weights: sigmoid (the DPO paper), ipo (IPO on
    # length-averaged log-probabilities), robust (Robust DPO, with --label_smoothing), sft (the chosen answer's mean
    # token NLL: RPO). sigmoid,sft lets the tiny default learn its answers from scratch; TRL's default is sigmoid.
    loss_type: str = "sigmoid,sft"
    loss_weights: str | None = None  # one per loss type, comma-separated; None: 1.0 each (TRL)
    label_smoothing: float = 0.0  # robust: the share of preference labels assumed flipped, below 0.5 (TRL)
    # Deprecated, TRL < 1.0's name: the weight of sft in --loss_type (0 drops it). Said with its TRL 1.16 spelling.
    rpo_alpha: float | None = None
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
        if not self.losses:
            raise ValueError("--rpo_alpha 0 dropped the only loss type: name a preference loss with --loss_type")
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
