"""SigLIP 2 NaFlex (`--loss siglip --max_num_patches N`): a tiny `Siglip2Model` with its own image processor and
tokenizer class trains on images of mixed aspect ratios, batched by a patch budget, under DDP and FSDP2 with the
same losses, and its zero-shot accuracy in the loop is what the pipeline gives on the saved model (docs/clip.md)."""

import io

import datasets
import pytest
import torch
from PIL import Image
from transformers import Siglip2ImageProcessor, Siglip2Model, Siglip2Tokenizer, SiglipImageProcessor, pipeline

from launch import REPO, assert_engine, assert_same_curves, losses, run_engine, run_recipe
from mmrecipes.contrastive.arguments import DataArgs, ModelArgs
from mmrecipes.contrastive.data import build_dataloader, check_media_flags
from mmrecipes.contrastive.flops import ContrastiveFlops, clip_train_flops_per_sample
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.contrastive.patch_dropout import add_patch_dropout
from mmrecipes.distributed import Ranks
from mmrecipes.images import to_device

MAX_PATCHES = 16  # 8-pixel patches: a square image is 4 x 4 of them, a 3:2 one 3 x 5, a 2:3 one 5 x 3
BUDGET = 160  # patches per micro-batch: 10 square images, or more of the others
STEPS = 6
PIPELINE_TEMPLATE = "This is a photo of {}."  # the zero-shot pipeline's default hypothesis_template
GRIDS = {(4, 4), (3, 5), (5, 3)}


def padded_to(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """`image` centred on a canvas of `size`, in its own corner colour (the shapes' background)."""
    canvas = Image.new("RGB", size, image.getpixel((0, 0)))
    canvas.paste(image, ((size[0] - image.width) // 2, (size[1] - image.height) // 2))
    return canvas


@pytest.fixture(scope="module")
def mixed_shapes(tmp_path_factory):
    """Embedded image-caption pairs, a third of the images widened to 96 x 64 and a third made 64 x 96: two
    training shards and a test file. Returns (training glob, test file)."""
    root = tmp_path_factory.mktemp("mixed_shapes")
    shapes = datasets.load_dataset(str(REPO / "data" / "shapes")).cast_column("image", datasets.Image(decode=False))
    for name, split, count, shards in (("train", "train", 1024, 2), ("test", "test", 128, 1)):
        rows = []
        for row in shapes[split]:
            try:
                image = Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB")
            except Exception:  # the embedded set's deliberately broken rows
                continue
            size = [(64, 64), (96, 64), (64, 96)][len(rows) % 3]
            rows.append({"image": padded_to(image, size), "text": row["text"]})
            if len(rows) == count:
                break
        table = datasets.Dataset.from_list(rows).cast_column("image", datasets.Image())
        for shard in range(shards):
            table.shard(shards, shard).to_parquet(str(root / f"{name}-{shard}.parquet"))
    return str(root / "train-*.parquet"), str(root / "test-0.parquet")


@pytest.fixture(scope="module")
def tiny():
    return build_contrastive(ModelArgs(loss="siglip", max_num_patches=MAX_PATCHES))


def test_tiny_model_is_siglip2_with_its_own_processor_and_tokenizer(tiny):
    model, tokenizer, image_processor = tiny
    assert isinstance(model, Siglip2Model) and model.hf_architecture == "Siglip2Model"
    assert isinstance(image_processor, Siglip2ImageProcessor) and isinstance(tokenizer, Siglip2Tokenizer)
    assert image_processor.max_num_patches == MAX_PATCHES and tokenizer.model_max_length == 64


def test_batches_hold_mixed_aspect_ratios_within_the_budget_and_padding_changes_no_embedding(tiny, mixed_shapes):
    """Whole rows up to the patch budget, each image on its own grid; padded to the batch's longest image, each
    row embeds as it does alone (unpadded), so the padding and the mask change nothing."""
    model, tokenizer, image_processor = tiny
    train_files, _ = mixed_shapes
    args = DataArgs(dataset_name="parquet", data_files=train_files, max_patches_per_batch=BUDGET,
                    dataloader_num_workers=0)
    loader = build_dataloader(args, "train", train_files, tokenizer, image_processor, batch_size=16,
                              ranks=Ranks(), shuffle_seed=0, pad_to_max_length=True)
    batches = [batch for batch, _ in zip(loader, range(5))]
    for batch, following in zip(batches, batches[1:]):
        patches = batch["spatial_shapes"].prod(-1)
        assert int(patches.sum()) <= BUDGET < int(patches.sum() + following["spatial_shapes"][0].prod())  # full
        assert torch.equal(batch["pixel_attention_mask"].sum(-1), patches.int())
        assert batch["pixel_values"].shape == (len(patches), int(patches.max()), 8 * 8 * 3)
    grids = {tuple(grid) for grid in batches[0]["spatial_shapes"].tolist()}
    assert grids == GRIDS, grids

    batch = batches[0]
    model.eval()
    with torch.no_grad():
        together = model(**to_device(batch, torch.device("cpu")))[0]
        for row in range(len(batch["input_ids"])):
            patches = int(batch["spatial_shapes"][row].prod())
            one = slice(row, row + 1)
            alone = {"input_ids": batch["input_ids"][one], "attention_mask": batch["attention_mask"][one],
                     "pixel_values": batch["pixel_values"][one, :patches],
                     "pixel_attention_mask": batch["pixel_attention_mask"][one, :patches],
                     "spatial_shapes": batch["spatial_shapes"][one]}
            torch.testing.assert_close(model(**alone)[0][0], together[row], atol=1e-5, rtol=1e-4)
    model.train()


def test_flops_count_each_images_real_patches(tiny):
    """A NaFlex image of 4 x 4 patches costs what a fixed 32-pixel SigLIP image of 8-pixel patches does (the same
    towers); a 3 x 5 image costs less, its 15 patches."""
    model, _, _ = tiny
    fixed, _, _ = build_contrastive(ModelArgs(loss="siglip"))
    flops = ContrastiveFlops(model, 64)
    squares = {"input_ids": [[0]] * 3, "spatial_shapes": torch.tensor([[4, 4]] * 3)}
    assert flops(squares) == pytest.approx(3 * clip_train_flops_per_sample(fixed, 64))
    mixed = {"input_ids": [[0]] * 3, "spatial_shapes": torch.tensor([[4, 4], [3, 5], [5, 3]])}
    assert flops(mixed) == pytest.approx(3 * flops.per_caption + flops.per_image(16) + 2 * flops.per_image(15))
    assert flops(mixed) < flops(squares)


def test_what_naflex_cannot_serve_is_refused_before_the_first_step(tiny, tmp_path):
    model, _, image_processor = tiny
    with pytest.raises(ValueError, match="--patch_dropout .* SigLIP 2 NaFlex"):
        add_patch_dropout(model, 0.5)
    with pytest.raises(ValueError, match="--train_augment .* drop --train_augment"):
        check_media_flags(DataArgs(train_augment=True), image_processor)
    with pytest.raises(ValueError, match="--max_patches_per_batch 8 is below one image's 16 patches"):
        check_media_flags(DataArgs(max_patches_per_batch=8), image_processor)
    with pytest.raises(ValueError, match="--max_patches_per_batch batches SigLIP 2 NaFlex images"):
        check_media_flags(DataArgs(max_patches_per_batch=256), SiglipImageProcessor())
    with pytest.raises(ValueError, match="--max_num_patches sizes SigLIP 2 NaFlex images; this clip model"):
        build_contrastive(ModelArgs(loss="clip", max_num_patches=16))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is a 'siglip2' model, not clip: set --loss siglip"):
        build_contrastive(ModelArgs(loss="clip", model_name_or_path=str(tmp_path)))


@pytest.fixture(scope="module")
def runs(mixed_shapes, tmp_path_factory):
    train_files, test_file = mixed_shapes
    results = {}
    for config in ("ddp.yaml", "fsdp2.yaml"):
        output_dir = tmp_path_factory.mktemp("naflex_" + config.split(".")[0])
        results[config] = run_engine(
            config, "--loss", "siglip", "--max_num_patches", MAX_PATCHES, "--max_patches_per_batch", BUDGET,
            "--dataset_name", "parquet", "--data_files", train_files, "--eval_data_files", test_file,
            "--max_steps", STEPS, "--logging_steps", 1, "--eval_steps", STEPS, "--learning_rate", 3e-3,
            "--zeroshot_dataset", "embedded:shapes_zeroshot",  # named: the files above are not the embedded set
            "--zeroshot_templates", PIPELINE_TEMPLATE, "--output_dir", output_dir), output_dir
    return results


@pytest.mark.launch
def test_fsdp2_trains_siglip2_with_ddps_losses(runs):
    (ddp, _), (fsdp2, _) = runs["ddp.yaml"], runs["fsdp2.yaml"]
    assert ddp.returncode == 0, ddp.log[-3000:]
    assert fsdp2.returncode == 0, fsdp2.log[-3000:]
    assert_engine(ddp.log, "ddp.yaml")
    assert_engine(fsdp2.log, "fsdp2.yaml", wrapped="Siglip2ForContrastiveTraining")
    assert_same_curves(fsdp2.log, ddp.log, range(1, STEPS + 1))
    assert losses(ddp.log)[STEPS] < losses(ddp.log)[1]
    assert "eval_pairs 128" in ddp.log and "eval_pairs 128" in fsdp2.log  # mixed grids through evaluation


@pytest.mark.launch
def test_zero_shot_in_the_loop_is_what_the_pipeline_gives_on_the_saved_model(runs):
    """The embedded zero-shot set as the DDP run scored it at its last step, and FSDP2's, equal
    `pipeline("zero-shot-image-classification")` on the saved Siglip2Model (its processor pads each image to
    --max_num_patches, the loop to the batch's longest: the mask makes them the same)."""
    result, output_dir = runs["ddp.yaml"]
    assert result.returncode == 0, result.log[-3000:]
    rows = datasets.load_dataset(str(REPO / "data" / "shapes_zeroshot"), split="test")
    names = rows.features["label"].names
    classify = pipeline("zero-shot-image-classification", model=str(output_dir))
    assert isinstance(classify.model, Siglip2Model) and isinstance(classify.tokenizer, Siglip2Tokenizer)
    correct = sum(classify(row["image"], candidate_labels=names)[0]["label"] == names[row["label"]] for row in rows)
    for config in ("ddp.yaml", "fsdp2.yaml"):
        logged = float(runs[config][0].log.split("zeroshot_top1 ")[-1].split()[0])
        assert logged == pytest.approx(correct / len(rows), abs=1e-4), config


@pytest.mark.launch
def test_the_feature_cache_takes_naflex_batches_as_one_big_batch(mixed_shapes, tmp_path):
    """--contrastive_accumulation feature_cache forwards the patches, mask and grids twice (cached, then with the
    feature gradients): 2 micro-batches of 8 mixed-ratio rows give the loss of one batch of the same 16 rows."""
    train_files, _ = mixed_shapes
    common = ["--loss", "siglip", "--max_num_patches", MAX_PATCHES, "--dataset_name", "parquet", "--data_files",
              train_files, "--eval_split", "", "--zeroshot_dataset", "", "--max_steps", 2, "--logging_steps", 1]
    cached = run_recipe(*common, "--per_device_train_batch_size", 8, "--gradient_accumulation_steps", 2,
                        "--contrastive_accumulation", "feature_cache", "--output_dir", tmp_path / "cached")
    big = run_recipe(*common, "--per_device_train_batch_size", 16, "--output_dir", tmp_path / "big")
    assert cached.returncode == 0, cached.log[-3000:]
    assert big.returncode == 0, big.log[-3000:]
    assert_same_curves(cached.log, big.log, [1, 2], rel=1e-5)
