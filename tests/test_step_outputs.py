"""A recipe's own loss in its own file: a copy of vlm_finetune.py defines a per-token label-smoothed cross-entropy
as a step output (a `StepOutput` placing its tokens where a sequence splits) and trains with their sum, no library file
touched. Under DDP (2 data ranks) and under ZeRO-3 with the sequence split over 2 ranks it gives one process's losses
and gradient norms: the output runs inside the engine's forward, and splits and reduces itself over the group as the
library's outputs do."""

import pytest
import torch
import torch.nn.functional as F

from launch import VLM_RECIPE, assert_same_curves, losses, run_engine, run_recipe
from mmrecipes.vlm.arguments import VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.outputs import Logits, LossSum
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from test_family_conformance import collator_row, colour_conversation, square
from test_sequence_parallel import rank_files

LABEL_SMOOTHED = '''
import torch.nn.functional as F

from mmrecipes.vlm.model.outputs import StepOutput


class LabelSmoothedTokens(StepOutput):
    """Each target token's cross-entropy with torch's label smoothing, `[rows, tokens - 1]`, 0 elsewhere: a
    per-token output, placed at its positions where a sequence splits."""

    splits = True

    def __init__(self, smoothing=0.1):
        self.smoothing = smoothing

    def compute(self, forward):
        logits = forward.logits(forward.positions).float()
        return F.cross_entropy(logits.transpose(1, 2), forward.targets, ignore_index=-100, reduction="none",
                               label_smoothing=self.smoothing)

    def reduce(self, value, shard):
        return shard.sum(shard.place(value))[:, :shard.length - 1]


def main('''
TRAINED = "                summed, extra = model(to_device(batch, accelerator.device), loss)\n"


def copied_recipe(folder):
    """vlm_finetune.py copied to `folder`, its step's output the per-token label-smoothed loss defined in the copy,
    summed in its loop."""
    source = VLM_RECIPE.read_text()
    assert source.count("\ndef main(") == 1 and source.count("    loss = LossSum(balance)\n") == 1
    assert source.count(TRAINED) == 1
    copy = folder / "vlm_finetune_label_smoothed.py"
    copy.write_text(source.replace("\ndef main(", LABEL_SMOOTHED, 1).replace(
        "    loss = LossSum(balance)\n", "    loss = LabelSmoothedTokens(smoothing=0.1)\n").replace(
        TRAINED, TRAINED.replace("loss)", "loss).sum(), 0.0")))
    return copy


def test_the_copied_output_is_torchs_label_smoothed_cross_entropy(tmp_path):
    namespace = {}
    exec(LABEL_SMOOTHED.removesuffix("def main("), namespace)
    model, processor = load_vlm(VLMModelArgs())
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    batch = collator([collator_row(labeller, colour_conversation("red"), [square("red")]),
                      collator_row(labeller, colour_conversation("blue"), [square("blue")])])
    step = VLMForTraining(model)
    logits, labels = step(batch, Logits())[:, :-1].float(), batch["labels"][:, 1:]
    smoothed = step(batch, namespace["LabelSmoothedTokens"](smoothing=0.1)).sum()
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", label_smoothing=0.1)
    torch.testing.assert_close(smoothed, expected, rtol=1e-6, atol=1e-5)
    plain = step(batch, LossSum()).summed  # the plain CE fails the same comparison
    assert not torch.allclose(plain, expected, rtol=1e-6, atol=1e-5), (float(plain), float(expected))


@pytest.mark.launch
def test_a_recipes_own_loss_trains_under_ddp_and_split_under_zero3_as_one_process(tmp_path):
    rank_files(tmp_path)
    recipe = copied_recipe(tmp_path)
    common = ["--max_steps", 2, "--logging_steps", 1, "--dataset_name", "parquet", "--dataset_weights", "",
              "--shuffle_buffer_size", 1, "--eval_dataset_name", "", "--ddp_timeout", 120,
              "--per_device_train_batch_size", 1]
    whole = ["--gradient_accumulation_steps", 4, "--data_files", tmp_path / "single" / "all.parquet"]
    truth = run_recipe(*common, *whole, "--output_dir", tmp_path / "one", recipe=recipe)
    assert truth.returncode == 0, truth.log[-3000:]
    plain = run_recipe(*common, *whole, "--output_dir", tmp_path / "plain", recipe=VLM_RECIPE)
    assert abs(losses(plain.log)[1] - losses(truth.log)[1]) > 1e-3  # the copy's own loss trained, not the library's
    runs = {"ddp.yaml": ["--gradient_accumulation_steps", 2, "--data_files", tmp_path / "rank*.parquet"],
            "zero3.yaml": [*whole, "--sequence_parallel_size", 2]}
    for config, flags in runs.items():
        result = run_engine(config, *common, *flags, "--output_dir", tmp_path / config, recipe=recipe)
        assert result.returncode == 0, result.log[-3000:]
        assert_same_curves(result.log, truth.log, [1, 2], rel=1e-5, grad_norm=True)
    assert "sequence parallel: each sequence split over 2 ranks" in result.log


def test_an_output_that_does_not_declare_its_split_is_refused_where_a_sequence_splits():
    """Every output split by default and summed the ranks' values elementwise: a per-token output without a `reduce`
    of its own summed different positions, silently. Now an output says how it splits, or is refused there (and
    runs as before on whole sequences)."""
    from mmrecipes.vlm.model.outputs import StepOutput

    class PerTokenLoss(StepOutput):  # as a forker writes it: no `splits`, no `reduce`
        def compute(self, forward):
            return forward.logits(forward.positions).float().logsumexp(-1)

    model, processor = load_vlm(VLMModelArgs())
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    batch = collator([collator_row(labeller, colour_conversation("red"), [square("red")])])
    assert VLMForTraining(model)(batch, PerTokenLoss()).shape == batch["labels"][:, 1:].shape  # whole: as before
    split = VLMForTraining(model, sequence_parallel=object())  # refused before the split is asked for
    with pytest.raises(TypeError, match="PerTokenLoss does not declare how it splits over a sequence-parallel group: "
                                        "set `splits = False`.* or `splits = True` with its `reduce`"):
        split(batch, PerTokenLoss())


def test_the_step_encodes_the_media_and_builds_the_language_models_inputs_apart():
    """`_hidden_states` as two steps, each testable alone: an image row's features reach the language model as its
    encoder outputs; a text-only row's dummy image is encoded (the tower runs on every rank) and never reaches it;
    packed rows give per-sample positions and no mask."""
    from mmrecipes.images import to_device

    model, processor = load_vlm(VLMModelArgs())
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    image_row = collator_row(labeller, colour_conversation("red"), [square("red")])
    text_row = collator_row(labeller, [{"role": "user", "content": [{"type": "text", "text": "One, two?"}]},
                                       {"role": "assistant", "content": [{"type": "text", "text": "three"}]}], [])
    step = VLMForTraining(model)
    for rows, packing in (([image_row], False), ([text_row], False), ([image_row, text_row], True)):
        batch = to_device(ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor),
                                       packing)(rows), "cpu")
        media = {key: value for key, value in batch.items() if key not in (
            "input_ids", "attention_mask", "labels", "dummy_image", "sample_lengths", "media_per_sample")}
        encoded, dummies = step.encode_media(media, batch["dummy_image"])
        assert (set(encoded), len(dummies)) == (({"image"}, 0) if not batch["dummy_image"] else (set(), 1))
        inputs = step.lm_inputs(batch["input_ids"], batch["attention_mask"], media, encoded,
                                step.dummy_input_names(batch), batch.get("sample_lengths"),
                                batch.get("media_per_sample"))
        assert ("mm_encoder_outputs" in inputs) == (not batch["dummy_image"]) and "pixel_values" not in inputs
        assert (inputs["attention_mask"] is None) == packing == ("position_ids" in inputs)
