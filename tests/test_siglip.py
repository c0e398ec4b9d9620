"""`--loss siglip`: SiglipModel + siglip_loss in clip_pretrain.py under every engine (2 CPU
processes), resume, and the saved model in the zero-shot pipeline (docs/clip.md, SigLIP)."""

import math
import re

import datasets
import pytest
import torch
from transformers import SiglipModel, pipeline

from launch import (
    REPO,
    assert_adam_weights_close,
    assert_engine,
    assert_same_curves,
    load_recipe,
    losses,
    run_engine,
    run_recipe,
)
from mmrecipes.contrastive.arguments import DataArgs, ModelArgs
from mmrecipes.contrastive.data import ImageTextPreprocessor, PairCollator
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.images import to_device

pytestmark = pytest.mark.launch

ENGINES = ["ddp.yaml", "zero3.yaml"]  # SigLIP under FSDP2 and ZeRO-2: by hand (tests/README.md); CLIP runs all four
STEPS = 6
RUN_ARGS = ["--loss", "siglip", "--max_steps", STEPS, "--logging_steps", 1, "--eval_steps", STEPS,
            "--per_device_train_batch_size", 16, "--gradient_accumulation_steps", 2, "--save_steps", 3]


def recall(log: str) -> float:
    return float(re.search(r"image_to_text_R@1 ([\d.]+)", log).group(1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for config in ENGINES:
        output_dir = tmp_path_factory.mktemp("siglip_" + config.split(".")[0])
        results[config] = (run_engine(config, *RUN_ARGS, "--output_dir", output_dir), output_dir)
    return results


@pytest.mark.parametrize("config", ENGINES)
def test_engine_is_real_and_trains_scale_and_bias(runs, config):
    result, output_dir = runs[config]
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, config, wrapped="SiglipForContrastiveTraining")
    loss = losses(result.log)
    assert sorted(loss) == list(range(1, STEPS + 1)) and loss[STEPS] < 0.7 * loss[1]
    assert "eval_pairs 512" in result.log  # every rank scored the whole held-out set
    model = SiglipModel.from_pretrained(output_dir)
    # Initialised at the paper's log(10) and -10 (not SiglipModel's zeros), both learned, saved [1]-shaped.
    assert model.logit_scale.shape == model.logit_bias.shape == (1,)
    assert model.logit_scale.item() != pytest.approx(math.log(10), abs=1e-4)
    assert -10 < model.logit_bias.item() < -9


def test_zero3_agrees_with_ddp(runs):
    """SigLIP's logit scale and bias are [1]-shaped parameters, partitioned under ZeRO-3 like any other."""
    ddp_result, ddp_dir = runs["ddp.yaml"]
    result, output_dir = runs["zero3.yaml"]
    assert ddp_result.returncode == 0 and result.returncode == 0
    assert_same_curves(result.log, ddp_result.log, range(1, STEPS + 1))
    assert recall(result.log) == recall(ddp_result.log)
    assert_adam_weights_close(SiglipModel.from_pretrained(output_dir).state_dict(),
                              SiglipModel.from_pretrained(ddp_dir).state_dict(), learning_rate=2e-3, steps=STEPS)


def test_resume_from_a_zero3_checkpoint(runs, tmp_path):
    """ZeRO-3's partitioned checkpoint, SigLIP's [1]-shaped bias partitioned too (tests/README.md: which
    engine resumes where)."""
    straight, output_dir = runs["zero3.yaml"]
    resumed = run_engine("zero3.yaml", *RUN_ARGS, "--output_dir", tmp_path,
                                "--resume_from_checkpoint", output_dir / "checkpoints" / "checkpoint-3")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert_same_curves(resumed.log, straight.log, [4, 5, 6], abs=1e-5)


PIPELINE_TEMPLATE = "This is a photo of {}."  # the zero-shot pipeline's default hypothesis_template


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default run cut to 160 steps (zero-shot top-1 above 0.2 there, 32 classes), its zero-shot
    evaluation with the pipeline's own template (to compare them)."""
    output_dir = tmp_path_factory.mktemp("siglip_default")
    return run_recipe("--loss", "siglip", "--max_steps", 160, "--zeroshot_templates", PIPELINE_TEMPLATE,
                      "--output_dir", output_dir), output_dir


def test_zero_shot_top1_in_the_loop_is_what_the_pipeline_gives(default_run):
    """The embedded zero-shot set (32 colour-shape classes, 146 held-out single-shape images) as the
    recipe scores it at the last step equals `pipeline("zero-shot-image-classification")` on the
    saved model with the same template: SigLIP's sigmoid scores rank the classes as its logits do."""
    result, output_dir = default_run
    assert result.returncode == 0, result.log[-3000:]
    logged = re.findall(r"^eval step \d+ .*\| zeroshot_top1 ([\d.]+) \| zeroshot_top5 ([\d.]+) \| zeroshot_images 146",
                        result.log, re.M)
    top1, top5 = map(float, logged[-1])
    rows = datasets.load_dataset(str(REPO / "data" / "shapes_zeroshot"), split="test")
    names = rows.features["label"].names
    classify = pipeline("zero-shot-image-classification", model=str(output_dir))
    correct = sum(classify(row["image"], candidate_labels=names)[0]["label"] == names[row["label"]] for row in rows)
    assert top1 == pytest.approx(correct / len(rows), abs=1e-4)
    assert 1 / 32 < top1 <= top5  # above chance


def test_default_run_learns_and_the_pipeline_answers(default_run):
    """The default data, through `pipeline("zero-shot-image-classification")`: each held-out image
    picks its own caption among 4 (chance 0.25)."""
    result, output_dir = default_run
    assert result.returncode == 0, result.log[-3000:]
    assert recall(result.log) > 0.1  # retrieval among 512 captions: chance 0.002
    rows = datasets.load_dataset(str(REPO / "data" / "shapes"), split="test").select(range(0, 256, 4))
    classify = pipeline("zero-shot-image-classification", model=str(output_dir))
    correct = 0
    for i, row in enumerate(rows):
        candidates = [rows[(i + k * 16) % len(rows)]["text"] for k in range(4)]
        scores = classify(row["image"], candidate_labels=candidates)
        correct += max(scores, key=lambda s: s["score"])["label"] == row["text"]
    assert correct / len(rows) > 0.6


def test_pipeline_scores_what_training_computed(default_run):
    """The saved tokenizer and image processor reproduce training's inputs (caption padded to 64
    with the attention mask, the same pixels): the pipeline's scores are the trained model's
    sigmoid(logits) on the recipe's own collated batch."""
    result, output_dir = default_run
    assert result.returncode == 0, result.log[-3000:]
    model, tokenizer, image_processor = build_contrastive(ModelArgs(loss="siglip", model_name_or_path=str(output_dir)))
    row = datasets.load_dataset(str(REPO / "data" / "shapes"), split="test")[3]
    captions = [row["text"], "a large green star", "a small blue circle left of a large red square"]
    preprocess = ImageTextPreprocessor(DataArgs(), tokenizer, image_processor, max_length=64)
    out = preprocess({"image": [row["image"]] * 3, "text": captions})
    batch = PairCollator(tokenizer, image_processor, pad_to_length=64)(
        [dict(zip(out, values)) for values in zip(*out.values())])
    assert batch["input_ids"].shape == (3, 64)
    with torch.no_grad():
        image_embeds, text_embeds, scale, bias = model(**to_device(batch, torch.device("cpu")))
    expected = torch.sigmoid(scale * image_embeds[0] @ text_embeds.T + bias)
    classify = pipeline("zero-shot-image-classification", model=str(output_dir))
    scores = classify(row["image"], candidate_labels=captions, hypothesis_template="{}")  # the caption as is
    by_label = {s["label"]: s["score"] for s in scores}
    torch.testing.assert_close(torch.tensor([by_label[c] for c in captions]), expected, atol=1e-5, rtol=1e-4)


def test_loss_that_does_not_match_the_saved_model_rejected(default_run, tmp_path):
    _, siglip_dir = default_run
    with pytest.raises(ValueError, match="is a 'siglip' model, not clip: set --loss"):
        load_recipe().main(["--model_name_or_path", str(siglip_dir), "--report_to", "none",
                            "--output_dir", str(tmp_path)])
