"""What every recipe's loop needs around it, from its `arguments.TrainingArgs` (`args`): batch size
from a global batch, the accelerator, AdamW, the schedule, mixed precision and tracker choice. The
loop itself stays in the recipe. This module imports no `arguments`: `TrainingArgs` checks its
schedule here when parsed."""

import json
import math

import torch
from transformers import get_scheduler

from .distributed import make_accelerator


def per_device_batch_size(args, data_world: int) -> int:
    if args.global_batch_size is None:
        return args.per_device_train_batch_size
    per_step = data_world * args.gradient_accumulation_steps
    if args.global_batch_size % per_step:
        raise ValueError(f"--global_batch_size {args.global_batch_size} is not divisible by data ranks ({data_world}) "
                         f"x --gradient_accumulation_steps ({args.gradient_accumulation_steps}); use a multiple of "
                         f"{per_step}, e.g. {math.ceil(args.global_batch_size / per_step) * per_step}.")
    return args.global_batch_size // per_step


def accelerator_from_args(args):
    """The recipe's Accelerator (`mmrecipes.distributed.make_accelerator`: real on multi-process CPU
    too)."""
    return make_accelerator(
        timeout_s=args.ddp_timeout,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=resolve_mixed_precision(args.mixed_precision),
        log_with=resolve_report_to(args.report_to),
        project_dir=args.output_dir,
    )


def adamw(param_groups, args) -> torch.optim.AdamW:
    """AdamW at `args.learning_rate` (groups may set their own lr and weight decay) with the args'
    betas and eps, fused where asked."""
    fused = torch.cuda.is_available() if args.fused_adamw is None else args.fused_adamw
    return torch.optim.AdamW(param_groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             # None: torch picks foreach
                             eps=args.adam_epsilon, fused=fused or None)


def lr_scheduler(optimizer, args):
    """transformers' `get_scheduler(lr_scheduler_type)` over `max_steps` with `warmup_steps`, given
    the `lr_scheduler_kwargs`; a type or arguments it cannot build from these, or a plateau schedule
    (it needs a metric at every step, which the loop does not pass), raises a ValueError that says
    what to give."""
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


def optimizer_groups(trainable: dict[str, list[torch.nn.Parameter]], *, learning_rate: float, weight_decay: float,
                     own_rates: dict[str, tuple[float, float]] | None = None) -> list[dict]:
    """AdamW parameter groups of each part's trainable parameters (`trainable`: {part: parameters}):
    weight decay on matrices only, not on norms, biases or scales. A part named in `own_rates`
    trains at its own (learning rate, weight decay) (a VLM's vision tower), in groups after the
    others: the logged lr is the first group's."""
    own_rates, groups = own_rates or {}, []
    for part, params in sorted(trainable.items(), key=lambda item: item[0] in own_rates):
        params = [p for p in params if p.requires_grad]
        lr, decay = own_rates.get(part, (learning_rate, weight_decay))
        groups += [{"params": [p for p in params if p.ndim >= 2], "lr": lr, "weight_decay": decay},
                   {"params": [p for p in params if p.ndim < 2], "lr": lr, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
