"""Reinforcement learning with verifiable rewards (GRPO, Dr. GRPO, DAPO) of any image-text-to-text model.

    accelerate launch recipes/vlm_grpo.py --model_name_or_path outputs/vlm_finetune
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/vlm_grpo.py \
        --model_name_or_path outputs/vlm_finetune --reward_funcs accuracy,mypkg.rewards:my_reward --reward_weights 1,0.5

Each prompt (TRL's `prompt` with `images` and `solution`, or a chat row whose last answer is the solution) gets
--num_generations completions sampled from the policy; reward functions score them (built in: accuracy against the
solution, format by --format_pattern; yours by import path); each completion's advantage is its reward against its
group's; the clipped surrogate (TRL 1.16's loss types and flag names) is normalised over the optimizer step on every
rank. Completions are sampled by `generate` where the model is whole on the rank, else a token at a time until every
rank is done, each from a seed of its own, so W ranks sample what one process does (docs/grpo.md). Start it from an
SFT'd model that answers sometimes, such as vlm_finetune.py's output: a model that never answers right gets no reward
to learn from.
"""

from dataclasses import asdict, dataclass, replace

from mmrecipes.arguments import TrainingArgs
from mmrecipes.config import checked, parse_args
from mmrecipes.vlm.arguments import GRPOArgs, LoraArgs, PromptDataArgs, VLMModelArgs


@dataclass
class ModelArgs(VLMModelArgs):
    # The tiny Llava after 60 steps of vlm_finetune.py (data_prep/tiny_sft_vlm.py): it answers sometimes
    model_name_or_path: str | None = "embedded:tiny_sft_vlm"


@dataclass
class TrainArgs(TrainingArgs):
    output_dir: str = "outputs/vlm_grpo"
    max_steps: int = 150
    per_device_train_batch_size: int = 32  # completions; a step's, over ranks and accumulation: whole groups
    learning_rate: float = 3.0e-4  # for the tiny SFT'd default; TRL's default for real models is 1e-6
    warmup_steps: int = 0
    # used when --train_modules all (as vlm_finetune.py)
    vision_tower_learning_rate: float = checked(2.0e-6, "learning_rate")
    vision_tower_weight_decay: float = checked(0.0, "non_negative")
    weight_decay: float = 0.0
    eval_steps: int = 50


ARGUMENTS = (ModelArgs, LoraArgs, PromptDataArgs, GRPOArgs, TrainArgs)  # the flags and YAML keys it takes
if __name__ == "__main__":
    parse_args(ARGUMENTS)  # --help and a bad flag answer here, before torch and the models load

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mmrecipes.checkpointing import Checkpointer, data_layout
from mmrecipes.distributed import (
    data_parallel_rank_and_world,
    engine_line,
    generation_line,
    model_for_sampling,
    reconcile_deepspeed_config,
    sum_over_ranks,
)
from mmrecipes.images import to_device
from mmrecipes.loader import TrainBatches
from mmrecipes.model_card import write_model_card
from mmrecipes.reporting import Report, ratio
from mmrecipes.step_guard import StepGuard
from mmrecipes.training import accelerator_from_args, adamw, lr_scheduler, optimizer_groups, per_device_batch_size
from mmrecipes.vlm import grpo
from mmrecipes.vlm.chat_data import CHAT_COUNTED, build_chat_dataloader, generation_prompts
from mmrecipes.vlm.collate import ChatCollator
from mmrecipes.vlm.evaluation import evaluate_generation
from mmrecipes.vlm.families import dummy_image_inputs, placeholder_token_ids
from mmrecipes.vlm.flops import VLMFlops
from mmrecipes.vlm.labels import AnswerLabeller
from mmrecipes.vlm.lora import add_lora, describe_trainable
from mmrecipes.vlm.losses import IGNORE_INDEX, token_loss_scale
from mmrecipes.vlm.models import VLMForTraining, apply_train_modules, load_vlm, save_vlm, stop_token_ids, token_logps
from mmrecipes.vlm.module_groups import module_groups
from mmrecipes.vlm.preference import Reference, frozen_reference
from mmrecipes.vlm.rewards import RewardScorer, load_reward_funcs


def main(argv=None):
    model_args, lora_args, data_args, grpo_args, args = parse_args(ARGUMENTS, argv)
    grpo.check_settings(grpo_args, data_args.max_length)
    reward_funcs = load_reward_funcs(grpo_args.funcs, grpo_args.format_pattern)  # an unknown name stops here
    # shared: vlm model
    set_seed(args.seed)
    # Before Accelerator(): under ZeRO-3 a model built afterwards is partitioned and re-initialised.
    model, processor = load_vlm(model_args)
    stops = stop_token_ids(model, processor)

    placeholders = placeholder_token_ids(model, processor)  # image and video: never sampled nor decoded
    labeller = AnswerLabeller(processor, stops)  # the prompts go through its processor and template
    # shared: vlm parts
    dummy_inputs = dummy_image_inputs(model, processor)
    groups = module_groups(model, dummy_inputs)  # one dummy backward: vision tower, projector, language model
    trainable = apply_train_modules(groups, model_args.train_modules)  # unreached ones frozen: DDP would wait for them
    peft_model = peft_config = None
    if lora_args.use_peft:  # adapters injected into `model` itself; everything but them and the projector frozen
        peft_model, trainable = add_lora(model, groups, model_args.train_modules, lora_args)
        peft_config = peft_model.peft_config["default"]
    if model_args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if not model.get_input_embeddings().weight.requires_grad:
        # A frozen embedding (LoRA, the projector preset) gives a text-only batch an LM input without grad: its
        # backward would skip the LM where an image batch's runs through it, so ZeRO-3 and FSDP2 ranks would
        # gather different parameters (and checkpointed layers would get no gradients).
        model.enable_input_require_grads()
    # Counted now: after prepare, ZeRO-3 parameters are partitioned and report numel() == 0.
    batch_flops = VLMFlops(model, sum(p.numel() for _, p in groups.vision_tower), seq_len=data_args.max_length // 2,
                           lm_weights_train="language_model" in trainable and peft_config is None,
                           vision_trains="vision_tower" in trainable)

    # shared: accelerator
    accelerator = accelerator_from_args(args)
    data_rank, data_world = data_parallel_rank_and_world(accelerator)
    batch_size = per_device_batch_size(args, data_world)

    # A step's completions are whole groups; a group's may sit on several micro-batches and ranks (docs/grpo.md)
    layout = grpo.GroupLayout(grpo_args.num_generations, batch_size, args.gradient_accumulation_steps, data_rank,
                              data_world)

    accelerator.print(f"evaluation: {data_args.evaluation}")
    accelerator.print(describe_trainable(model))

    # shared: vlm optimizer
    # Frozen parameters are not in the optimizer (no state); the tower, if it trains, has its own lr.
    optimizer = adamw(optimizer_groups(trainable, learning_rate=args.learning_rate, weight_decay=args.weight_decay,
                                       own_rates={"vision_tower": (args.vision_tower_learning_rate,
                                                                   args.vision_tower_weight_decay)}), args)
    scheduler = lr_scheduler(optimizer, args)

    # shared: deepspeed
    reconcile_deepspeed_config(accelerator, train_micro_batch_size_per_gpu=batch_size,
                               gradient_accumulation_steps=args.gradient_accumulation_steps,
                               gradient_clipping=args.max_grad_norm)

    step_model = VLMForTraining(model)  # what the engine wraps: the dummy's features enter the loss inside it
    # The KL's reference (--beta): the policy with its LoRA adapters disabled, or a frozen copy sharded like it
    reference = None
    if grpo_args.beta:
        reference = Reference(None if peft_model else frozen_reference(accelerator, step_model), peft_model)
    model, optimizer = accelerator.prepare(step_model, optimizer)
    if reference is not None and peft_model:
        reference.model = model  # the prepared policy, its adapters disabled for the KL
    engine = engine_line(accelerator, model)
    accelerator.print(engine)
    if reference is not None:
        accelerator.print(reference.describe())
    accelerator.print(generation_line(accelerator, grpo_args.ds3_gather_for_generation))

    # The loader reads a team's prompts for a step as one batch, leaving room for the completions
    chat_collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_inputs)
    prompt_data = replace(data_args, max_length=data_args.max_length - grpo_args.max_completion_length)
    train_loader = build_chat_dataloader(prompt_data, labeller, grpo.PromptCollator(chat_collator, layout.member == 0),
                                         shuffle_seed=args.seed, batch_size=layout.prompts_per_step,
                                         data_rank=layout.team, data_world=layout.teams,
                                         preprocessor=grpo.PromptPreprocessor)
    held_out = generation_prompts(data_args, processor, rows=-(-data_args.eval_generation_rows // data_world),
                                  data_rank=data_rank, data_world=data_world,
                                  device=accelerator.device) if data_args.eval_dataset_name else []
    scorer = RewardScorer(reward_funcs, grpo_args.weights, grpo_args.reward_timeout)
    normaliser = grpo.LossNormaliser(grpo_args)

    checkpoints = Checkpointer(accelerator, args, scheduler, accelerator.unwrap_model(model),
                               data_layout(data_args, args, data_world=data_world, batch_size=batch_size)
                               | {"num_generations": layout.group_size, "prompt_teams": layout.teams,
                                  "loader_batch_size": layout.prompts_per_step})
    # shared: run state
    # Once per optimizer step the ranks agree whether to apply it (finite loss and gradients) and
    # whether a preemption signal arrived (then: checkpoint and exit).
    guard = StepGuard(accelerator, model, optimizer, checkpoints, signals=args.preemption_signals,
                      max_skipped_steps=args.max_skipped_steps)
    start_step, resumed_epoch = checkpoints.open_run(args.resume_from_checkpoint, train_loader)
    batches = TrainBatches(train_loader, resumed_epoch)
    progress = tqdm(range(start_step, args.max_steps), disable=not accelerator.is_local_main_process)

    accelerator.init_trackers("vlm_grpo", asdict(model_args) | asdict(lora_args) | asdict(data_args)
                              | asdict(grpo_args) | asdict(args))
    report = Report(accelerator, args, batches, CHAT_COUNTED, guard=guard, flops=None, total=checkpoints.resumed_totals)
    for step in progress:
        window = [next(batches)]  # the step's prompts: one batch, the team's (its completions fill the micro-batches)
        if step == start_step:
            batches.check_rows(window, accelerator, layout.teams)  # a team without prompts says why, on every rank
        report.add_batches(window)

        # Rollouts: this rank's completions sampled and scored, b to a training micro-batch; the groups' statistics
        # from every rank's rewards
        with model_for_sampling(accelerator, model, grpo_args.ds3_gather_for_generation) as (sampler, whole):
            rollouts = grpo.Rollouts.sample(sampler, whole, window[0]["prompts"], layout, chat_collator, scorer,
                                            processor, grpo_args, stops, placeholders, args.seed + step,
                                            accelerator.device)
        rewards = scorer.total(rollouts.scores)  # NaN where a reward function failed: no advantage, no statistics
        advantages, zero_std = layout.advantages(rewards, grpo_args.scale_rewards, accelerator.device)

        # One collective per optimizer step: the normaliser N over every rank's window (tokens or completions)
        inputs = [to_device(batch, accelerator.device) for batch in rollouts.micro_batches]
        masks = [batch["labels"][:, 1:] != IGNORE_INDEX for batch in inputs]
        local_count = torch.tensor(normaliser.count(masks), device=accelerator.device)
        loss_scale = token_loss_scale(sum_over_ranks(local_count), args.gradient_accumulation_steps, data_world)
        step_sums = grpo.LossSums()
        # Before any update: the sampling policy's log-probabilities (--num_iterations > 1 reuses the completions for
        # that many optimizer steps, the last one in the block below) and the reference's (--beta), no graph
        advantages = advantages.to(accelerator.device, torch.float32).split([len(mask) for mask in masks])
        temperature = grpo_args.temperature  # log-probabilities of the distribution the completions came from
        with torch.no_grad():
            old_logps = [token_logps(model, batch, temperature) if grpo_args.num_iterations > 1 else None
                         for batch in inputs]
        reference_logps = [reference.token_logps(batch, temperature) if reference else None for batch in inputs]
        for iteration in range(grpo_args.num_iterations):
            for batch, mask, batch_advantages, old, ref in zip(inputs, masks, advantages, old_logps, reference_logps):
                with accelerator.accumulate(model):
                    logps = token_logps(model, batch, temperature)
                    old = logps.detach() if old is None else old  # one iteration: the ratio is 1, its gradient A
                    terms = grpo.token_losses(logps, old, ref, batch_advantages, mask, grpo_args)
                    weighted = (terms["loss"] * normaliser.weights(mask)).sum()
                    accelerator.backward(weighted * loss_scale)
                step_sums.add(weighted, terms, mask)
            if iteration + 1 < grpo_args.num_iterations:  # an earlier optimizer step on the same completions
                earlier_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                if guard.should_call_optimizer(step_sums["loss"][None], earlier_norm, step + 1):
                    optimizer.step()  # the scheduler steps once per batch of completions, below
                optimizer.zero_grad()
        step_losses = step_sums["loss"][None]
        # shared: optimizer step
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # before clipping
        done = step + 1
        if guard.should_call_optimizer(step_losses, grad_norm, done):  # a fused AdamW is always called
            optimizer.step()  # under DeepSpeed the engine already stepped inside accelerator.backward
            scheduler.step()
        optimizer.zero_grad()
        filler_batch = window[-1]  # any valid batch: what a rank with no eval rows left forwards

        failures = scorer.take_failures(accelerator.print, accelerator.process_index)  # each error said once
        device = accelerator.device
        report.add_step(guard.applied, **step_sums, normaliser=local_count * grpo_args.num_iterations,
                        **rollouts.step_sums(rewards, zero_std, failures, reward_funcs, batch_flops, device))

        if report.due(done):
            sums = report.close()
            report.log(done, grpo.grpo_metrics(sums, reward_funcs, grpo_args.beta) | {
                "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                "generation_share": ratio(sums["generation_seconds"], sums["seconds"] * data_world)}, sums)
            scorer.check_window(sums, done)  # a function that failed every completion stops the run, on every rank
        if held_out and report.evaluation_due(done):
            with report.evaluating(done) as evaluation:
                evaluation |= evaluate_generation(model, held_out, filler_batch["chat"], chat_collator,
                                                  processor.tokenizer, stops, accelerator.device, placeholders)
        # shared: save
        checkpoints.save_if_due(done, batches.epoch, guard, report)

    save_vlm(accelerator, model, processor, args.output_dir, peft_config)
    if accelerator.is_main_process:
        write_model_card(args.output_dir, report.history, eval_metrics=["generated_accuracy"],
                         pipeline_tag="image-text-to-text", base_model=model_args.model_name_or_path,
                         datasets=data_args.dataset_name.split(","), evaluated=data_args.evaluation, engine=engine,
                         resumed_at=start_step, tags=["vlm", "grpo", "lora" if peft_config else "full fine-tune",
                                                      type(accelerator.unwrap_model(model).model).__name__],
                         seen=f"{int(report.total['samples']):,} prompts, {int(report.total['completions']):,} "
                              "completions")
    # shared: the end
    # Every rank leaves together: a rank that tore down its process group while rank 0 still wrote
    # the card aborted once under ZeRO-3 ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.print(f"saved model to {args.output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
