"""GRPO, Dr. GRPO and DAPO: reinforcement learning of image-text-to-text models with rewards.

    accelerate launch recipes/vlm_grpo.py --model_name_or_path outputs/vlm_finetune
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/vlm_grpo.py \
        --model_name_or_path outputs/vlm_finetune --reward_funcs accuracy,mypkg.rewards:my_reward \
        --reward_weights 1,0.5

Each prompt (TRL's `prompt` with `images` and `solution`, or a chat row whose last answer is the
solution) gets --num_generations completions sampled from the policy; reward functions score them
(built in: accuracy against the solution, format by --format_pattern; yours by import path, as TRL
calls them); each completion's advantage is its reward against its group's; the clipped surrogate
(TRL 1.16's loss types and flag names) is normalised over the optimizer step on every rank.
Completions are sampled by `generate` where the model is whole on the rank, else a token at a time
until every rank is done, each from a seed of its own, so W ranks sample what one process does
(docs/grpo.md). Start from an SFT'd model that answers sometimes (vlm_finetune.py's output): a
model that never answers right gets no reward to learn from.
"""

from dataclasses import dataclass, replace
from functools import partial

from mmrecipes.benchmarks.arguments import BenchmarkArgs
from mmrecipes.config import parse_args
from mmrecipes.vlm.arguments import (
    GRPOArgs,
    LoraArgs,
    PromptDataArgs,
    TunedModelArgs,
    VLMTrainingArgs,
)


@dataclass
class TrainArgs(VLMTrainingArgs):
    output_dir: str = "outputs/vlm_grpo"
    max_steps: int = 150
    # completions; a step's, over ranks and accumulation: whole groups
    per_device_train_batch_size: int = 32
    # for the tiny SFT'd default; TRL's default for real models is 1e-6
    learning_rate: float = 3.0e-4
    warmup_steps: int = 0
    eval_steps: int = 50


# the flags and YAML keys it takes
ARGUMENTS = (TunedModelArgs, LoraArgs, PromptDataArgs, GRPOArgs, TrainArgs, BenchmarkArgs)
# shared: flags first
if __name__ == "__main__":
    parse_args(ARGUMENTS)  # --help and a bad flag answer here, before torch and the models load

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mmrecipes.benchmarks.harness import Benchmarks
from mmrecipes.checkpointing import Checkpointer, data_layout
from mmrecipes.distributed import Ranks, engine_line, reconcile_deepspeed_config
from mmrecipes.loader import TrainBatches
from mmrecipes.model_card import write_model_card
from mmrecipes.reporting import Evaluation, Report, ratio, tracker_config
from mmrecipes.step_guard import StepGuard
from mmrecipes.training import accelerator_from_args, adamw, lr_scheduler, per_device_batch_size
from mmrecipes.vlm.algorithms import grpo
from mmrecipes.vlm.algorithms.reference import Reference
from mmrecipes.vlm.algorithms.responses import ResponseFormat
from mmrecipes.vlm.algorithms.rewards import RewardScorer, load_reward_funcs
from mmrecipes.vlm.algorithms.sampling import Sampler
from mmrecipes.vlm.algorithms.tools import Tools
from mmrecipes.vlm.model.evaluation import BenchmarkAnswers, evaluate_generation
from mmrecipes.vlm.model.outputs import TokenLogps
from mmrecipes.vlm.model.parts import vlm_parts
from mmrecipes.vlm.model.step import VLMForTraining, save_vlm
from mmrecipes.vlm.parallel.sequence_parallel import SequenceParallel
from mmrecipes.vlm.rows.chat_data import CHAT_COUNTED, build_chat_dataloader
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.held_out import generation_prompts
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.prompts import PromptCollator, PromptPreprocessor
from mmrecipes.vlm.rows.template_checks import check_generation_prompt


def main(argv=None):
    model_args, lora_args, data_args, grpo_args, args, bench_args = parse_args(ARGUMENTS, argv)
    # known names? a module whose import blocks is named within --reward_timeout
    reward_funcs = load_reward_funcs(grpo_args.funcs, grpo_args.format_pattern,
                                     grpo_args.reward_timeout)
    set_seed(args.seed)
    # Before Accelerator(): under ZeRO-3 a model built afterwards is partitioned and re-initialised.
    # The KL's reference (--beta): the policy with its LoRA adapters disabled, or a frozen copy.
    vlm = vlm_parts(model_args, lora_args, seq_len=data_args.max_length // 2,
                    frozen_copy=grpo_args.beta > 0)
    # clips no longer than the audio tower reads (Qwen2-Audio: 30 s)
    data_args.audio_max_seconds = vlm.clip_seconds(data_args.audio_max_seconds)
    model, processor = vlm.model, vlm.processor
    # the prompts go through its template; a model that hears plays their clips (the audio columns)
    labeller = AnswerLabeller(processor, vlm.stops, audio=vlm.hears,
                              template_kwargs=data_args.chat_template_kwargs)
    # --tools, --environment_factory: completions call them and go on after the results
    tools = Tools.of(grpo_args, processor, vlm.stops, data_args.max_length,
                     data_args.chat_template_kwargs)
    reward_funcs, weights = Tools.reward_sources(tools, reward_funcs, grpo_args.weights)
    # the assistant header the samples start after
    template_line = check_generation_prompt(labeller, model_args.template_source())

    # shared: accelerator
    accelerator = accelerator_from_args(args)

    # shared: ranks
    # The rows each rank reads; --sequence_parallel_size splits each training sequence over that
    # many ranks, which read the same rows (Ulysses; evaluation reads whole sequences)
    split = SequenceParallel.of(accelerator, model, model_args.sequence_parallel_size, processor)
    ranks = Ranks.of(accelerator, split)
    batch_size = per_device_batch_size(args, ranks.data_world)
    accelerator.print(ranks.describe())

    # A step's completions are whole groups; a group's may sit on several micro-batches and ranks
    layout = grpo.GroupLayout.of(grpo_args.num_generations, batch_size,
                                 args.gradient_accumulation_steps, ranks)

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

    reference = Reference.build(accelerator, model, vlm) if grpo_args.beta else None  # sharded
    engine = engine_line(accelerator, model)
    accelerator.print(engine)
    if reference is not None:
        accelerator.print(reference.describe())
    chat_collator = ChatCollator(processor.tokenizer.pad_token_id, vlm.dummy_inputs)
    sampler = Sampler(accelerator, chat_collator, grpo_args, vlm.stops, vlm.placeholders, tools)
    accelerator.print(sampler.describe())

    # The loader reads a team's prompts for a step as one batch, leaving room for the completions
    prompt_length = data_args.max_length - grpo_args.max_completion_length
    team = ranks.teams(layout.team_size)  # they read its prompts; its first member counts them
    prompt_collator = PromptCollator(chat_collator, counted=team.counts_reads)
    train_loader = build_chat_dataloader(replace(data_args, max_length=prompt_length), labeller,
                                         prompt_collator, shuffle_seed=args.seed,
                                         batch_size=layout.prompts_per_step, ranks=team,
                                         preprocessor=PromptPreprocessor,
                                         preprocessor_kwargs=Tools.prompt_settings(tools))
    held_out = []  # questions answered by greedy decoding at each evaluation
    questions = data_args.eval_dataset_name and generation_prompts(
        data_args, processor, rows=data_args.eval_generation_rows, ranks=ranks)
    if questions:
        held_out = [partial(evaluate_generation, model, questions, collator=chat_collator,
                            tokenizer=processor.tokenizer, stop_token_ids=vlm.stops,
                            device=accelerator.device, placeholders=vlm.placeholders)]
    # rewards get each turn read as its template writes it (reasoning, answer, calls): TRL's parse
    responses = tools.format.responses if tools else ResponseFormat.of(processor, vlm.stops,
                                                                        data_args.chat_template_kwargs)
    scorer = RewardScorer(reward_funcs, weights, grpo_args.reward_timeout,
                          generation_prompt=labeller.generation_prompt(), responses=responses)
    normaliser = grpo.LossNormaliser(grpo_args)

    # shared: benchmarks
    # Standard benchmarks scored as lmms-eval scores them, each rank answering its stride of the
    # documents
    benchmarks = Benchmarks(bench_args, **ranks.reads(evaluation=True)).evaluation(
        BenchmarkAnswers(model, vlm, accelerator.device, data_args.chat_template_kwargs),
        say=accelerator.print)

    data = data_layout(data_args, args, ranks, batch_size=batch_size)
    checkpoints = Checkpointer(accelerator, args, scheduler, accelerator.unwrap_model(model),
                               data | layout.recorded(), ranks)
    # shared: run state
    # Once per optimizer step the ranks agree whether to apply it (finite loss and gradients) and
    # whether a preemption signal arrived (then: checkpoint and exit).
    guard = StepGuard(accelerator, model, optimizer, checkpoints, signals=args.preemption_signals,
                      max_skipped_steps=args.max_skipped_steps)
    start_step, resumed_epoch = checkpoints.open_run(args.resume_from_checkpoint, train_loader)
    batches = TrainBatches(train_loader, resumed_epoch)
    progress = tqdm(range(start_step, args.max_steps),
                    disable=not accelerator.is_local_main_process)

    config = tracker_config(model_args, lora_args, data_args, grpo_args, args, bench_args)
    accelerator.init_trackers("vlm_grpo", config)
    report = Report(accelerator, args, batches, CHAT_COUNTED, guard=guard, flops=vlm.flops,
                    total=checkpoints.resumed_totals, ranks=ranks, formats=grpo.FORMATS,
                    evaluations=[Evaluation(held_out, curves=["generated_accuracy"]), benchmarks])
    rollouts = None
    for step in progress:
        window = []  # a batch of the team's prompts, read once every --num_iterations steps
        if rollouts is None or rollouts.trained == grpo_args.num_iterations:
            window = [next(batches)]  # its completions fill this rank's micro-batches
            if step == start_step:  # a team without prompts says why, on every rank
                batches.check_rows(window, accelerator, team.data_world)
            # This rank's completions, sampled and scored; their advantages from every rank's
            # rewards (none where a reward function failed); what the loss needs before any update
            prompts = window[0]["prompts"]
            rollouts = sampler.rollouts(model, prompts, layout, seed=args.seed + step,
                                        mask_truncated=grpo_args.mask_truncated_completions)
            rollouts.scores = scorer.score(rollouts, processor.tokenizer, vlm.stops)
            rewards = scorer.total(rollouts.scores)
            advantages, zero_std = layout.advantages(rewards, grpo_args.scale_rewards,
                                                     accelerator.device)
            micro_batches = grpo.micro_batches(rollouts, advantages, model, reference, grpo_args,
                                               accelerator.device)
            # One collective per batch of completions: the normaliser N over every rank's
            local_count = torch.tensor(normaliser.count([batch.mask for batch in micro_batches]))
            loss_scale = ranks.loss_scale(local_count, args.gradient_accumulation_steps)
            failures = scorer.take_failures(accelerator)  # said in the main log, with their ranks
            sampled = rollouts.sums(rewards, zero_std, failures, reward_funcs,
                                    counted=ranks.counts_reads)
            filler_batch = window[0]["chat"]  # what a rank with no held-out prompt left decodes
        report.add_batches(window, trained=rollouts.micro_batches)

        step_sums = grpo.LossSums()
        for batch in micro_batches:
            with accelerator.accumulate(model):
                logps = model(batch.inputs, TokenLogps(grpo_args.temperature))
                terms = grpo.token_losses(logps, batch.old_logps(logps), batch.reference_logps,
                                          batch.advantages, batch.mask, grpo_args)
                weighted = (terms["loss"] * normaliser.weights(batch.mask)).sum()
                accelerator.backward(weighted * loss_scale)
            step_sums.add(weighted, terms, batch.mask)
        rollouts.trained += 1
        step_losses = step_sums["loss"][None]
        # shared: optimizer step
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # unclipped
        done = step + 1
        if guard.should_call_optimizer(step_losses, grad_norm, done):  # fused AdamW: always
            optimizer.step()  # under DeepSpeed the engine stepped inside accelerator.backward
            scheduler.step()
        optimizer.zero_grad()

        report.add_step(**step_sums, normaliser=local_count,
                        **(sampled if window else {}))

        if report.due(done):
            sums = report.close()
            sampling = ratio(sums["generation_seconds"], sums["seconds"] * ranks.data_world)
            report.log(done, grpo.grpo_metrics(sums, reward_funcs, grpo_args.beta) | {
                "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                "generation_share": sampling}, sums)
            scorer.check_window(sums, done)  # a function that failed every completion: stop
        # shared: evaluations
        report.evaluate(done, filler_batch)  # those due, each on its line
        # shared: save
        checkpoints.save_if_due(done, batches.epoch, guard, report)

    save_vlm(accelerator, model, processor, args.output_dir, vlm.peft_config)
    # shared: last evaluations
    # after the save: whatever they do, the trained model is kept
    report.evaluate_last(filler_batch)

    seen = f"{report.total['samples']:,.0f} prompts, {report.total['completions']:,.0f} completions"
    tags = ["vlm", "grpo", "lora" if vlm.peft_config else "full fine-tune",
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
