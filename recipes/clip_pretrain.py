"""Contrastive image-text (CLIP, SigLIP) or audio-text (CLAP) pre-training with Accelerate.

    accelerate launch recipes/clip_pretrain.py
    accelerate launch recipes/clip_pretrain.py --loss siglip
    accelerate launch recipes/clip_pretrain.py recipes/configs/clap_tiny.yaml
    accelerate launch recipes/clip_pretrain.py --loss siglip --max_num_patches 16 \
        --max_patches_per_batch 512
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/clip_pretrain.py \
        recipes/configs/clip_tiny.yaml

With no arguments it trains a tiny CLIP on the embedded shapes data in well under a minute on a CPU
and writes a directory that `CLIPModel.from_pretrained` and
`pipeline("zero-shot-image-classification", model=...)` load; `--loss siglip` does the same for a
`SiglipModel` trained with the sigmoid loss, and `--max_num_patches N` for a SigLIP 2 NaFlex
`Siglip2Model` (each image at its own aspect ratio). Audio-caption data (an --audio_column, no
--image_column) trains a `ClapModel` with either loss, retrieval and "This is a sound of {}."
zero-shot in the loop. The same file runs under every engine in
accelerate_configs/ (DDP, FSDP2, ZeRO-2, ZeRO-3, multi-node) and on real data:
`--model_name_or_path`, `--dataset_name`/`--data_files`, `--image_column`/`--caption_column`.
Tested on a 2-core CPU (1 and 2 processes, gloo).
"""

from dataclasses import dataclass

from mmrecipes.arguments import TrainingArgs
from mmrecipes.config import checked, parse_args
from mmrecipes.contrastive.arguments import DataArgs, ModelArgs, ZeroShotArgs
from mmrecipes.contrastive.tower_locking import LockArgs, lock_towers


@dataclass
class TrainArgs(TrainingArgs):
    output_dir: str = "outputs/clip_pretrain"
    # plain: each micro-batch is its own contrastive batch (b negatives per row); feature_cache: the
    # window is ONE batch of k*b negatives (GradCache: one extra forward per micro-batch)
    contrastive_accumulation: str = checked("plain", choices=("plain", "feature_cache"))
    # clip_loss in tiles: no [b, N] logits matrix (siglip_loss never has one)
    loss_tile_size: int | None = checked(None, "count_or_none")

    def check_with(self, parsed):
        model_args = self.other(parsed, ModelArgs)
        if model_args.loss == "siglip" and self.loss_tile_size:
            raise ValueError("--loss_tile_size tiles clip_loss; siglip_loss never holds a [b, N] "
                             "matrix: drop the flag")
        if model_args.patch_dropout and self.contrastive_accumulation == "feature_cache":
            raise ValueError("--patch_dropout with --contrastive_accumulation feature_cache: the "
                             "cache's second forward would drop other patches than its first; use "
                             "one of them")


# the flags and YAML keys this recipe takes
ARGUMENTS = (ModelArgs, LockArgs, DataArgs, ZeroShotArgs, TrainArgs)
# shared: flags first
if __name__ == "__main__":
    parse_args(ARGUMENTS)  # --help and a bad flag answer here, before torch and the models load

from functools import partial

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mmrecipes.checkpointing import Checkpointer, checkpoint_weights, data_layout
from mmrecipes.contrastive.audio_pairs import window_rule
from mmrecipes.contrastive.data import (
    build_dataloader,
    caption_length,
    data_modality,
    evaluation_off_reason,
)
from mmrecipes.contrastive.evaluation import evaluate_retrieval
from mmrecipes.contrastive.flops import ContrastiveFlops
from mmrecipes.contrastive.grad_cache import grad_cache_backward
from mmrecipes.contrastive.losses import clip_loss, siglip_loss
from mmrecipes.contrastive.models import build_contrastive, clamp_logit_scale_, save_contrastive
from mmrecipes.contrastive.patch_dropout import add_patch_dropout
from mmrecipes.contrastive.zeroshot import ZeroShotSet, evaluate_zeroshot
from mmrecipes.distributed import Ranks, engine_line, reconcile_deepspeed_config
from mmrecipes.images import to_device
from mmrecipes.loader import TrainBatches, check_held_out
from mmrecipes.model_card import write_model_card
from mmrecipes.reporting import Evaluation, Report, ratio, tracker_config
from mmrecipes.sources import evaluation_source
from mmrecipes.step_guard import StepGuard
from mmrecipes.training import (
    accelerator_from_args,
    adamw,
    compile_blocks,
    lr_scheduler,
    optimizer_groups,
    per_device_batch_size,
)


def main(argv=None):
    model_args, lock_args, data_args, zeroshot_args, args = parse_args(ARGUMENTS, argv)
    set_seed(args.seed)
    # Before Accelerator(): under ZeRO-3 a model built afterwards is partitioned and re-initialised.
    # The data's column says image or audio; the tiny default follows it, a checkpoint must match.
    modality = data_modality(data_args)
    model, tokenizer, processor = build_contrastive(model_args, modality)
    # Counted now: after prepare, ZeRO-3 parameters are partitioned and report numel() == 0.
    # SigLIP pads captions to a fixed length: a different --max_caption_length is rejected here.
    captions = caption_length(data_args, tokenizer, model.pads_text_to_max_length)
    batch_flops = ContrastiveFlops(model, captions)
    # shared: accelerator
    accelerator = accelerator_from_args(args)

    ranks = Ranks.of(accelerator)  # the rows each rank reads (an HSDP mesh's data ranks)
    batch_size = per_device_batch_size(args, ranks.data_world)

    if model_args.init_from_checkpoint:  # its weights only, strictly; a new run
        model.load_state_dict(checkpoint_weights(model_args.init_from_checkpoint))
        accelerator.print(f"model weights from {model_args.init_from_checkpoint}; "
                          "a new run from step 0")
    for line in lock_towers(model, lock_args):  # frozen before prepare: no optimizer state
        accelerator.print(line)
    if model_args.patch_dropout:
        accelerator.print(add_patch_dropout(model, model_args.patch_dropout))
    if args.torch_compile:  # in place, before prepare wraps the model
        accelerator.print(compile_blocks(model))

    # No decay on norms, biases, the logit scale; frozen (locked) parameters hold no state.
    groups = optimizer_groups({"model": list(model.parameters())}, learning_rate=args.learning_rate,
                              weight_decay=args.weight_decay)
    optimizer = adamw(groups, args)
    # Stepped by hand once per optimizer step (accelerate's prepared scheduler steps per process).
    scheduler = lr_scheduler(optimizer, args)

    # shared: deepspeed
    reconcile_deepspeed_config(accelerator, train_micro_batch_size_per_gpu=batch_size,
                               gradient_accumulation_steps=args.gradient_accumulation_steps,
                               gradient_clipping=args.max_grad_norm)

    model, optimizer = accelerator.prepare(model, optimizer)
    engine = engine_line(accelerator, model)
    accelerator.print(engine)
    if modality == "audio":
        accelerator.print(window_rule(processor))

    # Each data rank reads its own rows, so the loaders are not passed to accelerator.prepare
    # (it would split a datasets stream a second time). SigLIP pads to the tokenizer's length.
    pad_to_max_length = accelerator.unwrap_model(model).pads_text_to_max_length
    loader_kwargs = dict(tokenizer=tokenizer, processor=processor, ranks=ranks,
                         pad_to_max_length=pad_to_max_length)
    train_loader = build_dataloader(data_args, data_args.train_split, data_args.data_files,
                                    batch_size=batch_size, shuffle_seed=args.seed, **loader_kwargs)
    held_out, no_eval = [], evaluation_off_reason(data_args)  # retrieval R@1, zero-shot top-1/5
    split = data_args.eval_split
    evaluated = [f"retrieval off: {no_eval}" if no_eval else f"retrieval on the {split} split"]
    if not no_eval:
        eval_loader = build_dataloader(data_args, split, data_args.eval_data_files,
                                       batch_size=args.per_device_eval_batch_size, **loader_kwargs)
        check_held_out(eval_loader, accelerator.device, split)  # no usable pair: stop now
        held_out.append(partial(evaluate_retrieval, model, eval_loader, device=accelerator.device,
                                media=modality))
    # Zero-shot classification next to retrieval (open_clip's ImageNet top-1): the embedded shape
    # and colour classes beside the embedded data; any image folder, hub id or labelled builder.
    zeroshot_args.zeroshot_dataset, zeroshot_line = evaluation_source(
        "zeroshot_dataset", zeroshot_args.zeroshot_dataset, None, data_args.dataset_name,
        zeroshot_args.EMBEDDED_SETS[modality])
    evaluated.append(zeroshot_line)
    accelerator.print("evaluation: " + "; ".join(evaluated))
    if zeroshot_args.zeroshot_dataset:
        zeroshot = ZeroShotSet(zeroshot_args, tokenizer, processor, **ranks.reads(),
                               caption_length=captions, pad_to_max_length=pad_to_max_length,
                               audio_max_seconds=data_args.audio_max_seconds)
        held_out.append(lambda _: evaluate_zeroshot(model, zeroshot, accelerator.device))

    # A checkpoint also holds the config and image processor: compose takes it as a VLM's tower.
    layout = data_layout(data_args, args, ranks, batch_size=batch_size)
    saved_with = (accelerator.unwrap_model(model).config, processor)
    checkpoints = Checkpointer(accelerator, args, scheduler, accelerator.unwrap_model(model),
                               layout, ranks, saved_with=saved_with)
    # shared: run state
    # Once per optimizer step the ranks agree whether to apply it (finite loss and gradients) and
    # whether a preemption signal arrived (then: checkpoint and exit).
    guard = StepGuard(accelerator, model, optimizer, checkpoints, signals=args.preemption_signals,
                      max_skipped_steps=args.max_skipped_steps)
    start_step, resumed_epoch = checkpoints.open_run(args.resume_from_checkpoint, train_loader)
    batches = TrainBatches(train_loader, resumed_epoch)
    progress = tqdm(range(start_step, args.max_steps),
                    disable=not accelerator.is_local_main_process)

    config = tracker_config(model_args, data_args, args)
    accelerator.init_trackers(f"{model_args.loss}_pretrain", config)
    curves = [f"{modality}_to_text_R@1", f"text_to_{modality}_R@1", "zeroshot_top1"]  # model card
    # The data counters: bad rows by kind, and the rows of each source where there are several
    report = Report(accelerator, args, batches, data_args.counted(modality), guard=guard,
                    flops=batch_flops, total=checkpoints.resumed_totals, ranks=ranks,
                    evaluations=[Evaluation(held_out, curves=curves)])
    # Both take (image or audio embeds, text embeds, *the model's other outputs: scale, a bias)
    loss_fn = (siglip_loss if model_args.loss == "siglip"
               else partial(clip_loss, tile_size=args.loss_tile_size))
    # shared: loop head
    for step in progress:
        window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
        if step == start_step:  # a rank without rows says why, on every rank
            batches.check_rows(window, accelerator, ranks.data_world)
        report.add_batches(window)
        filler_batch = window[-1]  # any batch: what a rank with no eval rows left forwards

        if args.contrastive_accumulation == "feature_cache":
            # The window's micro-batches act as ONE contrastive batch (k*b negatives per row).
            window_losses = [grad_cache_backward(accelerator, model, window, loss_fn)]
        else:
            # Each micro-batch is its own contrastive batch (b negatives); the gradients add up.
            window_losses = []
            for batch in window:
                # Gradients are all-reduced only on the window's last micro-batch (no_sync before)
                with accelerator.accumulate(model):
                    loss = loss_fn(*model(**to_device(batch, accelerator.device)))
                    accelerator.backward(loss)
                window_losses.append(loss.detach())
        step_losses = torch.stack(window_losses)
        # shared: optimizer step
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # unclipped
        done = step + 1
        if guard.should_call_optimizer(step_losses, grad_norm, done):  # fused AdamW: always
            optimizer.step()  # under DeepSpeed the engine stepped inside accelerator.backward
            scheduler.step()
        optimizer.zero_grad()

        clamp_logit_scale_(accelerator, model)  # after a skipped step a no-op
        report.add_step(loss=step_losses.mean(), applied_steps=1)  # on the device

        if report.due(done):
            # The mean over ranks of the local losses is the global batch's (contrastive.losses)
            sums = report.close()
            report.log(done, {"loss": ratio(sums["loss"], sums["applied_steps"]),
                              "lr": scheduler.get_last_lr()[0]}, sums)
        # shared: evaluations
        report.evaluate(done, filler_batch)  # those due, each on its line
        # shared: save
        checkpoints.save_if_due(done, batches.epoch, guard, report)

    save_contrastive(accelerator, model, tokenizer, processor, args.output_dir)
    # shared: last evaluations
    # after the save: whatever they do, the trained model is kept
    report.evaluate_last(filler_batch)

    if accelerator.is_main_process:
        write_model_card(
            args.output_dir, report, pipeline_tag=f"zero-shot-{modality}-classification",
            base_model=model_args.model_name_or_path, datasets=[data_args.dataset_name],
            evaluated="; ".join(evaluated), tags=[model_args.loss, "contrastive"], engine=engine,
            seen=f"{report.total['samples']:,.0f} {modality}-text pairs", resumed_at=start_step)
    # shared: the end
    # Every rank leaves together: a rank that tore down its process group while rank 0 still wrote
    # the card aborted once under ZeRO-3 ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.print(f"saved model to {args.output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
