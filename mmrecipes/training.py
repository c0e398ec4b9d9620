"""What every recipe's loop needs around it: the common arguments, batch size from a global
batch, mixed precision and tracker choice. The loop itself stays in the recipe."""

import json
import math
import signal
from dataclasses import dataclass

import torch
from transformers import get_scheduler

from .config import CheckedArgs
from .distributed import make_accelerator


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
        if self.mixed_precision == "fp16" and not torch.cuda.is_available():  # accelerate computes fp32 there
            raise ValueError("--mixed_precision fp16 needs a GPU: on a CPU the run would compute in fp32 while its "
                             "engine line said fp16. Use --mixed_precision no (or bf16)")
        if not self.max_grad_norm:
            self.max_grad_norm = math.inf  # clip_grad_norm_ then only measures (and DeepSpeed clips nothing)
        lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), self)  # refused now, not at step 1


def per_device_batch_size(args: TrainingArgs, data_world: int) -> int:
    if args.global_batch_size is None:
        return args.per_device_train_batch_size
    per_step = data_world * args.gradient_accumulation_steps
    if args.global_batch_size % per_step:
        raise ValueError(f"--global_batch_size {args.global_batch_size} is not divisible by data ranks ({data_world}) "
                         f"x --gradient_accumulation_steps ({args.gradient_accumulation_steps}); use a multiple of "
                         f"{per_step}, e.g. {math.ceil(args.global_batch_size / per_step) * per_step}.")
    return args.global_batch_size // per_step


def accelerator_from_args(args: TrainingArgs):
    """The recipe's Accelerator (`mmrecipes.distributed.make_accelerator`: real on multi-process CPU too)."""
    return make_accelerator(
        timeout_s=args.ddp_timeout,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=resolve_mixed_precision(args.mixed_precision),
        log_with=resolve_report_to(args.report_to),
        project_dir=args.output_dir,
    )


def adamw(param_groups, args: TrainingArgs) -> torch.optim.AdamW:
    """AdamW at `args.learning_rate` (groups may set their own lr and weight decay) with the args' betas and
    eps, fused where asked."""
    fused = torch.cuda.is_available() if args.fused_adamw is None else args.fused_adamw
    return torch.optim.AdamW(param_groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, fused=fused or None)  # None: torch picks foreach


def lr_scheduler(optimizer, args: TrainingArgs):
    """transformers' `get_scheduler(lr_scheduler_type)` over `max_steps` with `warmup_steps`, given the
    `lr_scheduler_kwargs`; a type or arguments it cannot build from these, or a plateau schedule (it needs a metric
    at every step, which the loop does not pass), raises a ValueError that says what to give."""
    flag = f"--lr_scheduler_type {args.lr_scheduler_type}"
    if args.lr_scheduler_type == "reduce_lr_on_plateau":
        raise ValueError(f"{flag}: it steps on an evaluation metric, which the loop does not pass; choose a "
                         "schedule over steps (cosine, linear, warmup_stable_decay, ...)")
    try:
        kwargs = json.loads(args.lr_scheduler_kwargs) if args.lr_scheduler_kwargs else {}
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
    except ValueError as error:
        raise ValueError(f"--lr_scheduler_kwargs {args.lr_scheduler_kwargs!r}: {error}; write a JSON object such "
                         "as '{\"num_decay_steps\": 60}'") from None
    try:
        return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                             num_training_steps=args.max_steps, scheduler_specific_kwargs=kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{flag} with --lr_scheduler_kwargs {args.lr_scheduler_kwargs!r}: {error}. Give its "
                         "arguments as JSON, e.g. --lr_scheduler_kwargs '{\"num_decay_steps\": 60}' for "
                         "warmup_stable_decay") from None


def resolve_mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def resolve_report_to(choice: str):
    if choice == "auto":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            return None
        return "tensorboard"
    return None if choice == "none" else choice


def compile_blocks(model) -> str:
    """`torch.compile` each of the model's transformer blocks in place (its `_no_split_modules`,
    the classes FSDP2 wraps): regional compilation, as torchtitan does it. Call it before
    `accelerator.prepare`. In place, names and classes stay as they are, so every engine wraps,
    checkpoints and saves the model as it would the eager one; blocks of one class and shape
    compile once. accelerate's own `dynamo_backend` on the DDP path copies the model and adds
    `_orig_mod.` to the blocks' names, which the saved checkpoint would carry. Returns a log line.

    `dynamic=True`: batch size and sequence length are symbolic from the first compile, so a
    stream's short last batch, another caption length or the eval batch size reuse the graphs.
    With static shapes each new size recompiled the blocks, whose one code object (both CLIP towers,
    train and eval) then reached dynamo's recompile limit (8) and silently ran eager from there on
    (tests/test_step_costs.py).
    """
    compiled = [module for module in model.modules() if type(module).__name__ in model._no_split_modules]
    for module in compiled:
        module.compile(dynamic=True)
    return f"compiled {len(compiled)} blocks ({', '.join(sorted({type(module).__name__ for module in compiled}))})"
