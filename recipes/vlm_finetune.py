"""Fine-tuning of any image-text-to-text model on mixed image-text / text-only conversations with Accelerate.

    accelerate launch recipes/vlm_finetune.py
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/vlm_finetune.py recipes/configs/vlm_tiny.yaml
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/vlm_finetune.py \
        --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct --learning_rate 2.0e-5

With no arguments it fine-tunes a tiny Llava on the embedded shapes conversations (75% image questions, 25% text-only)
on a CPU; the output loads with `AutoModelForImageTextToText` and `pipeline("image-text-to-text")`. It takes any
image-text-to-text checkpoint with its own processor and chat template (`--model_name_or_path`); `--use_peft true`
trains LoRA adapters (TRL's flags). On every engine a text-only micro-batch runs the vision step on a tiny dummy image,
and the loss is the exact token mean over the accumulation window on all ranks (docs/vlm.md). Data: LLaVA format
(`--dataset_name json --data_files llava.json --image_folder images/`) or `messages` + `images` (+ `videos`) rows.
"""

from dataclasses import asdict, dataclass

from mmrecipes.arguments import ChatDataArgs, LoraArgs, TrainingArgs, VLMModelArgs
from mmrecipes.config import parse_args


@dataclass
class TrainArgs(TrainingArgs):
    CHECKS = TrainingArgs.CHECKS | {"vision_tower_learning_rate": "learning_rate", "eval_generation_rows":
                                    "count_or_zero", "vision_tower_weight_decay": "non_negative"}
    output_dir: str = "outputs/vlm_finetune"
    max_steps: int = 500
    per_device_train_batch_size: int = 16
    learning_rate: float = 1.0e-3  # the tiny default from scratch; LLaVA stage 2 uses 2e-5, stage 1 1e-3
    vision_tower_learning_rate: float = 2.0e-6  # used when --train_modules all
    # 0 keeps AdamW from decaying the tower on steps where it only saw a dummy image (zero gradient)
    vision_tower_weight_decay: float = 0.0
    weight_decay: float = 0.0
    per_device_eval_batch_size: int = 64
    eval_steps: int = 200
    eval_generation_rows: int = 64  # held-out questions answered by greedy generation at each evaluation; 0: none
    # Ranks check before each module that they run the same one (a collective each; or MMRECIPES_DEBUG_DIVERGENCE=1)
    debug_divergence: bool = False


ARGUMENTS = (VLMModelArgs, LoraArgs, ChatDataArgs, TrainArgs)  # the flags and YAML keys this recipe takes
if __name__ == "__main__":
    parse_args(ARGUMENTS)  # --help and a bad flag answer here, before torch and the models load

import time

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mmrecipes.chat_collate import DummyImageCollator, chat_model_inputs, check_packing
from mmrecipes.chat_data import CHAT_COUNTED, build_chat_dataloader, generation_prompts
from mmrecipes.chat_labels import AnswerLabeller, check_template
from mmrecipes.checkpointing import Checkpointer, data_layout
from mmrecipes.distributed import (
    DivergenceGuard,
    data_parallel_rank_and_world,
    engine_line,
    reconcile_deepspeed_config,
    sum_over_ranks,
)
from mmrecipes.evaluation import evaluate_answers, evaluate_generation
from mmrecipes.loader import batches_forever, no_rows_error
from mmrecipes.lora import add_lora, describe_trainable
from mmrecipes.losses import token_loss_scale
from mmrecipes.metrics import LogWindow, eval_line, log_line
from mmrecipes.model_card import History, write_model_card
from mmrecipes.step_guard import StepGuard
from mmrecipes.throughput import peak_flops, vlm_train_flops
from mmrecipes.training import (
    accelerator_from_args,
    adamw,
    compile_blocks,
    lr_scheduler,
    per_device_batch_size,
)
from mmrecipes.vlm import VLMForTraining, apply_train_modules, load_vlm, save_vlm, stop_token_ids
from mmrecipes.vlm_families import dummy_image_inputs, image_patches, module_groups, optimizer_groups, video_path


def main(argv=None):
    model_args, lora_args, data_args, args = parse_args(ARGUMENTS, argv)
    set_seed(args.seed)
    # Before Accelerator(): under ZeRO-3 a model built afterwards is partitioned and re-initialised.
    model, processor = load_vlm(model_args)
    # The answer tokens of the checkpoint's own chat template, checked on a probe conversation now
    # (a template whose turns no rule finds would otherwise drop every row as no_target).
    stops = stop_token_ids(model, processor)
    labeller = AnswerLabeller(processor, stops, videos=video_path(model, processor))  # None: video rows counted
    template_line = check_template(labeller, model_args.chat_template_path or model_args.model_name_or_path
                                   or model_args.tokenizer_name, data_args.max_length)
    dummy_inputs = dummy_image_inputs(model, processor)
    groups = module_groups(model, dummy_inputs)  # one dummy backward: vision tower, projector, language model
    trainable = apply_train_modules(groups, model_args.train_modules)  # unreached ones frozen: DDP would wait for them
    peft_config = None
    if lora_args.use_peft:  # adapters injected into `model` itself; everything but them and the projector frozen
        peft_model, trainable = add_lora(model, groups, model_args.train_modules, lora_args)
        peft_config = peft_model.peft_config["default"]
    if model_args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if data_args.packing:
        check_packing(VLMForTraining(model), labeller, dummy_inputs)  # samples kept apart in one sequence
    if not model.get_input_embeddings().weight.requires_grad:
        # A frozen embedding (LoRA, the projector preset) gives a text-only batch an LM input without grad: its
        # backward would skip the LM where an image batch's runs through it, so ZeRO-3 and FSDP2 ranks would
        # gather different parameters (and checkpointed layers would get no gradients).
        model.enable_input_require_grads()
    # Counted now: after prepare, ZeRO-3 parameters are partitioned and report numel() == 0.
    flops_per_token, flops_per_patch = vlm_train_flops(
        model, sum(p.numel() for _, p in groups.vision_tower), seq_len=data_args.max_length // 2,
        lm_weights_train="language_model" in trainable and peft_config is None,
        vision_trains="vision_tower" in trainable)
    vision_config = model.config.vision_config  # the patch count per batch reads it
    accelerator = accelerator_from_args(args)
    data_rank, data_world = data_parallel_rank_and_world(accelerator)
    batch_size = per_device_batch_size(args, data_world)
    if args.torch_compile:  # in place, before prepare wraps the model
        if DivergenceGuard.requested(args.debug_divergence):
            raise ValueError("--debug_divergence checks every module call from Python, which compiled blocks skip: "
                             "drop --torch_compile while you debug")
        accelerator.print(compile_blocks(model))
    accelerator.print(template_line)
    accelerator.print(f"evaluation: {data_args.evaluation}")
    accelerator.print(groups.describe())
    accelerator.print(describe_trainable(model))
    if groups.unreached:
        accelerator.print(f"froze {len(groups.unreached)} parameters no forward path reaches: "
                          + ", ".join(groups.unreached))

    # Frozen parameters are not in the optimizer (no state); the tower, if it trains, has its own lr.
    optimizer = adamw(optimizer_groups(trainable, args), args)
    scheduler = lr_scheduler(optimizer, args)
    reconcile_deepspeed_config(accelerator, train_micro_batch_size_per_gpu=batch_size,
                               gradient_accumulation_steps=args.gradient_accumulation_steps,
                               gradient_clipping=args.max_grad_norm)
    # The wrapper is what the engine wraps: the dummy's features must enter the loss inside it.
    model, optimizer = accelerator.prepare(VLMForTraining(model), optimizer)
    engine = engine_line(accelerator, model)
    accelerator.print(engine)
    divergence_guard = None  # after prepare: its hooks run before the engine's
    if DivergenceGuard.requested(args.debug_divergence):
        divergence_guard = DivergenceGuard(accelerator.unwrap_model(model), timeout_s=args.ddp_timeout)
        accelerator.print("divergence guard on: the ranks compare every module call")

    # Each data rank reads its own rows, so the loaders are not passed to accelerator.prepare.
    # With --max_tokens_per_batch each micro-batch holds whole rows up to that many tokens; with --packing
    # they form one sequence without padding (mmrecipes.packing). Evaluation keeps fixed, padded batches.
    pack_length = min(data_args.max_length, data_args.max_tokens_per_batch or data_args.max_length)
    collator = DummyImageCollator(processor.tokenizer.pad_token_id, dummy_inputs, data_args.packing, pack_length)
    loader_kwargs = dict(labeller=labeller, data_rank=data_rank, data_world=data_world)
    train_loader = build_chat_dataloader(data_args, collator=collator, batch_size=batch_size, shuffle_seed=args.seed,
                                         **loader_kwargs)
    eval_loader = None
    if data_args.eval_dataset_name:
        eval_collator = DummyImageCollator(processor.tokenizer.pad_token_id, dummy_inputs)
        eval_loader = build_chat_dataloader(data_args, collator=eval_collator, eval_split=True,
                                            batch_size=args.per_device_eval_batch_size, **loader_kwargs)
        prompts = generation_prompts(data_args, processor, rows=-(-args.eval_generation_rows // data_world),
                                     data_rank=data_rank, data_world=data_world)

    checkpoints = Checkpointer(accelerator, args, scheduler, accelerator.unwrap_model(model),
                               data_layout(data_args, args, data_world=data_world, batch_size=batch_size))
    # Once per optimizer step the ranks agree whether to apply it (finite loss and gradients) and
    # whether a preemption signal arrived (then: checkpoint and exit).
    guard = StepGuard(accelerator, model, optimizer, checkpoints, signals=args.preemption_signals,
                      max_skipped_steps=args.max_skipped_steps)
    start_step, resumed_epoch = checkpoints.resume(args.resume_from_checkpoint, train_loader)
    train_batches = batches_forever(train_loader, resumed_epoch)

    accelerator.init_trackers("vlm_finetune", asdict(model_args) | asdict(lora_args) | asdict(data_args) | asdict(args))
    peak = peak_flops(args.peak_tflops)
    progress = tqdm(range(start_step, args.max_steps), disable=not accelerator.is_local_main_process)
    log = tqdm.write if accelerator.is_main_process else lambda line: None  # lines that keep the bar intact
    logged, history = LogWindow(accelerator.device, CHAT_COUNTED, checkpoints.resumed_totals), History()  # window sums
    for step in progress:
        epochs, window = zip(*(logged.next(train_batches) for _ in range(args.gradient_accumulation_steps)))
        targets = [batch["target_tokens"] if batch is not None else 0 for batch in window]  # counted by the collator
        # One collective per optimizer step: the window's target tokens N on all ranks, and whether
        # any rank ran out of data (then every rank stops here with the same error, not a hang).
        # Every epoch reads the same rows, so that is read on the host at the first step only.
        local = torch.tensor([sum(targets), sum(batch is None for batch in window)], device=accelerator.device)
        window_tokens, empty = sum_over_ranks(local.float())
        if step == start_step and empty:  # the rank without rows says why
            raise no_rows_error(train_loader, data_world, bool(local[1]))
        loss_scale = token_loss_scale(window_tokens, args.gradient_accumulation_steps, data_world)
        window_ce = []
        for batch in window:
            # Gradients are all-reduced only on the last micro-batch of the window (no_sync before it).
            with accelerator.accumulate(model):
                loss_sum, _ = model(**chat_model_inputs(batch, accelerator.device))
                accelerator.backward(loss_sum * loss_scale)
            window_ce.append(loss_sum.detach())
            logged.add(samples=batch["num_samples"], tokens=batch["num_tokens"],
                       patches=image_patches(batch, vision_config),
                       dummy_image_batches=batch["dummy_image"], data_counts=batch["data_counts"])
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # before clipping
        done = step + 1
        if guard.should_call_optimizer(torch.stack(window_ce), grad_norm, done):  # a fused AdamW is always called
            optimizer.step()  # under DeepSpeed the engine already stepped inside accelerator.backward
            scheduler.step()
        logged.add_applied(guard.applied, ce=sum(window_ce), target_tokens=local[0])  # on the device
        optimizer.zero_grad()
        filler_batch = window[-1]  # any valid batch: what a rank with no eval rows left forwards

        if done % args.logging_steps == 0 or done == args.max_steps:
            sums, ranks = logged.close(), accelerator.num_processes
            flops = sums["tokens"] * flops_per_token + sums["patches"] * flops_per_patch
            metrics = {"loss": sums["ce"] / sums["target_tokens"] if sums["target_tokens"] else float("nan"),
                       "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                       "samples_per_s": sums["samples"] / sums["seconds"],
                       "tokens_per_s": sums["tokens"] / sums["seconds"],
                       "mfu": flops / sums["seconds"] / (peak * ranks) if peak else None,
                       "data_wait": sums["data_wait"] / ranks / sums["seconds"],
                       "dummy_image_batches": int(sums["dummy_image_batches"]), "skipped_steps": guard.skipped_steps}
            metrics |= {name: int(logged.total[name]) for name in CHAT_COUNTED}  # so far
            accelerator.log(metrics, step=done)
            history.add(done, metrics)
            log(log_line(done, args.max_steps, metrics))
        if eval_loader is not None and (done % args.eval_steps == 0 or done == args.max_steps):
            eval_start = time.perf_counter()
            accuracy = evaluate_answers(model, eval_loader, filler_batch, accelerator.device)
            accuracy |= evaluate_generation(model, prompts, filler_batch, eval_collator, processor.tokenizer, stops,
                                            accelerator.device)
            logged.pause(time.perf_counter() - eval_start)  # samples/s measures training only
            if accuracy:
                accelerator.log(accuracy, step=done)
                history.add(done, accuracy, evaluation=True)
                log(eval_line(done, accuracy))
        if done < args.max_steps and (guard.stop_requested or args.save_steps and done % args.save_steps == 0):
            checkpoint = checkpoints.save(done, epochs[-1], logged.totals_so_far())
            if guard.stop_requested:
                guard.exit_preempted(checkpoint)  # exit code 75 on every rank: run the same command again

    save_vlm(accelerator, model, processor, args.output_dir, peft_config)
    if accelerator.is_main_process:
        write_model_card(
            args.output_dir, history, pipeline_tag="image-text-to-text",
            eval_metrics=["answer_accuracy", "generated_accuracy"], base_model=model_args.model_name_or_path,
            datasets=data_args.dataset_name.split(","), evaluated=data_args.evaluation,
            tags=["vlm", "lora" if peft_config else "full fine-tune",
                  type(accelerator.unwrap_model(model).model).__name__],
            engine=engine, resumed_at=start_step,
            seen=f"{int(logged.total['samples']):,} conversations, {int(logged.total['tokens']):,} tokens")
    # Every rank leaves together: a rank that tore down its process group while rank 0 still wrote
    # the card aborted once under ZeRO-3 ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    if divergence_guard is not None:
        divergence_guard.remove()
    accelerator.print(f"saved model to {args.output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
