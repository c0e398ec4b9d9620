"""recipes/vlm_dpo.py: preference rows in TRL's and LLaVA's formats become labelled chosen/rejected pairs; the loss
and rewards of a step equal the DPO paper's formula computed from the model's own logits (sigmoid, IPO, label
smoothing); the reference is the policy with its adapters disabled, or a frozen copy; the default run learns."""

import copy
import re

import datasets
import pytest
import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline

from helpers import hostile_benchmarks
from launch import REPO, assert_engine, assert_same_curves, run_engine, run_recipe
from mmrecipes.images import to_device
from mmrecipes.skips import SKIPPED
from mmrecipes.vlm.algorithms.preference import (
    PreferenceCollator,
    PreferencePreprocessor,
    answer_tokens,
    dpo_loss,
)
from mmrecipes.vlm.algorithms.reference import Reference
from mmrecipes.vlm.arguments import DPOArgs, LoraArgs, PreferenceDataArgs, VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.lora import add_lora
from mmrecipes.vlm.model.module_groups import module_groups
from mmrecipes.vlm.model.outputs import SequenceLogps
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller

DPO_RECIPE = REPO / "recipes" / "vlm_dpo.py"
RED = Image.new("RGB", (32, 32), (220, 40, 40))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, processor = load_vlm(VLMModelArgs())
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    collator = PreferenceCollator(ChatCollator(processor.tokenizer.pad_token_id,
                                                     dummy_image_inputs(model, processor)))
    return model, processor, PreferencePreprocessor(PreferenceDataArgs(), labeller, 256), collator


def preprocessed(preprocess, rows):
    columns = {key: [row.get(key) for row in rows] for key in {key for row in rows for key in row}}
    out = preprocess(columns)
    return [dict(zip(out, values)) for values in zip(*out.values())]


def answer_text(processor, row):
    return processor.tokenizer.decode(row["input_ids"][row["labels"] != IGNORE_INDEX])


def test_trl_and_llava_formats_become_pairs_labelled_as_in_sft_and_bad_pairs_are_counted(tiny, tmp_path):
    _, processor, preprocess, _ = tiny
    RED.save(tmp_path / "red.png")
    conversation = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
                    "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
                    "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
                    "images": [RED]}
    strings = {"prompt": "Colour?", "chosen": "red", "rejected": "blue", "images": [RED]}  # the image goes first
    llava = {"conversations": [{"from": "human", "value": "<image>\nColour?"}], "image": str(tmp_path / "red.png"),
             "chosen": "red", "rejected": {"from": "gpt", "value": "blue"}}
    pairs = preprocessed(preprocess, [conversation, strings, llava])
    assert len(pairs) == 3
    for pair in pairs:
        assert answer_text(processor, pair["chosen"]) == "red<|end|>"
        assert answer_text(processor, pair["rejected"]) == "blue<|end|>"
        images = [side["media_inputs"]["pixel_values"] for side in (pair["chosen"], pair["rejected"])]
        assert torch.equal(*images)
    # The prompt is the same tokens on both sides; only the answer differs.
    chosen, rejected = pairs[0]["chosen"], pairs[0]["rejected"]
    start = int((chosen["labels"] != IGNORE_INDEX).nonzero()[0])
    assert torch.equal(chosen["input_ids"][:start], rejected["input_ids"][:start])

    bad = [{"prompt": "Colour?", "chosen": "red", "images": [RED]},  # no rejected answer
           {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
            "chosen": "red", "rejected": "blue", "images": []},  # an image part without an image
           llava | {"image": None, "conversations": [{"from": "robot", "value": "Colour?"}]}]
    out = preprocess({key: [row.get(key) for row in bad + [strings]] for key in {*conversation, *llava}})
    assert len(out["chosen"]) == 1
    assert out[SKIPPED] == [{"bad_row": 2, "image_mismatch": 1}]  # on the kept pair


def test_a_multi_turn_prompt_scores_only_the_completion_and_pairs_without_a_preference_are_counted(tiny):
    """The prompt's earlier assistant turn was scored as part of both answers (chosen targets
    `green<|end|>square<|end|>`): TRL scores only the completion. Pairs whose answers are the same, or one of them
    empty, teach no preference: counted as no_preference and skipped (TRL trains on them)."""
    _, processor, preprocess, _ = tiny
    prompt = [{"role": "user", "content": "What colour is it?"}, {"role": "assistant", "content": "green"},
              {"role": "user", "content": "And its shape?"}]
    rows = [{"prompt": prompt, "chosen": "square", "rejected": "square"},
            {"prompt": "Shape?", "chosen": "", "rejected": "circle"},
            {"prompt": "Shape?", "chosen": "square", "rejected": " "},
            {"prompt": prompt, "chosen": "square", "rejected": "circle"}]  # kept last: the counts ride with it
    out = preprocess({key: [row.get(key) for row in rows] for key in ("prompt", "chosen", "rejected", "images")})
    (pair,) = [dict(zip(out, values)) for values in zip(*out.values())]
    assert answer_text(processor, pair["chosen"]) == "square<|end|>"
    assert answer_text(processor, pair["rejected"]) == "circle<|end|>"
    assert pair[SKIPPED] == {"no_preference": 3}
    assert "no_preference: 3, e.g. a row, the chosen and rejected answers are the same" in preprocess.drops.report()


def row_logps(model, pair_rows, average):
    """Each row's answer log-probability from the HF model's own logits, one row at a time, no padding: the sum (or
    mean) over the labelled tokens of log_softmax at the position before each."""
    values = []
    for row in pair_rows:
        inputs = {"input_ids": row["input_ids"][None], "attention_mask": torch.ones_like(row["input_ids"])[None]}
        inputs |= to_device(row["media_inputs"], "cpu")  # uint8 images finished as in training
        logits = model(**inputs).logits[0].float()
        targets = row["labels"][1:]
        scored = targets != IGNORE_INDEX
        token_logps = F.log_softmax(logits[:-1], -1).gather(1, targets.clamp_min(0)[:, None])[:, 0][scored]
        values.append(token_logps.mean() if average else token_logps.sum())
    return torch.stack(values)


@pytest.mark.parametrize("loss_type, loss_weights, label_smoothing", [
    ("sigmoid", None, 0.0), ("sigmoid", None, 0.2), ("ipo", None, 0.0), ("sigmoid,sft", "1.0,0.5", 0.0),
    ("robust", None, 0.2)])
def test_loss_and_rewards_equal_the_dpo_formula_from_the_models_own_logits(tiny, loss_type, loss_weights,
                                                                           label_smoothing):
    """DPO (Rafailov et al. 2023, eq. 7): -log sigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l))), smoothed
    (cDPO, deprecated); IPO (Azar et al. 2023): (h - 1 / (2 beta))^2 on length-averaged log-probabilities, as TRL;
    Robust DPO (Chowdhury et al. 2024); sft adds its weight x the chosen answer's mean token NLL. Rewards are beta
    x the summed log-ratios for every loss (TRL 1.16; IPO's were per-token before). The reference is a perturbed
    copy, so its terms matter. Image and text-only pairs in one batch."""
    model, _, preprocess, collator = tiny
    rows = list(datasets.load_dataset(str(REPO / "data" / "vlm_preferences"), split="train").select(range(40)))
    rows = [row for row in rows if row["images"]][:3] + [row for row in rows if not row["images"]][:2]
    pairs = preprocessed(preprocess, rows)
    assert len(pairs) == 5
    reference_model = copy.deepcopy(model)
    with torch.no_grad():
        for param in reference_model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    args = DPOArgs(beta=0.5, loss_type=loss_type, loss_weights=loss_weights, label_smoothing=label_smoothing)
    model.eval(), reference_model.eval()
    with torch.no_grad():
        inputs = to_device(collator(pairs), "cpu")
        policy = VLMForTraining(model)(inputs, SequenceLogps())
        reference = Reference(VLMForTraining(reference_model))(None, inputs)
        losses, chosen_rewards, rejected_rewards = dpo_loss(policy, reference, answer_tokens(inputs), args)

        ordered = [pair["chosen"] for pair in pairs] + [pair["rejected"] for pair in pairs]
        pi, ref = row_logps(model, ordered, average=False), row_logps(reference_model, ordered, average=False)
        pi_mean, ref_mean = row_logps(model, ordered, average=True), row_logps(reference_model, ordered, average=True)
    half, beta, smoothing = len(pairs), args.beta, label_smoothing
    pi_w, pi_l, ref_w, ref_l = pi[:half], pi[half:], ref[:half], ref[half:]
    h = (pi_w - ref_w) - (pi_l - ref_l)
    if loss_type == "ipo":
        h_mean = (pi_mean[:half] - ref_mean[:half]) - (pi_mean[half:] - ref_mean[half:])
        expected = (h_mean - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        expected = (-(1 - smoothing) * torch.log(torch.sigmoid(beta * h))
                    + smoothing * torch.log(torch.sigmoid(-beta * h))) / (1 - 2 * smoothing)
    else:
        expected = (-(1 - smoothing) * torch.log(torch.sigmoid(beta * h))
                    - smoothing * torch.log(torch.sigmoid(-beta * h)))
    if "sft" in loss_type:
        expected = expected - 0.5 * pi_mean[:half]
    torch.testing.assert_close(policy, pi, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(losses, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(chosen_rewards, beta * (pi_w - ref_w), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(rejected_rewards, beta * (pi_l - ref_l), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(ref, pi, atol=1e-3)  # the reference's terms are not zero


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_first_step_equals_trl_dpo_trainer(tiny, loss_type, tmp_path):
    """TRL 1.16's `DPOTrainer` on the same tiny model and pairs computes the loss, the rewards and the log-probs we
    compute. One convention is taken out: TRL also scores the newline the template writes after the end-of-turn
    token (the prompt-plus-answer rendering minus the prompt's), where our labels are the SFT labels; here the
    template writes no newline after an answer. The reference's log-probabilities are handed to TRL as
    precomputed (its `ref_chosen_logps` inputs), from the reference's own logits on TRL's batch; ours come from our
    forward. Before, IPO logged per-token rewards: half of TRL's here."""
    import trl  # a dev dependency: imported here, its import costs seconds

    model, processor, _, collator = tiny
    processor = copy.deepcopy(processor)
    template = processor.chat_template.replace("{% endgeneration %}{{ '\n' }}", "{% endgeneration %}")
    assert template != processor.chat_template
    processor.chat_template = processor.tokenizer.chat_template = template
    torch.manual_seed(1)
    reference_model = copy.deepcopy(model).eval()
    with torch.no_grad():
        for param in reference_model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    rows = list(datasets.load_dataset(str(REPO / "data" / "vlm_preferences"), split="train").select(range(40)))
    rows = [row for row in rows if row["images"]][:4]

    config = trl.DPOConfig(output_dir=str(tmp_path), beta=0.5, loss_type=[loss_type], report_to=[], use_cpu=True,
                           bf16=False, per_device_eval_batch_size=len(rows), max_length=None)
    trainer = trl.DPOTrainer(model=copy.deepcopy(model), ref_model=copy.deepcopy(model), args=config,
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=processor,
                             eval_dataset=datasets.Dataset.from_list(rows))
    batch = next(iter(trainer.get_eval_dataloader()))  # in row order: chosen rows, then rejected rows
    targets = batch["input_ids"][:, 1:]
    with torch.no_grad():
        logits = reference_model(**{key: value for key, value in batch.items() if key != "completion_mask"}).logits
        scored = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets[..., None])[..., 0]
        reference_logps = (scored * batch["completion_mask"][:, 1:]).sum(1)
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = reference_logps.chunk(2)
        trainer.precompute_ref_logps = True
        trainer.model.eval()
        trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["eval"].items()}
    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer's accelerator: gone for the next runs

    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    pairs = preprocessed(PreferencePreprocessor(PreferenceDataArgs(), labeller, 256), rows)
    with torch.no_grad():
        inputs = to_device(collator(pairs), "cpu")
        policy = VLMForTraining(model.eval())(inputs, SequenceLogps())
        reference = Reference(VLMForTraining(reference_model))(None, inputs)
        losses, chosen, rejected = dpo_loss(policy, reference, answer_tokens(inputs), DPOArgs(beta=0.5,
                                                                                              loss_type=loss_type))
    ours = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
            "rewards/margins": (chosen - rejected).mean(), "logps/chosen": policy.chunk(2)[0].mean(),
            "logps/rejected": policy.chunk(2)[1].mean()}
    assert float(losses.mean()) == pytest.approx(float(trl_loss), abs=1e-5)
    for name, value in ours.items():
        assert float(value) == pytest.approx(trl_metrics[name], abs=1e-5), name
    assert abs(trl_metrics["rewards/margins"]) > 1e-3  # the reference matters


def test_flags_that_cannot_serve_dpo_are_refused():
    with pytest.raises(ValueError, match="--packing and --max_tokens_per_batch"):
        PreferenceDataArgs(packing=True)
    with pytest.raises(ValueError, match="--label_smoothing smooths the robust"):
        DPOArgs(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="robust DPO needs it below 0.5"):
        DPOArgs(loss_type="robust", label_smoothing=0.6)
    with pytest.raises(ValueError, match="--loss_type 'sigmoid,hinge'"):
        DPOArgs(loss_type="sigmoid,hinge")
    with pytest.raises(ValueError, match="--loss_weights '1.0': give one finite weight"):
        DPOArgs(loss_type="sigmoid,sft", loss_weights="1.0")
    # TRL < 1.0's names are accepted, and said in TRL 1.16's spelling.
    rpo = DPOArgs(loss_type="sigmoid", rpo_alpha=0.5)
    assert rpo.losses == {"sigmoid": 1.0, "sft": 0.5}
    assert "write --loss_type sigmoid,sft --loss_weights 1.0,0.5" in rpo.describe()
    assert DPOArgs(rpo_alpha=0).losses == {"sigmoid": 1.0}  # --rpo_alpha 0: pure DPO, as before
    assert "conservative DPO" in DPOArgs(loss_type="sigmoid", label_smoothing=0.1).describe()
    with pytest.raises(ValueError, match="--beta"):
        DPOArgs(beta=0)


def test_lora_reference_is_the_base_model_and_costs_no_copy(tiny):
    """With LoRA the reference is the policy with its adapters disabled: the log-probabilities of a live frozen copy
    of the base model, while the adapted policy's differ."""
    model, _, preprocess, collator = tiny
    base = copy.deepcopy(model).eval()
    adapted = copy.deepcopy(model)
    peft_model, _ = add_lora(adapted, module_groups(adapted, dummy_image_inputs(adapted)), "projector,language_model",
                             LoraArgs(use_peft=True, lora_r=4, lora_alpha=8))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # LoRA's B starts at 0: give the adapters an effect
    adapted.eval()
    rows = list(datasets.load_dataset(str(REPO / "data" / "vlm_preferences"), split="train").select(range(4)))
    inputs = to_device(collator(preprocessed(preprocess, rows)), "cpu")
    step = VLMForTraining(adapted)
    with torch.no_grad():
        reference = Reference(step, peft_model)(None, inputs)
        frozen, policy = VLMForTraining(base)(inputs, SequenceLogps()), step(inputs, SequenceLogps())
    torch.testing.assert_close(reference, frozen, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(policy, frozen, atol=1e-2)


MESSAGES = [{"role": datasets.Value("string"),
             "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}]


def preference_row(question, chosen, rejected, image=None):
    content = ([{"type": "image", "text": None}] if image is not None else []) + [{"type": "text", "text": question}]
    answer = lambda text: [{"role": "assistant", "content": [{"type": "text", "text": text}]}]  # noqa: E731
    return {"prompt": [{"role": "user", "content": content}], "chosen": answer(chosen), "rejected": answer(rejected),
            "images": [image] if image is not None else []}


def write_preferences(path, rows):
    features = datasets.Features({"prompt": MESSAGES, "chosen": MESSAGES, "rejected": MESSAGES,
                                  "images": [datasets.Image()]})
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """rank{0,1}.parquet, one shard per data rank read in order at per-device batch 1 and accumulation 2: one rank's
    first window is text-only while the other's has images, then the reverse; single/all.parquet holds the same
    windows for one process (batch 4). Text answers are longer: a per-micro-batch mean would weight them unequally."""
    data = tmp_path_factory.mktemp("dpo_scenario")
    image = preference_row("What colour is the shape?", "red", "blue", RED)
    text = preference_row("What is the opposite of above?", "below, below, below, below", "above, above")
    write_preferences(data / "rank0.parquet", [image, image, text, text, image, text] * 4)
    write_preferences(data / "rank1.parquet", [text, text, image, image, text, image] * 4)
    (data / "single").mkdir()
    write_preferences(data / "single" / "all.parquet", [image, image, text, text] * 12)
    return data


STEPS = 4
SCENARIO = ["--max_steps", STEPS, "--logging_steps", 1, "--per_device_train_batch_size", 1,
            "--gradient_accumulation_steps", 2, "--dataset_name", "parquet", "--shuffle_buffer_size", 1,
            "--eval_dataset_name", "", "--eval_questions", "", "--beta", 0.5]


PRECOMPUTED = ["--precompute_ref_log_probs", "true"]
LORA = ["--use_peft", "true", "--lora_r", 4, "--lora_alpha", 8, "--lora_dropout", 0.0]  # dropout 0: same on any ranks
RUNS = {("ddp.yaml", "full"): [], ("fsdp2.yaml", "full"): [], ("zero2.yaml", "full"): [],
        ("zero3.yaml", "full"): ["--save_steps", 2, *PRECOMPUTED], ("ddp.yaml", "lora"): LORA}


@pytest.fixture(scope="module")
def truth(scenario, tmp_path_factory):
    """One process holding each whole window as one batch of 4 pairs: full fine-tuning and LoRA."""
    runs = {}
    for feature, flags in (("full", []), ("lora", LORA)):
        output_dir = tmp_path_factory.mktemp(f"dpo_single_{feature}")
        single = ["--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 1, "--data_files",
                  scenario / "single" / "all.parquet"]
        result = run_recipe(*SCENARIO, *flags, *single, "--output_dir", output_dir, recipe=DPO_RECIPE)
        assert result.returncode == 0, result.log[-3000:]
        runs[feature] = result, output_dir
    return runs


@pytest.fixture(scope="module")
def engine_runs(scenario, tmp_path_factory):
    runs = {}
    for (config, feature), flags in RUNS.items():
        output_dir = tmp_path_factory.mktemp(f"dpo_{config[:-5]}_{feature}")
        runs[config, feature] = run_engine(config, *SCENARIO, *flags, "--data_files", scenario / "rank*.parquet",
                                           "--output_dir", output_dir, recipe=DPO_RECIPE), output_dir
    return runs


@pytest.mark.launch
@pytest.mark.parametrize("config, feature", list(RUNS), ids=[f"{c[:-5]}-{f}" for c, f in RUNS])
def test_mixed_ranks_give_one_processs_losses(engine_runs, truth, config, feature):
    """Text-only and image pairs on different ranks at batch 1: every step's loss and gradient norm equal one
    process holding the whole window; a frozen reference is sharded where the policy is (FSDP2, ZeRO-3; under
    ZeRO-3 its log-probabilities precomputed)."""
    result, _ = engine_runs[config, feature]
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, config, wrapped="VLMForTraining")
    assert_same_curves(result.log, truth[feature][0].log, range(1, STEPS + 1), grad_norm=True)
    if feature == "lora":
        assert "reference: the policy with its LoRA adapters disabled" in result.log
        return
    held, total = map(lambda n: int(n.replace(",", "")),
                      re.search(r"reference: .* holding ([\d,]+) of its ([\d,]+)", result.log).groups())
    assert (held < total) == (config in ("fsdp2.yaml", "zero3.yaml")), (held, total)


@pytest.mark.launch
def test_precomputed_reference_log_probs_give_the_live_frozen_copys_losses(scenario, truth, tmp_path):
    """--precompute_ref_log_probs: a first pass over the pairs, kept per pair, then no reference model; every step
    equals the run with the live frozen copy. A benchmark scores the model at the end (docs/benchmarks.md); three
    more whose documents are of another form (test_hostile_six.py) are counted and named, and the model is saved:
    their scorers raised at the last step, before the save, and the run's model was lost."""
    hostile = hostile_benchmarks(tmp_path / "benchmarks")
    (tmp_path / "benchmarks" / "chartqa").symlink_to(REPO / "data" / "benchmarks" / "chartqa")
    result = run_recipe(*SCENARIO, "--precompute_ref_log_probs", "true", "--per_device_train_batch_size", 4,
                        "--gradient_accumulation_steps", 1, "--data_files", scenario / "single" / "all.parquet",
                        "--output_dir", tmp_path / "out", "--benchmarks", f"chartqa,{hostile}",
                        "--benchmark_data_dir", tmp_path / "benchmarks", "--benchmark_limit", 2,
                        # the untrained model never stops: MMBench's 1,024 answer tokens (lmms-eval's default) by
                        # whole-sequence forwards were 35 of this test's 38 s; the cap is said in the log
                        "--benchmark_max_new_tokens", 16, recipe=DPO_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert f"eval step {STEPS} | bench/chartqa/relaxed_overall " in result.log  # a benchmark at the end
    assert "(--benchmark_max_new_tokens caps them: not lmms-eval's scores)" in result.log
    assert "benchmark mmmu_val: no document was scored (missing_image_1 2): no numbers" in result.log
    assert "benchmark ai2d: 2 documents could not be scored (unscorable)" in result.log
    assert "bench/mmbench_en_dev_static/unscorable 1" in result.log
    saved = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert type(saved).__name__ == "LlavaForConditionalGeneration"
    assert "reference: log-probabilities of 2 pairs on this rank precomputed in a first pass" in result.log
    assert_same_curves(result.log, truth["full"][0].log, range(1, STEPS + 1), grad_norm=True, rel=1e-6)


@pytest.mark.launch
def test_resume_from_a_zero3_checkpoint_repeats_the_straight_run(engine_runs, scenario, tmp_path):
    """The policy's partitioned state and the data position come back; the reference's log-probabilities are
    precomputed again from the starting weights (the frozen copy partitioned), as in the straight run."""
    straight, output_dir = engine_runs["zero3.yaml", "full"]
    resumed = run_engine("zero3.yaml", *SCENARIO, *PRECOMPUTED, "--data_files", scenario / "rank*.parquet",
                         "--output_dir", tmp_path,
                         "--resume_from_checkpoint", output_dir / "checkpoints" / "checkpoint-2", recipe=DPO_RECIPE)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert_same_curves(resumed.log, straight.log, [3, 4], abs=1e-6, grad_norm=True)


@pytest.mark.launch
def test_outputs_load_and_the_pipeline_answers_what_the_model_generates(truth):
    """Full fine-tuning saves a model the pipeline loads; LoRA saves the merged model and the adapter."""
    output_dir = truth["full"][1]
    model = AutoModelForImageTextToText.from_pretrained(output_dir)
    processor = AutoProcessor.from_pretrained(output_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    inputs = processor(text=processor.apply_chat_template(messages, add_generation_prompt=True), images=[RED],
                       return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    messages[0]["content"][0]["image"] = RED
    answer = pipeline("image-text-to-text", model=str(output_dir))(text=messages, max_new_tokens=3,
                                                                   do_sample=False, return_full_text=False)
    assert answer[0]["generated_text"] == processor.decode(generated, skip_special_tokens=True)
    lora_dir = truth["lora"][1]
    assert (lora_dir / "adapter" / "adapter_config.json").exists()
    assert type(AutoModelForImageTextToText.from_pretrained(lora_dir)).__name__ == "LlavaForConditionalGeneration"
