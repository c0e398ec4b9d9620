"""On-policy distillation (GKD) of an image-text-to-text model from a larger one of its vocabulary.

    accelerate launch recipes/vlm_distill.py
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/vlm_distill.py \
        --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct --learning_rate 1.0e-6 \
        --teacher_model_name_or_path Qwen/Qwen2.5-VL-7B-Instruct --max_completion_length 512

Each step the student (--model_name_or_path) learns the frozen teacher's next-token distribution,
token by token: on its own samples of the prompts with probability --lmbda (on-policy, GRPO's
seeded samplers: W ranks sample what one process does), else on the dataset's answers (--seq_kd:
on the teacher's samples). The divergence is TRL's generalised JSD (--beta 0: forward KL, 1:
reverse KL), computed slice by slice through both output layers, so neither model's logits of a
batch exist whole, and normalised over the step's target tokens on every rank. The teacher is
kept as the engine keeps the student: sharded (FSDP2), partitioned (ZeRO-3), whole (DDP). Prompts
in the layouts GRPO reads; a chat row's last answer or a prompt row's `solution` is the dataset's
answer (docs/distill.md). With no arguments: the tiny SFT'd Llava learns from a wider one.
"""

from dataclasses import dataclass
from functools import partial

from mmrecipes.benchmarks.arguments import BenchmarkArgs
from mmrecipes.config import parse_args
from mmrecipes.vlm.arguments import (
    DistillArgs,
    LoraArgs,
    PromptDataArgs,
    TunedModelArgs,
    VLMTrainingArgs,
)


@dataclass
class TrainArgs(VLMTrainingArgs):
    output_dir: str = "outputs/vlm_distill"
    max_steps: int = 150
    per_device_train_batch_size: int = 16  # prompts
    # for the tiny SFT'd default; TRL's default for real models is 1e-6
    learning_rate: float = 3.0e-4
    warmup_steps: int = 0
    per_device_eval_batch_size: int = 64
    eval_steps: int = 50


# the flags and YAML keys it takes
ARGUMENTS = (TunedModelArgs, LoraArgs, PromptDataArgs, DistillArgs, TrainArgs, BenchmarkArgs)
# shared: flags first
if __name__ == "__main__":
    parse_args(ARGUMENTS)  # --help and a bad flag answer here, before torch and the models load

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mmrecipes.benchmarks.harness import Benchmarks
from mmrecipes.checkpointing import Checkpointer, data_layout
from mmrecipes.distributed import Ranks, engine_line, reconcile_deepspeed_config
from mmrecipes.images import to_device
from mmrecipes.loader import TrainBatches
from mmrecipes.model_card import write_model_card
from mmrecipes.reporting import Evaluation, Report, ratio, tracker_config
from mmrecipes.step_guard import StepGuard
from mmrecipes.training import accelerator_from_args, adamw, lr_scheduler, per_device_batch_size
from mmrecipes.vlm.algorithms.distill import StepTargets, evaluate_divergence
from mmrecipes.vlm.algorithms.sampling import Sampler
from mmrecipes.vlm.algorithms.teacher import Teacher
from mmrecipes.vlm.model.evaluation import BenchmarkAnswers, evaluate_answers, evaluate_generation
from mmrecipes.vlm.model.loading import check_trainable
from mmrecipes.vlm.model.outputs import GeneralizedJSD
from mmrecipes.vlm.model.parts import vlm_parts
from mmrecipes.vlm.model.step import VLMForTraining, save_vlm
from mmrecipes.vlm.parallel.sequence_parallel import SequenceParallel
from mmrecipes.vlm.rows.chat_data import CHAT_COUNTED, build_chat_dataloader
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.held_out import generation_prompts
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.prompts import DistillCollator, DistillPreprocessor
from mmrecipes.vlm.rows.template_checks import check_generation_prompt, check_template


def main(argv=None):
    model_args, lora_args, data_args, distill_args, args, bench_args = parse_args(ARGUMENTS, argv)
    # the teacher's folder and config checked before either model loads
    check_trainable(distill_args.teacher_model_name_or_path, "--teacher_model_name_or_path")
    set_seed(args.seed)
    # Before Accelerator(): under ZeRO-3 a model built afterwards is partitioned and re-initialised.
    vlm = vlm_parts(model_args, lora_args, seq_len=data_args.max_length // 2)
    # clips no longer than the audio tower reads (Qwen2-Audio: 30 s)
    data_args.audio_max_seconds = vlm.clip_seconds(data_args.audio_max_seconds)
    model, processor = vlm.model, vlm.processor
    # The teacher, checked now against the student's vocabulary and chat template (logits compared
    # entry by entry); it reads rows of its own where its processor writes images otherwise
    teacher = Teacher.load(distill_args.teacher_model_name_or_path, model, processor,
                           model_args.attn_implementation, distill_args.seq_kd,
                           data_args.chat_template_kwargs)
    # the dataset's answers: off-policy targets; the rows' clips where student and teacher hear
    labeller = AnswerLabeller(processor, vlm.stops, audio=vlm.hears and teacher.hears,
                              empty_think=data_args.empty_think_block,
                              template_kwargs=data_args.chat_template_kwargs)
    source = model_args.template_source()
    template_line = check_template(labeller, source, data_args.max_length)
    template_line += "\n" + check_generation_prompt(labeller, source)  # what the samples follow

    # shared: accelerator
    accelerator = accelerator_from_args(args)

    # shared: ranks
    # The rows each rank reads; --sequence_parallel_size splits each training sequence over that
    # many ranks, which read the same rows (Ulysses; evaluation reads whole sequences)
    split = SequenceParallel.of(accelerator, model, model_args.sequence_parallel_size, processor)
    ranks = Ranks.of(accelerator, split)
    batch_size = per_device_batch_size(args, ranks.data_world)
    accelerator.print(ranks.describe())

    # shared: vlm log
    accelerator.print(template_line)
    accelerator.print(f"evaluation: {data_args.evaluation}")
    accelerator.print(vlm.describe())

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

    teacher.prepare(accelerator)  # sharded, partitioned or whole, as the student; never split
    engine = engine_line(accelerator, model)
    accelerator.print(engine)
    accelerator.print(teacher.describe())
    chat_collator = ChatCollator(processor.tokenizer.pad_token_id, vlm.dummy_inputs)
    sampler = Sampler(accelerator, chat_collator, distill_args, vlm.stops, vlm.placeholders)
    accelerator.print(sampler.describe())
    # Each step's targets, the same choice on every rank: the student's samples (--lmbda), the
    # teacher's (--seq_kd) or the dataset's answers; each prompt sampled from a seed of its own
    targets = StepTargets(sampler, teacher, distill_args, args.seed)
    divergence = GeneralizedJSD(teacher.head_logits, beta=distill_args.beta,
                                temperature=distill_args.temperature)

    # Each data rank reads its own rows: a prompt and the dataset's answer after it (and the
    # prompt as the teacher's processor writes it, where it writes images otherwise)
    loader_kwargs = dict(labeller=labeller, ranks=ranks,
                         collator=DistillCollator(chat_collator), preprocessor=DistillPreprocessor,
                         preprocessor_kwargs=dict(teacher_processor=teacher.own_processor))
    train_loader = build_chat_dataloader(data_args, batch_size=batch_size, shuffle_seed=args.seed,
                                         **loader_kwargs)
    eval_loader, held_out, rows = None, [], data_args.eval_generation_rows
    if data_args.eval_dataset_name:
        eval_loader = build_chat_dataloader(data_args, eval_split=True,
                                            batch_size=args.per_device_eval_batch_size,
                                            **loader_kwargs)
        held_out = generation_prompts(data_args, processor, rows=rows, ranks=ranks)

    # shared: benchmarks
    # Standard benchmarks scored as lmms-eval scores them, each rank answering its stride of the
    # documents
    benchmarks = Benchmarks(bench_args, **ranks.reads(evaluation=True)).evaluation(
        BenchmarkAnswers(model, vlm, accelerator.device, data_args.chat_template_kwargs),
        say=accelerator.print)

    data = data_layout(data_args, args, ranks, batch_size=batch_size)
    checkpoints = Checkpointer(accelerator, args, scheduler, accelerator.unwrap_model(model), data,
                               ranks)
    # shared: run state
    # Once per optimizer step the ranks agree whether to apply it (finite loss and gradients) and
    # whether a preemption signal arrived (then: checkpoint and exit).
    guard = StepGuard(accelerator, model, optimizer, checkpoints, signals=args.preemption_signals,
                      max_skipped_steps=args.max_skipped_steps)
    start_step, resumed_epoch = checkpoints.open_run(args.resume_from_checkpoint, train_loader)
    batches = TrainBatches(train_loader, resumed_epoch)
    progress = tqdm(range(start_step, args.max_steps),
                    disable=not accelerator.is_local_main_process)

    config = tracker_config(model_args, lora_args, data_args, distill_args, args, bench_args)
    accelerator.init_trackers("vlm_distill", config)

    def evaluate(filler: dict, teacher_too: bool = False) -> dict:  # held-out scores
        answers = (batch["answers"] for batch in eval_loader)
        scores = evaluate_answers(model, answers, filler["answers"], accelerator.device)
        scores |= evaluate_generation(model, held_out, filler["answers"], chat_collator,
                                      processor.tokenizer, vlm.stops, accelerator.device,
                                      vlm.placeholders)
        scores |= evaluate_divergence(model, teacher, eval_loader, filler, accelerator.device,
                                      divergence)
        if teacher_too:  # its generated accuracy on the same questions
            scores |= teacher.generated_accuracy(data_args, rows, ranks)
        return scores

    held_out_parts = [evaluate] if eval_loader is not None else []
    at_start = [partial(evaluate, teacher_too=True)] if eval_loader is not None else []
    curves = ["generated_accuracy", "answer_accuracy", "divergence"]  # in the model card
    evaluations = [Evaluation(at_start, at_start=True), Evaluation(held_out_parts, curves=curves),
                   benchmarks]
    report = Report(accelerator, args, batches, CHAT_COUNTED, guard=guard, flops=vlm.flops,
                    total=checkpoints.resumed_totals, ranks=ranks, formats=targets.FORMATS,
                    evaluations=evaluations)

    # shared: loop head
    for step in progress:
        window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
        if step == start_step:  # a rank without rows says why, on every rank
            batches.check_rows(window, accelerator, ranks.data_world)
        report.add_batches(window)
        filler_batch = window[-1]  # any batch: what a rank with no eval rows left forwards

        report.evaluate(step, filler_batch, before_step=True)  # step 0: the student, the teacher
        micro_batches = targets(model, window, step)
        report.add_batches([], trained=micro_batches)
        # One collective per optimizer step: the window's target tokens N on all ranks
        local_tokens = torch.tensor(float(sum(batch["target_tokens"] for batch in micro_batches)))
        loss_scale = ranks.loss_scale(local_tokens, args.gradient_accumulation_steps)
        window_divergence = []
        for batch, read in zip(micro_batches, window):
            with accelerator.accumulate(model):
                inputs = to_device(batch, accelerator.device)
                inputs["teacher_hidden"] = teacher.hidden(inputs, read["prompts"])  # no graph
                summed = model(inputs, divergence)
                accelerator.backward(summed * loss_scale)
            window_divergence.append(summed.detach())
        step_losses = torch.stack(window_divergence)
        # shared: optimizer step
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # unclipped
        done = step + 1
        if guard.should_call_optimizer(step_losses, grad_norm, done):  # fused AdamW: always
            optimizer.step()  # under DeepSpeed the engine stepped inside accelerator.backward
            scheduler.step()
        optimizer.zero_grad()

        report.add_step(divergence=sum(window_divergence),
                        target_tokens=local_tokens, **targets.sums())

        if report.due(done):
            sums = report.close()
            report.log(done, {"loss": ratio(sums["divergence"], sums["target_tokens"]),
                              "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                              **targets.metrics(sums, ranks.data_world)}, sums)
        # shared: evaluations
        report.evaluate(done, filler_batch)  # those due, each on its line
        # shared: save
        checkpoints.save_if_due(done, batches.epoch, guard, report)

    save_vlm(accelerator, model, processor, args.output_dir, vlm.peft_config)
    # shared: last evaluations
    # after the save: whatever they do, the trained model is kept
    report.evaluate_last(filler_batch)

    seen = (f"{report.total['samples']:,.0f} prompts, {report.total['tokens']:,.0f} tokens, "
            f"teacher {distill_args.teacher_model_name_or_path}")
    tags = ["vlm", "distillation", "lora" if vlm.peft_config else "full fine-tune",
            type(vlm.model).__name__]
    # shared: vlm model card
    if accelerator.is_main_process:
        write_model_card(args.output_dir, report, pipeline_tag="image-text-to-text", tags=tags,
                         seen=seen, base_model=model_args.model_name_or_path, engine=engine,
                         resumed_at=start_step, datasets=data_args.dataset_name.split(","),
                         evaluated=data_args.evaluation,
                         template_kwargs=data_args.chat_template_kwargs)

    # shared: the end
    # Every rank leaves together: a rank that tore down its process group while rank 0 still wrote
    # the card aborted once under ZeRO-3 ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.print(f"saved model to {args.output_dir}")
    accelerator.end_training()

if __name__ == "__main__":
    main()
