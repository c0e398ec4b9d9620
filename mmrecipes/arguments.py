"""The recipes' arguments: one small dataclass per component, each with its value rules
(`CheckedArgs`).

Flags and YAML keys are these fields (`mmrecipes.config.parse_args`); their comments are the
`--help` text. This module imports neither torch nor transformers' models, so a recipe parses its
flags, `--help` included, before it loads them (under a second, where every import took 4-5 s here
and 38-58 s on a cold disk). The components keep their code in their own modules
(`mmrecipes.training`, `mmrecipes.vlm.rows.chat_data`, ...), which import their arguments from here.
"""

import math
import signal
from dataclasses import dataclass

from .config import CheckedArgs, checked
from .sources import source_weights, split_sources


@dataclass
class TrainingArgs(CheckedArgs):
    """Arguments every recipe shares; a recipe subclasses it to add its own and change defaults."""

    output_dir: str = "outputs/run"
    max_steps: int = checked(300, "count")  # optimizer steps
    per_device_train_batch_size: int = checked(64, "count")
    # if set: per-device batch = global / (data ranks * accumulation)
    global_batch_size: int | None = checked(None, "count_or_none")
    gradient_accumulation_steps: int = checked(1, "count")
    learning_rate: float = checked(2.0e-3, "learning_rate")
    weight_decay: float = checked(0.1, "non_negative")
    # AdamW's betas and eps (HF TrainingArguments' names; open_clip's ViTs: 0.98, 1e-6)
    adam_beta1: float = checked(0.9, "fraction")
    adam_beta2: float = checked(0.999, "fraction")
    adam_epsilon: float = checked(1.0e-8, "positive")
    warmup_steps: int = checked(20, "count_or_zero")
    lr_scheduler_type: str = "cosine"  # any of transformers' get_scheduler types the loop can step
    # JSON of the scheduler's own arguments, e.g. '{"num_decay_steps": 60}' for warmup_stable_decay
    lr_scheduler_kwargs: str | None = None
    # 0 or None: no clipping (the norm is still logged and checked)
    max_grad_norm: float | None = checked(1.0, "non_negative_or_none")
    # auto: bf16 on GPUs that support it, else fp32; or no / bf16 / fp16
    mixed_precision: str = "auto"
    seed: int = 42
    per_device_eval_batch_size: int = checked(128, "count")
    eval_steps: int = checked(100, "count")
    logging_steps: int = checked(20, "count")
    # 0: save only the final model (and a checkpoint on preemption)
    save_steps: int = checked(0, "count_or_zero")
    # keep only the newest K complete checkpoints (K >= 1)
    save_total_limit: int | None = checked(None, "count_or_none")
    # "latest" (the newest complete checkpoint that validates; none yet: start fresh) or a checkpoint directory
    resume_from_checkpoint: str | None = None
    # Resume model, optimizer and schedule but read the data from the beginning (HF Trainer's flag): for
    # a checkpoint saved with other data, data layout or seed, which is otherwise refused
    ignore_data_skip: bool = False
    # On these signals: checkpoint at the next optimizer step, exit 75 (mmrecipes.step_guard); "" for none
    preemption_signals: str = "SIGTERM,SIGUSR1"
    # non-finite steps in a row (each skipped) before the run stops
    max_skipped_steps: int = checked(5, "count_or_zero")
    report_to: str = "auto"  # tensorboard when installed; or wandb, none
    # per-device peak for the MFU estimate; default: known GPUs
    peak_tflops: float | None = checked(None, "positive_or_none")
    # seconds a collective may wait before the run fails instead of hanging
    ddp_timeout: int = checked(1800, "count")
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

        # accelerate computes fp32 there
        if self.mixed_precision == "fp16" and not torch.cuda.is_available():
            raise ValueError("--mixed_precision fp16 needs a GPU: on a CPU the run would compute in fp32 while its "
                             "engine line said fp16. Use --mixed_precision no (or bf16)")
        if not self.max_grad_norm:
            # clip_grad_norm_ then only measures (and DeepSpeed clips nothing)
            self.max_grad_norm = math.inf
        # refused now, not at step 1
        lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), self)


@dataclass
class SourceArgs(CheckedArgs):
    """The data flags both pipelines share: where the rows come from and how they are mixed, the
    image limits, the shuffle and the DataLoader workers. Each pipeline's data arguments subclass it
    (defaults, own flags)."""

    # hub id, local dataset dir, a builder ('parquet', 'imagefolder', 'json'), or embedded:<folder>
    # for the embedded data; comma-separated: several sources, mixed
    dataset_name: str = "embedded:shapes"
    # Sampling probabilities of comma-separated sources (datasets.interleave_datasets); None: equal.
    # Each source's rows trained are counted in the log (rows_<source>) by the contrastive recipe
    dataset_weights: str | None = None
    dataset_config_name: str | None = None
    # Training files for a builder: globs, brace ranges ({00000..00099}), comma-separated, local or
    # fsspec URLs (expand_data_files). The eval files go in eval_data_files.
    data_files: str | None = None
    eval_data_files: str | None = None
    train_split: str = "train"
    eval_split: str | None = "test"  # None (or an empty eval set) turns evaluation off
    # larger images are skipped before they are decoded
    max_image_pixels: int = checked(50_000_000, "count")
    # longer side / shorter side; more elongated images are skipped before they are decoded (the
    # resize to the processor's short side would make them huge)
    max_image_aspect_ratio: float = checked(50.0, "positive")
    shuffle_buffer_size: int = checked(1000, "count")  # rows per shuffled block (ResumableShuffle)
    # None: chosen per rank (loader.default_num_workers; docs/performance.md): with CUDA one per
    # spare core, at most one per shard; on a CPU none for image-caption rows, one for chat rows.
    # One worker keeps the sample order of none; more split the shards between them (a checkpoint
    # holds each one's position)
    dataloader_num_workers: int | None = checked(None, "count_or_zero_or_none")

    def __post_init__(self):
        super().__post_init__()
        source_weights(self.dataset_weights, len(self.training_sources()),
                       explicit=self.dataset_weights != type(self).dataset_weights)

    def training_sources(self) -> list[tuple]:
        """(name, config, split, data_files) of each training source."""
        return split_sources(self.dataset_name, self.dataset_config_name, self.train_split, self.data_files)
