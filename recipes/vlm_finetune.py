"""Fine-tuning of any image-text-to-text model on mixed image-text / text-only conversations.

    accelerate launch recipes/vlm_finetune.py
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/vlm_finetune.py \
        recipes/configs/vlm_tiny.yaml
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/vlm_finetune.py \
        --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct --learning_rate 2.0e-5

With no arguments it fine-tunes a tiny Llava on the embedded shapes conversations (75% image
questions, 25% text-only) on a CPU; the output loads with `AutoModelForImageTextToText` and
`pipeline("image-text-to-text")`. It takes any image-text-to-text checkpoint with its own processor
and chat template (`--model_name_or_path`); `--use_peft true` trains LoRA adapters (TRL's flags). On
every engine a text-only micro-batch runs the vision step on a tiny dummy image, and the loss is the
exact token mean over the accumulation window on all ranks (docs/vlm.md). Data: LLaVA's JSON
(`--dataset_name json --data_files llava.json --image_folder images/`), `messages` + `images` rows.
"""

from dataclasses import dataclass
from functools import partial

from mmrecipes.benchmarks.arguments import BenchmarkArgs
from mmrecipes.config import checked, parse_args
from mmrecipes.vlm.arguments import ChatDataArgs, LoraArgs, MoEArgs, VLMModelArgs, VLMTrainingArgs


@dataclass
class TrainArgs(VLMTrainingArgs):
    output_dir: str = "outputs/vlm_finetune"
    max_steps: int = 500
    per_device_train_batch_size: int = 16
    # the tiny default from scratch; LLaVA stage 2 uses 2e-5, stage 1 1e-3
    learning_rate: float = 1.0e-3
    per_device_eval_batch_size: int = 64
    eval_steps: int = 200
    # held-out questions answered by greedy generation at each evaluation; 0: none
    eval_generation_rows: int = checked(64, "count_or_zero")
    # Ranks check before each module that they run the same one (a collective each; or
    # MMRECIPES_DEBUG_DIVERGENCE=1)
    debug_divergence: bool = False


# the flags and YAML keys this recipe takes
ARGUMENTS = (VLMModelArgs, LoraArgs, MoEArgs, ChatDataArgs, TrainArgs, BenchmarkArgs)
# shared: flags first
if __name__ == "__main__":
    parse_args(ARGUMENTS)  # --help and a bad flag answer here, before torch and the models load

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mmrecipes.benchmarks.harness import Benchmarks
from mmrecipes.checkpointing import Checkpointer, data_layout
from mmrecipes.distributed import DivergenceGuard, Ranks, engine_line, reconcile_deepspeed_config
from mmrecipes.images import to_device
from mmrecipes.loader import TrainBatches
from mmrecipes.model_card import write_model_card
from mmrecipes.reporting import Evaluation, Report, ratio, tracker_config
from mmrecipes.step_guard import StepGuard
from mmrecipes.training import (
    accelerator_from_args,
    adamw,
    compile_blocks,
    lr_scheduler,
    per_device_batch_size,
)
from mmrecipes.vlm.model.evaluation import BenchmarkAnswers, evaluate_answers, evaluate_generation
from mmrecipes.vlm.model.families import video_path
from mmrecipes.vlm.model.moe import LoadBalance
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.parts import vlm_parts
from mmrecipes.vlm.model.step import VLMForTraining, save_vlm
from mmrecipes.vlm.parallel.sequence_parallel import SequenceParallel
from mmrecipes.vlm.rows.chat_data import CHAT_COUNTED, build_chat_dataloader
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.held_out import generation_prompts
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.template_checks import check_template


def main(argv=None):
    model_args, lora_args, moe_args, data_args, args, bench_args = parse_args(ARGUMENTS, argv)
    set_seed(args.seed)
    # Before Accelerator(): under ZeRO-3 a model built afterwards is partitioned and re-initialised.
    vlm = vlm_parts(model_args, lora_args, seq_len=data_args.max_length // 2)  # what trains, FLOPs
    # clips no longer than the audio tower reads (Qwen2-Audio: 30 s)
    data_args.audio_max_seconds = vlm.clip_seconds(data_args.audio_max_seconds)
    model, processor = vlm.model, vlm.processor
    # The answer tokens of the checkpoint's own chat template, checked on a probe conversation now
    # (a template whose turns no rule finds would otherwise drop every row as no_target).
    # A model that hears (an audio tower, a feature extractor) trains on audio rows too.
    labeller = AnswerLabeller(processor, vlm.stops, videos=video_path(model, processor),
                              audio=vlm.hears, template=model_args.training_template(),
                              empty_think=data_args.empty_think_block,
                              template_kwargs=data_args.chat_template_kwargs)
    template_line = check_template(labeller, model_args.template_source(), data_args.max_length)
    if data_args.packing:  # samples kept apart in one sequence?
        vlm.check_packing(labeller)
    # shared: accelerator
    accelerator = accelerator_from_args(args)

    # shared: ranks
    # The rows each rank reads; --sequence_parallel_size splits each training sequence over that
    # many ranks, which read the same rows (Ulysses; evaluation reads whole sequences)
    split = SequenceParallel.of(accelerator, model, model_args.sequence_parallel_size, processor)
    ranks = Ranks.of(accelerator, split)
    batch_size = per_device_batch_size(args, ranks.data_world)
    accelerator.print(ranks.describe())

    # The step's output: the summed token CE, beside it a mixture of experts' balancing term
    balance = LoadBalance.of(model, moe_args, args.gradient_accumulation_steps, ranks)
    loss = LossSum(balance)

    if args.torch_compile:  # in place, before prepare wraps the model
        accelerator.print(compile_blocks(model))

    # shared: vlm log
    accelerator.print(template_line)
    accelerator.print(f"evaluation: {data_args.evaluation}")
    accelerator.print(vlm.describe())

    if balance.line:
        accelerator.print(balance.line)

    # shared: vlm optimizer
    optimizer = adamw(vlm.optimizer_groups(args), args)  # the tower, if it trains, at its own lr
    scheduler = lr_scheduler(optimizer, args)

    # shared: deepspeed
    reconcile_deepspeed_config(accelerator, train_micro_batch_size_per_gpu=batch_size,
                               gradient_accumulation_steps=args.gradient_accumulation_steps,
                               gradient_clipping=args.max_grad_norm)

    # shared: vlm prepare
    # The wrapper is what the engine wraps: the dummy's features must enter the loss inside it.
    model, optimizer = accelerator.prepare(VLMForTraining(model, ranks.split), optimizer)

    engine = engine_line(accelerator, model)
    accelerator.print(engine)
    divergence_guard = DivergenceGuard.if_requested(args.debug_divergence, accelerator, model,
                                                    compiled=args.torch_compile,
                                                    timeout_s=args.ddp_timeout)

    # Each data rank reads its own rows, so the loaders are not passed to accelerator.prepare.
    # --max_tokens_per_batch: each micro-batch holds whole rows up to that many tokens (a rank's:
    # split over N ranks, N times as many); --packing: they form one sequence without padding
    # (mmrecipes.vlm.rows.packing). Evaluation: fixed batches.
    pack_length = min(data_args.max_length, data_args.max_tokens_per_batch or data_args.max_length)
    pad = processor.tokenizer.pad_token_id
    collator = ChatCollator(pad, vlm.dummy_inputs, data_args.packing, pack_length)
    loader_kwargs = dict(labeller=labeller, ranks=ranks)
    train_loader = build_chat_dataloader(data_args, collator=collator, batch_size=batch_size,
                                         shuffle_seed=args.seed, **loader_kwargs)
    held_out = []  # teacher-forced and generated held-out answers
    if data_args.eval_dataset_name:
        eval_collator = ChatCollator(pad, vlm.dummy_inputs)
        eval_loader = build_chat_dataloader(data_args, collator=eval_collator, eval_split=True,
                                            batch_size=args.per_device_eval_batch_size,
                                            **loader_kwargs)
        prompts = generation_prompts(data_args, processor, rows=args.eval_generation_rows,
                                     ranks=ranks, hears=labeller.audio_token_id is not None)
        held_out = [partial(evaluate_answers, model, eval_loader, device=accelerator.device),
                    partial(evaluate_generation, model, prompts, collator=eval_collator,
                            tokenizer=processor.tokenizer, stop_token_ids=vlm.stops,
                            device=accelerator.device, placeholders=vlm.placeholders)]

    # shared: benchmarks
    # Standard benchmarks scored as lmms-eval scores them, each rank answering its stride of the
    # documents
    benchmarks = Benchmarks(bench_args, **ranks.reads(evaluation=True)).evaluation(
        BenchmarkAnswers(model, vlm, accelerator.device, data_args.chat_template_kwargs),
        say=accelerator.print)

    # shared: vlm checkpoints
    layout = data_layout(data_args, args, ranks, batch_size=batch_size)
    checkpoints = Checkpointer(accelerator, args, scheduler, accelerator.unwrap_model(model),
                               layout, ranks)

    # shared: run state
    # Once per optimizer step the ranks agree whether to apply it (finite loss and gradients) and
    # whether a preemption signal arrived (then: checkpoint and exit).
    guard = StepGuard(accelerator, model, optimizer, checkpoints, signals=args.preemption_signals,
                      max_skipped_steps=args.max_skipped_steps)
    start_step, resumed_epoch = checkpoints.open_run(args.resume_from_checkpoint, train_loader)
    batches = TrainBatches(train_loader, resumed_epoch)
    progress = tqdm(range(start_step, args.max_steps),
                    disable=not accelerator.is_local_main_process)

    config = tracker_config(model_args, lora_args, data_args, args, bench_args)
    accelerator.init_trackers("vlm_finetune", config)
    curves = ["answer_accuracy", "generated_accuracy"]  # the held-out scores in the model card
    report = Report(accelerator, args, batches, CHAT_COUNTED, guard=guard, flops=vlm.flops,
                    total=checkpoints.resumed_totals, ranks=ranks, formats=balance.FORMATS,
                    evaluations=[Evaluation(held_out, curves=curves), benchmarks])

    # shared: loop head
    for step in progress:
        window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
        if step == start_step:  # a rank without rows says why, on every rank
            batches.check_rows(window, accelerator, ranks.data_world)
        report.add_batches(window)
        filler_batch = window[-1]  # any batch: what a rank with no eval rows left forwards

        # One collective per optimizer step: the window's target tokens N on all ranks, a
        # sequence-parallel group's counted once (its ranks hold the same rows).
        local_tokens = torch.tensor(float(sum(batch["target_tokens"] for batch in window)))
        loss_scale = ranks.loss_scale(local_tokens, args.gradient_accumulation_steps)
        window_ce = []
        balance.start_window(model, window, accelerator.device)  # the global scope's expert counts
        for batch in window:
            with accelerator.accumulate(model):  # gradients all-reduced on the last micro-batch
                summed, extra = model(to_device(batch, accelerator.device), loss)
                accelerator.backward(summed * loss_scale + extra)  # extra: the balance's term, or 0
            window_ce.append(summed.detach())
        step_losses = torch.stack(window_ce)
        # shared: optimizer step
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # unclipped
        done = step + 1
        if guard.should_call_optimizer(step_losses, grad_norm, done):  # fused AdamW: always
            optimizer.step()  # under DeepSpeed the engine stepped inside accelerator.backward
            scheduler.step()
        optimizer.zero_grad()

        report.add_step(ce=sum(window_ce), target_tokens=local_tokens,
                        **balance.window_sums())

        if report.due(done):
            sums = report.close()
            report.log(done, {"loss": ratio(sums["ce"], sums["target_tokens"]),
                              **balance.metrics(sums),
                              "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0]},
                       sums)
        # shared: evaluations
        report.evaluate(done, filler_batch)  # those due, each on its line
        # shared: save
        checkpoints.save_if_due(done, batches.epoch, guard, report)

    save_vlm(accelerator, model, processor, args.output_dir, vlm.peft_config)
    # shared: last evaluations
    # after the save: whatever they do, the trained model is kept
    report.evaluate_last(filler_batch)

    seen = f"{report.total['samples']:,.0f} conversations, {report.total['tokens']:,.0f} tokens"
    tags = ["vlm", "lora" if vlm.peft_config else "full fine-tune", type(vlm.model).__name__]
    # shared: vlm model card
    if accelerator.is_main_process:
        write_model_card(args.output_dir, report, pipeline_tag="image-text-to-text", tags=tags,
                         seen=seen, base_model=model_args.model_name_or_path, engine=engine,
                         resumed_at=start_step, datasets=data_args.dataset_name.split(","),
                         evaluated=data_args.evaluation,
                         template_kwargs=data_args.chat_template_kwargs)

    if divergence_guard is not None:
        divergence_guard.remove()
    # shared: the end
    # Every rank leaves together: a rank that tore down its process group while rank 0 still wrote
    # the card aborted once under ZeRO-3 ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.print(f"saved model to {args.output_dir}")
    accelerator.end_training()

if __name__ == "__main__":
    main()
