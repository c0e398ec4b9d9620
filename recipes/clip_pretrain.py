"""Contrastive image-text pre-training (CLIP or SigLIP) with Hugging Face Accelerate.

    accelerate launch recipes/clip_pretrain.py
    accelerate launch recipes/clip_pretrain.py --loss siglip
    accelerate launch recipes/clip_pretrain.py --loss siglip --max_num_patches 16 --max_patches_per_batch 512
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/clip_pretrain.py recipes/configs/clip_tiny.yaml

With no arguments it trains a tiny CLIP on the embedded shapes data in well under a minute on a
CPU and writes a directory that `CLIPModel.from_pretrained` and
`pipeline("zero-shot-image-classification", model=...)` load; `--loss siglip` does the same for a
`SiglipModel` trained with the sigmoid loss, and `--max_num_patches N` for a SigLIP 2 NaFlex `Siglip2Model`
(each image at its own aspect ratio). The same file runs under every engine in accelerate_configs/ (DDP, FSDP2,
ZeRO-2, ZeRO-3, multi-node) and on real data:
`--model_name_or_path`, `--dataset_name`/`--data_files`, `--image_column`/`--caption_column`.
Tested on a 2-core CPU (1 and 2 processes, gloo).
"""

from dataclasses import asdict, dataclass, field

from mmrecipes.arguments import DataArgs, ModelArgs, TrainingArgs, ZeroShotArgs
from mmrecipes.config import parse_args
from mmrecipes.locking import LockArgs, lock_towers


@dataclass
class TrainArgs(TrainingArgs):
    CHECKS = TrainingArgs.CHECKS | {"loss_tile_size": "count_or_none"}
    output_dir: str = "outputs/clip_pretrain"
    # plain: each micro-batch is its own contrastive batch (b negatives per row); feature_cache: the
    # accumulation window is ONE batch of k*b negatives (GradCache: one extra forward per micro-batch)
    contrastive_accumulation: str = field(default="plain", metadata={"choices": ["plain", "feature_cache"]})
    loss_tile_size: int | None = None  # clip_loss in tiles: no [b, N] logits matrix (siglip_loss never has one)


ARGUMENTS = (ModelArgs, LockArgs, DataArgs, ZeroShotArgs, TrainArgs)  # the flags and YAML keys this recipe takes
if __name__ == "__main__":
    parse_args(ARGUMENTS)  # --help and a bad flag answer here, before torch and the models load

import time
from functools import partial

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mmrecipes.checkpointing import Checkpointer, checkpoint_weights, data_layout
from mmrecipes.data import build_dataloader, caption_length, evaluation_off_reason, model_inputs
from mmrecipes.distributed import all_ranks_true, data_parallel_rank_and_world, engine_line, reconcile_deepspeed_config
from mmrecipes.evaluation import evaluate_retrieval
from mmrecipes.feature_cache import feature_cache_backward
from mmrecipes.loader import batches_forever, no_rows_error
from mmrecipes.losses import clip_loss, siglip_loss
from mmrecipes.metrics import LogWindow, eval_line, log_line
from mmrecipes.model_card import History, write_model_card
from mmrecipes.models import build_contrastive, clamp_logit_scale_, save_contrastive
from mmrecipes.patch_dropout import add_patch_dropout
from mmrecipes.sources import evaluation_source
from mmrecipes.step_guard import StepGuard
from mmrecipes.throughput import ContrastiveFlops, peak_flops
from mmrecipes.training import (
    accelerator_from_args,
    adamw,
    compile_blocks,
    lr_scheduler,
    per_device_batch_size,
)
from mmrecipes.zeroshot import ZeroShotSet, evaluate_zeroshot


def main(argv=None):
    model_args, lock_args, data_args, zeroshot_args, args = parse_args(ARGUMENTS, argv)
    if model_args.loss == "siglip" and args.loss_tile_size:
        raise ValueError("--loss_tile_size tiles clip_loss; siglip_loss never holds a [b, N] matrix: drop the flag")
    if model_args.patch_dropout and args.contrastive_accumulation == "feature_cache":
        raise ValueError("--patch_dropout with --contrastive_accumulation feature_cache: the cache's second forward "
                         "would drop other patches than its first; use one of them")
    set_seed(args.seed)
    # Before Accelerator(): under ZeRO-3 a model built afterwards is partitioned and re-initialised.
    model, tokenizer, image_processor = build_contrastive(model_args)
    # Counted now: after prepare, ZeRO-3 parameters are partitioned and report numel() == 0.
    # SigLIP pads captions to a fixed length: a different --max_caption_length is rejected here.
    batch_flops = ContrastiveFlops(model, caption_length(data_args, tokenizer, model.pads_text_to_max_length))
    accelerator = accelerator_from_args(args)
    if model_args.init_from_checkpoint:  # the weights only, strictly (the checkpoint's model flags); a new run
        model.load_state_dict(checkpoint_weights(model_args.init_from_checkpoint))
        accelerator.print(f"model weights from {model_args.init_from_checkpoint}; a new run from step 0")
    for line in lock_towers(model, lock_args):  # frozen before prepare: no optimizer state, no gradients
        accelerator.print(line)
    if model_args.patch_dropout:
        accelerator.print(add_patch_dropout(model, model_args.patch_dropout))
    data_rank, data_world = data_parallel_rank_and_world(accelerator)
    batch_size = per_device_batch_size(args, data_world)
    if args.torch_compile:  # in place, before prepare wraps the model
        accelerator.print(compile_blocks(model))

    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]  # no decay on norms, biases, logit scale
    no_decay = [p for p in trainable if p.ndim < 2]
    optimizer = adamw([{"params": decay, "weight_decay": args.weight_decay},
                       {"params": no_decay, "weight_decay": 0.0}], args)
    # Stepped by hand once per optimizer step (accelerate's prepared scheduler steps per process).
    scheduler = lr_scheduler(optimizer, args)
    reconcile_deepspeed_config(accelerator, train_micro_batch_size_per_gpu=batch_size,
                               gradient_accumulation_steps=args.gradient_accumulation_steps,
                               gradient_clipping=args.max_grad_norm)
    model, optimizer = accelerator.prepare(model, optimizer)
    engine = engine_line(accelerator, model)
    accelerator.print(engine)

    # Each data rank reads its own rows, so the loaders are not passed to accelerator.prepare
    # (it would split a datasets stream a second time).
    pad_to_max_length = accelerator.unwrap_model(model).pads_text_to_max_length  # SigLIP: to the tokenizer's length
    loader_kwargs = dict(tokenizer=tokenizer, image_processor=image_processor, data_rank=data_rank,
                         data_world=data_world, pad_to_max_length=pad_to_max_length)
    train_loader = build_dataloader(data_args, data_args.train_split, data_args.data_files, batch_size=batch_size,
                                    shuffle_seed=args.seed, **loader_kwargs)
    eval_loader, no_eval = None, evaluation_off_reason(data_args)
    evaluated = [f"retrieval off: {no_eval}" if no_eval else f"retrieval on the {data_args.eval_split} split"]
    if not no_eval:
        eval_loader = build_dataloader(data_args, data_args.eval_split, data_args.eval_data_files,
                                       batch_size=args.per_device_eval_batch_size, **loader_kwargs)
    # Zero-shot classification next to retrieval (open_clip's ImageNet top-1): the embedded shape and
    # colour classes beside the embedded data; any image folder, hub id or builder with a label column.
    zeroshot_args.zeroshot_dataset, zeroshot_line = evaluation_source(
        "zeroshot_dataset", zeroshot_args.zeroshot_dataset, None, data_args.dataset_name, zeroshot_args.EMBEDDED_SET)
    evaluated.append(zeroshot_line)
    accelerator.print("evaluation: " + "; ".join(evaluated))
    zeroshot = None
    if zeroshot_args.zeroshot_dataset:
        zeroshot = ZeroShotSet(zeroshot_args, tokenizer, image_processor, data_rank=data_rank, data_world=data_world,
                               caption_length=caption_length(data_args, tokenizer, loader_kwargs["pad_to_max_length"]),
                               pad_to_max_length=loader_kwargs["pad_to_max_length"])

    checkpoints = Checkpointer(accelerator, args, scheduler, accelerator.unwrap_model(model),
                               data_layout(data_args, args, data_world=data_world, batch_size=batch_size))
    # Once per optimizer step the ranks agree whether to apply it (finite loss and gradients) and
    # whether a preemption signal arrived (then: checkpoint and exit).
    guard = StepGuard(accelerator, model, optimizer, checkpoints, signals=args.preemption_signals,
                      max_skipped_steps=args.max_skipped_steps)
    start_step, resumed_epoch = checkpoints.resume(args.resume_from_checkpoint, train_loader)
    train_batches = batches_forever(train_loader, resumed_epoch)

    accelerator.init_trackers(f"{model_args.loss}_pretrain", asdict(model_args) | asdict(data_args) | asdict(args))
    peak = peak_flops(args.peak_tflops)
    progress = tqdm(range(start_step, args.max_steps), disable=not accelerator.is_local_main_process)
    log = tqdm.write if accelerator.is_main_process else lambda line: None  # lines that keep the bar intact
    counted = data_args.counted()  # bad rows by kind, and the rows of each source where there are several
    # The sums of a logging window, and their totals (from the checkpoint's on a resume); everything logged
    logged, history = LogWindow(accelerator.device, counted, checkpoints.resumed_totals), History()
    # Both take (image_embeds, text_embeds, *what the model returns after them): scale, and SigLIP's bias.
    loss_fn = siglip_loss if model_args.loss == "siglip" else partial(clip_loss, tile_size=args.loss_tile_size)
    for step in progress:
        window = []
        for _ in range(args.gradient_accumulation_steps):
            epoch, batch = logged.next(train_batches)
            # A rank whose share is empty gets None at its first batch (every epoch reads the same
            # rows): the ranks agree on that once, not with a collective and host sync per micro-step.
            if step == start_step and not window and not all_ranks_true(batch is not None, accelerator.device):
                raise no_rows_error(train_loader, data_world, batch is None)  # the rank without rows says why
            window.append(batch)
        if args.contrastive_accumulation == "feature_cache":
            # The window's micro-batches act as ONE contrastive batch (k*b negatives per row).
            window_losses = [feature_cache_backward(accelerator, model, window, loss_fn)]
        else:
            # Each micro-batch is its own contrastive batch (b negatives); the gradients add up.
            window_losses = []
            for batch in window:
                # Gradients are all-reduced only on the last micro-batch of the window (no_sync before it).
                with accelerator.accumulate(model):
                    loss = loss_fn(*model(**model_inputs(batch, accelerator.device)))
                    accelerator.backward(loss)
                window_losses.append(loss.detach())
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        done = step + 1
        step_losses = torch.stack(window_losses)
        if guard.should_call_optimizer(step_losses, grad_norm, done):  # a fused AdamW is always called
            optimizer.step()  # under DeepSpeed the engine already stepped inside accelerator.backward
            scheduler.step()
            clamp_logit_scale_(accelerator, model)
        logged.add_applied(guard.applied, loss=step_losses.mean(), applied_steps=1)  # on the device
        logged.add(samples=sum(len(batch["input_ids"]) for batch in window),
                   flops=sum(batch_flops(batch) for batch in window),
                   data_counts=sum(batch["data_counts"] for batch in window))
        optimizer.zero_grad()
        filler_batch = window[-1]  # any valid batch: what a rank with no eval rows left forwards

        if done % args.logging_steps == 0 or done == args.max_steps:
            # Mean over ranks of the local losses is the global-batch loss (mmrecipes.losses).
            sums = logged.close()
            metrics = {"loss": sums["loss"] / sums["applied_steps"] if sums["applied_steps"] else float("nan"),
                       "lr": scheduler.get_last_lr()[0], "samples_per_s": sums["samples"] / sums["seconds"],
                       "mfu": sums["flops"] / sums["seconds"] / peak / accelerator.num_processes if peak else None,
                       "data_wait": sums["data_wait"] / accelerator.num_processes / sums["seconds"],
                       "skipped_steps": guard.skipped_steps} | {name: int(logged.total[name]) for name in counted}
            accelerator.log(metrics | {"epoch": epoch}, step=done)
            history.add(done, metrics)
            log(log_line(done, args.max_steps, metrics))
        evaluating = eval_loader is not None or zeroshot is not None
        if evaluating and (done % args.eval_steps == 0 or done == args.max_steps):
            eval_start = time.perf_counter()
            recall = {}
            if eval_loader is not None:
                recall = evaluate_retrieval(model, eval_loader, filler_batch, accelerator.device)
            if zeroshot is not None:
                recall |= evaluate_zeroshot(model, zeroshot, accelerator.device)
            logged.pause(time.perf_counter() - eval_start)  # samples/s measures training only
            if recall:
                accelerator.log(recall, step=done)
                history.add(done, recall, evaluation=True)
                log(eval_line(done, recall))
        if done < args.max_steps and (guard.stop_requested or args.save_steps and done % args.save_steps == 0):
            checkpoint = checkpoints.save(done, epoch, logged.totals_so_far())
            if guard.stop_requested:
                guard.exit_preempted(checkpoint)  # exit code 75 on every rank: run the same command again

    save_contrastive(accelerator, model, tokenizer, image_processor, args.output_dir)
    if accelerator.is_main_process:
        write_model_card(
            args.output_dir, history, pipeline_tag="zero-shot-image-classification",
            eval_metrics=["image_to_text_R@1", "text_to_image_R@1", "zeroshot_top1"],
            base_model=model_args.model_name_or_path, datasets=[data_args.dataset_name],
            evaluated="; ".join(evaluated), tags=[model_args.loss, "contrastive"], engine=engine,
            seen=f"{int(logged.total['samples']):,} image-text pairs", resumed_at=start_step)
    # Every rank leaves together: a rank that tore down its process group while rank 0 still wrote
    # the card aborted once under ZeRO-3 ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.print(f"saved model to {args.output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
