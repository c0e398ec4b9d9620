"""Preference tuning (DPO) of any image-text-to-text model with Accelerate.

    accelerate launch recipes/vlm_dpo.py
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/vlm_dpo.py \
        --use_peft true
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/vlm_dpo.py \
        --model_name_or_path <your SFT output> --dataset_name <pairs> --learning_rate 5.0e-7

With no arguments it tunes a tiny Llava from scratch on the embedded preference pairs (shapes
questions: the right answer chosen, a wrong colour, shape or count rejected; 20% text-only) on a
CPU, and raises its reward accuracy on held-out pairs; the output loads with
`AutoModelForImageTextToText` and `pipeline("image-text-to-text")`. Data: TRL's
`prompt`/`chosen`/`rejected` rows (strings or conversations, with `images`), or LLaVA JSON with
`chosen` and `rejected` answers. The reference is the policy with its LoRA adapters disabled
(`--use_peft true`), or a frozen copy the engine shards like the policy. Both sides of a pair run
in one forward, a text-only batch with the dummy image (as vlm_finetune.py), and the loss is the
exact mean over the window's pairs on every rank (docs/dpo.md).
"""

from dataclasses import dataclass, replace
from functools import partial

from mmrecipes.benchmarks.arguments import BenchmarkArgs
from mmrecipes.config import parse_args
from mmrecipes.vlm.arguments import (
    DPOArgs,
    LoraArgs,
    PreferenceDataArgs,
    VLMModelArgs,
    VLMTrainingArgs,
)


@dataclass
class TrainArgs(VLMTrainingArgs):
    output_dir: str = "outputs/vlm_dpo"
    max_steps: int = 300
    per_device_train_batch_size: int = 16  # pairs
    # the tiny default from scratch; TRL's DPO default for real models is 1e-6
    learning_rate: float = 1.0e-3
    per_device_eval_batch_size: int = 64
    eval_steps: int = 100


# the flags and YAML keys it takes
ARGUMENTS = (VLMModelArgs, LoraArgs, PreferenceDataArgs, DPOArgs, TrainArgs, BenchmarkArgs)
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
from mmrecipes.vlm.algorithms.preference import (
    DPO_FORMATS,
    PREFERENCE_COUNTED,
    PreferenceCollator,
    PreferencePreprocessor,
    answer_tokens,
    dpo_loss,
    evaluate_preferences,
)
from mmrecipes.vlm.algorithms.reference import Reference
from mmrecipes.vlm.model.evaluation import BenchmarkAnswers, evaluate_answers
from mmrecipes.vlm.model.outputs import SequenceLogps
from mmrecipes.vlm.model.parts import vlm_parts
from mmrecipes.vlm.model.step import VLMForTraining, save_vlm
from mmrecipes.vlm.parallel.sequence_parallel import SequenceParallel
from mmrecipes.vlm.rows.chat_data import build_chat_dataloader
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.template_checks import check_template

# each step's, over its pairs
PAIR_SUMS = ("loss", "chosen", "rejected", "correct", "logps_chosen", "logps_rejected")


def main(argv=None):
    model_args, lora_args, data_args, dpo_args, args, bench_args = parse_args(ARGUMENTS, argv)
    set_seed(args.seed)
    # Before Accelerator(): under ZeRO-3 a model built afterwards is partitioned and re-initialised.
    # The reference model is the policy with its LoRA adapters disabled, or a frozen copy of the
    # starting weights.
    vlm = vlm_parts(model_args, lora_args, seq_len=data_args.max_length // 2, frozen_copy=True)
    model, processor = vlm.model, vlm.processor
    # The chosen and rejected answers' tokens, as in SFT; a model that hears reads both sides'
    # clips (the row's audio columns) as vlm_finetune.py does
    labeller = AnswerLabeller(processor, vlm.stops, audio=vlm.hears,
                              template=model_args.training_template(),
                              empty_think=data_args.empty_think_block,
                              template_kwargs=data_args.chat_template_kwargs)
    template_line = check_template(labeller, model_args.template_source(), data_args.max_length)
    # clips no longer than the audio tower reads (Qwen2-Audio: 30 s)
    data_args.audio_max_seconds = vlm.clip_seconds(data_args.audio_max_seconds)

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

    # A micro-batch holds two rows a pair: the chosen and the rejected answer
    reconcile_deepspeed_config(accelerator, train_micro_batch_size_per_gpu=2 * batch_size,
                               gradient_accumulation_steps=args.gradient_accumulation_steps,
                               gradient_clipping=args.max_grad_norm)

    # shared: vlm prepare
    # The wrapper is what the engine wraps: the dummy's features must enter the loss inside it.
    model, optimizer = accelerator.prepare(VLMForTraining(model, ranks.split), optimizer)

    reference = Reference.build(accelerator, model, vlm)  # sharded like the policy
    engine = engine_line(accelerator, model)
    accelerator.print(engine)
    accelerator.print(reference.describe())
    accelerator.print(dpo_args.describe())

    chat_collator = ChatCollator(processor.tokenizer.pad_token_id, vlm.dummy_inputs)
    collator = PreferenceCollator(chat_collator, keys=dpo_args.precompute_ref_log_probs)
    loader_kwargs = dict(labeller=labeller, ranks=ranks, preprocessor=PreferencePreprocessor)
    train_loader = build_chat_dataloader(data_args, collator=collator, batch_size=batch_size,
                                         shuffle_seed=args.seed, **loader_kwargs)
    held_out, eval_loader = [], None  # held-out pairs' rewards, and questions' answers
    if data_args.eval_dataset_name:
        eval_loader = build_chat_dataloader(data_args, collator=collator, eval_split=True,
                                            batch_size=args.per_device_eval_batch_size,
                                            **loader_kwargs)
        held_out.append(partial(evaluate_preferences, model, reference, eval_loader,
                                args=dpo_args, device=accelerator.device))
    if data_args.eval_questions:  # held-out questions' answers, as vlm_finetune.py scores them
        questions = replace(data_args, eval_dataset_name=data_args.eval_questions,
                            eval_data_files=data_args.eval_questions_data_files)
        question_loader = build_chat_dataloader(questions, collator=chat_collator, eval_split=True,
                                                batch_size=args.per_device_eval_batch_size,
                                                labeller=labeller, ranks=ranks)
        held_out.append(partial(evaluate_answers, model, question_loader,
                                device=accelerator.device))

    # shared: benchmarks
    # Standard benchmarks scored as lmms-eval scores them, each rank answering its stride of the
    # documents
    benchmarks = Benchmarks(bench_args, **ranks.reads(evaluation=True)).evaluation(
        BenchmarkAnswers(model, vlm, accelerator.device, data_args.chat_template_kwargs),
        say=accelerator.print)

    if dpo_args.precompute_ref_log_probs:  # an epoch of this rank's pairs, then no reference model
        first_pass = build_chat_dataloader(data_args, collator=collator, batch_size=batch_size,
                                           shuffle_seed=args.seed, **loader_kwargs)
        loaders = [first_pass, *[eval_loader] * (eval_loader is not None)]
        accelerator.print(reference.precompute(loaders, accelerator.device))
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

    config = tracker_config(model_args, lora_args, data_args, dpo_args, args, bench_args)
    accelerator.init_trackers("vlm_dpo", config)
    curves = ["eval_rewards/accuracies", "answer_accuracy"]  # the held-out scores in the model card
    report = Report(accelerator, args, batches, PREFERENCE_COUNTED, guard=guard, flops=vlm.flops,
                    total=checkpoints.resumed_totals, ranks=ranks, formats=DPO_FORMATS,
                    evaluations=[Evaluation(held_out, curves=curves), benchmarks])
    # shared: loop head
    for step in progress:
        window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
        if step == start_step:  # a rank without rows says why, on every rank
            batches.check_rows(window, accelerator, ranks.data_world)
        report.add_batches(window)
        filler_batch = window[-1]  # any batch: what a rank with no eval rows left forwards

        # One collective per optimizer step: the window's pairs on all ranks (the loss: their mean)
        local_pairs = torch.tensor(float(sum(batch["num_samples"] for batch in window)))
        loss_scale = ranks.loss_scale(local_pairs, args.gradient_accumulation_steps)
        window_sums = []
        for batch in window:
            inputs = to_device(batch, accelerator.device)
            reference_side = reference(batch, inputs)  # no graph
            with accelerator.accumulate(model):
                policy_side = model(inputs, SequenceLogps())  # chosen rows first, then rejected
                losses, chosen_rewards, rejected_rewards = dpo_loss(policy_side, reference_side,
                                                                    answer_tokens(inputs), dpo_args)
                accelerator.backward(losses.sum() * loss_scale)
            chosen_logps, rejected_logps = policy_side.detach().chunk(2)
            window_sums.append(torch.stack([
                losses.detach().sum(), chosen_rewards.sum(), rejected_rewards.sum(),
                (chosen_rewards > rejected_rewards).sum(), chosen_logps.sum(),
                rejected_logps.sum()]))
        step_sums = torch.stack(window_sums).sum(0)
        step_losses = step_sums[:1]
        # shared: optimizer step
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # unclipped
        done = step + 1
        if guard.should_call_optimizer(step_losses, grad_norm, done):  # fused AdamW: always
            optimizer.step()  # under DeepSpeed the engine stepped inside accelerator.backward
            scheduler.step()
        optimizer.zero_grad()

        report.add_step(pairs=local_pairs, **dict(zip(PAIR_SUMS, step_sums)))

        if report.due(done):
            sums = report.close()
            mean = {name: ratio(sums[name], sums["pairs"]) for name in PAIR_SUMS}
            report.log(done, {
                "loss": mean["loss"], "rewards/chosen": mean["chosen"],
                "rewards/rejected": mean["rejected"], "rewards/accuracies": mean["correct"],
                "rewards/margins": mean["chosen"] - mean["rejected"],
                "logps/chosen": mean["logps_chosen"], "logps/rejected": mean["logps_rejected"],
                "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0]}, sums)
        # shared: evaluations
        report.evaluate(done, filler_batch)  # those due, each on its line
        # shared: save
        checkpoints.save_if_due(done, batches.epoch, guard, report)

    save_vlm(accelerator, model, processor, args.output_dir, vlm.peft_config)
    # shared: last evaluations
    # after the save: whatever they do, the trained model is kept
    report.evaluate_last(filler_batch)

    seen = f"{report.total['samples']:,.0f} preference pairs, {report.total['tokens']:,.0f} tokens"
    tags = ["vlm", "dpo", "lora" if vlm.peft_config else "full fine-tune", type(vlm.model).__name__]
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
