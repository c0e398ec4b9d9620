"""CLAP in clip_pretrain.py: audio-caption pairs train a ClapModel with either loss (docs/clip.md, CLAP).

In process: a step split over 2 gloo ranks with uneven rows is one process's step (loss, gradients), which the audio
tower's per-rank BatchNorm broke; bad clips are counted; CLAP's crop and fusion rules. Launched: the recipe under
DDP, FSDP2, ZeRO-2 and ZeRO-3 (each loss on several), each agreeing with DDP, and the saved model in
`pipeline("zero-shot-audio-classification")`.
"""

import io
import math
import re
import sys
import tarfile

import av
import datasets
import numpy
import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode
from transformers import ClapFeatureExtractor, ClapModel, pipeline

from gloo import averaged_difference, run_on_ranks, taken_gradients
from launch import (
    REPO,
    accelerate_launch,
    assert_adam_weights_close,
    assert_engine,
    assert_resume_repeats,
    assert_same_curves,
    losses,
    run_engine,
    run_recipe,
)
from mmrecipes.audio import decode_audio
from mmrecipes.contrastive import losses as contrastive_losses
from mmrecipes.contrastive.arguments import AUDIO_PAIR_COUNTED, DataArgs, ModelArgs
from mmrecipes.contrastive.audio_pairs import clip_features, stacked_clips, window_rule
from mmrecipes.contrastive.data import AudioTextPreprocessor, PairCollator, build_dataloader, data_modality
from mmrecipes.contrastive.flops import ContrastiveFlops
from mmrecipes.contrastive.grad_cache import grad_cache_backward
from mmrecipes.contrastive.models import build_contrastive
from mmrecipes.contrastive.patch_dropout import add_patch_dropout
from mmrecipes.contrastive.tower_locking import LockArgs, lock_towers
from mmrecipes.distributed import Ranks, make_accelerator
from mmrecipes.images import to_device
from mmrecipes.paths import EMBEDDED

sys.path.insert(0, str(REPO / "data_prep"))
from make_audio import encode_flac, tone  # noqa: E402
from make_audio_captions import LABELS  # noqa: E402

PAIRS = EMBEDDED / "audio_captions"


def embedded_rows(count: int) -> dict:
    return datasets.load_dataset(str(PAIRS), split="test")[:count]


def collated(tokenizer, extractor, rows: dict) -> dict:
    out = AudioTextPreprocessor(DataArgs(), tokenizer, extractor, 32)(rows)
    return PairCollator(tokenizer, extractor)([dict(zip(out, values)) for values in zip(*out.values())])


def _split_step(rank, world_size, loss):
    """One step's loss and gradients on this rank's uneven share (5 or 3 of 8 rows) against the whole batch's,
    with the audio tower's BatchNorm global (the recipe's) and per rank (a plain BatchNorm2d)."""
    results = []
    for per_rank in (False, True):
        torch.manual_seed(0)
        model, tokenizer, extractor = build_contrastive(ModelArgs(loss=loss), "audio")
        if per_rank:
            model.audio_model.audio_encoder.batch_norm.__class__ = torch.nn.BatchNorm2d
        batch = to_device(collated(tokenizer, extractor, embedded_rows(8)), "cpu")
        loss_fn = contrastive_losses.clip_loss if loss == "clip" else contrastive_losses.siglip_loss
        alone = [dist.new_group([one]) for one in range(world_size)]
        whole = loss_fn(*model(**batch), group=alone[rank])  # every rank: all 8 rows, as one process
        whole.backward()
        truth = taken_gradients(model)
        rows = slice(0, 5) if rank == 0 else slice(5, 8)
        part = loss_fn(*model(**{key: value[rows] for key, value in batch.items()}))
        part.backward()
        mean = part.detach().clone()
        dist.all_reduce(mean)
        results.append((abs(mean.item() / world_size - whole.item()) / whole.item(),
                        averaged_difference(model, truth, world_size)))
    return results


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_two_uneven_ranks_step_as_one_process(loss):
    """The gathered losses are exact on ranks of 5 and 3 rows (float32 rounding: 1e-5 of the largest gradient), and
    so is the audio tower only with its BatchNorm global: per rank, its statistics differ from the batch's."""
    (global_loss, global_grads), (per_rank_loss, per_rank_grads) = run_on_ranks(_split_step, 2, loss)[0]
    assert global_loss < 1e-6 and global_grads < 1e-5
    assert per_rank_grads > 1e-3


def _feature_cache_and_tiles(rank, world_size):
    torch.manual_seed(0)
    model, tokenizer, extractor = build_contrastive(ModelArgs(), "audio")
    model = model.double()
    model.audio_model.audio_encoder.batch_norm.eval()  # at fixed statistics: a function of each row alone
    batch = to_device(collated(tokenizer, extractor, embedded_rows(8)), "cpu")
    batch["input_features"] = batch["input_features"].double()
    whole = contrastive_losses.clip_loss(*model(**batch))
    whole.backward()
    truth = taken_gradients(model)
    tiled = contrastive_losses.clip_loss(*model(**batch), tile_size=3).item()
    micro_batches = [{key: value[rows] for key, value in batch.items()} for rows in (slice(0, 5), slice(5, 8))]
    accelerator = make_accelerator(gradient_accumulation_steps=2)
    cached = grad_cache_backward(accelerator, model, micro_batches, contrastive_losses.clip_loss).item()
    scale = max(grad.abs().max() for grad in truth.values())  # relative to the largest (a key bias's is 0)
    worst = max((param.grad - truth[name]).abs().max() for name, param in model.named_parameters() if name in truth)
    return whole.item(), tiled, cached, (worst / scale).item()


def test_feature_cache_and_tiled_loss_take_clap_batches():
    """--contrastive_accumulation feature_cache over micro-batches of 5 and 3 rows gives the loss and gradients of one
    batch of the 8, and --loss_tile_size 3 the loss of the whole matrix (float64). The BatchNorm is held at fixed
    statistics here: in training each micro-batch is normalised with its own (docs/clip.md, CLAP)."""
    whole, tiled, cached, worst = run_on_ranks(_feature_cache_and_tiles, 1)[0]
    assert tiled == pytest.approx(whole, rel=1e-12) and cached == pytest.approx(whole, rel=1e-12)
    assert worst < 1e-9


def test_tiny_clap_follows_the_data_and_a_checkpoint_must_match(tmp_path):
    assert data_modality(DataArgs(dataset_name="embedded:audio_captions")) == "audio"
    assert data_modality(DataArgs()) == "image"
    model, tokenizer, extractor = build_contrastive(ModelArgs(), "audio")
    ClapModel(model.config).save_pretrained(tmp_path)  # a plain checkpoint: its scales 0-dim, no bias
    tokenizer.save_pretrained(tmp_path)
    extractor.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="the data holds image, and this clap model takes audio"):
        build_contrastive(ModelArgs(model_name_or_path=str(tmp_path)), "image")
    loaded, _, loaded_extractor = build_contrastive(ModelArgs(model_name_or_path=str(tmp_path), loss="siglip"), "audio")
    assert loaded.logit_bias.item() == -10.0 and loaded_extractor.truncation == "rand_trunc"
    with pytest.raises(ValueError, match="no image tower"):
        add_patch_dropout(model, 0.5)
    with pytest.raises(ValueError, match="no image tower"):
        lock_towers(model, LockArgs(lock_image=True))
    assert lock_towers(model, LockArgs(lock_text=True, lock_text_unlocked_layers=1))  # RoBERTa's encoder.layer


def wav(seconds: float) -> bytes:
    """A 16-bit 8 kHz WAV of a tone."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000, layout="mono")
        frame = av.AudioFrame.from_ndarray((tone(440.0, seconds) * 32767).astype(numpy.int16)[None], format="s16",
                                           layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buffer.getvalue()


def ten_hour_flac() -> bytes:
    """A FLAC whose STREAMINFO says 10 hours (its 36-bit sample count, after the rate, channels and bits), what a
    10-hour recording's header says: refused before a sample is decoded."""
    data = bytearray(encode_flac(tone(440.0, 1.0), padding=0))
    fields = int.from_bytes(data[18:26], "big")
    data[18:26] = ((fields >> 36 << 36) | 10 * 3600 * 8000).to_bytes(8, "big")
    return bytes(data)


def mp3(seconds: float) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp3") as container:
        stream = container.add_stream("mp3", rate=24000, layout="mono")
        samples = numpy.repeat(tone(660.0, seconds), 3)[None]
        for start in range(0, samples.shape[1], 1152):
            frame = av.AudioFrame.from_ndarray(samples[:, start:start + 1152].copy(), format="flt", layout="mono")
            frame.sample_rate = 24000
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def test_bad_clips_are_counted_and_good_ones_of_every_format_kept(tmp_path):
    """Rows as `datasets` holds them (bytes, a path) and LAION's webdataset layout (.flac + .json with a "text" list):
    unreadable audio, digital silence, a file whose header says 10 hours, a caption-only row and a clip-only row are
    counted by kind; FLAC, WAV and MP3 clips train, the 3 s one cropped to the 2 s window."""
    (tmp_path / "clip.wav").write_bytes(wav(1.0))
    # a skip's count travels with the next kept row: a good row last
    rows = [(encode_flac(tone(440.0, 1.0)), "a flac tone"), (str(tmp_path / "clip.wav"), "a wav tone, by path"),
            (b"not audio at all", "garbage"), (encode_flac(numpy.zeros(8000, numpy.float32)), "nothing"),
            (ten_hour_flac(), "ten hours"), (None, "a caption without its clip"), (encode_flac(tone(330.0, 1.0)), ""),
            (encode_flac(tone(440.0, 3.0)), "a long tone"), (mp3(1.0), "an mp3 tone")]
    # as `datasets` stores an Audio column ({"bytes", "path"}; writing its Audio feature needs torchcodec)
    features = datasets.Features({"audio": {"bytes": datasets.Value("binary"), "path": datasets.Value("string")},
                                  "text": datasets.Value("string")})
    datasets.Dataset.from_list([{"audio": None if clip is None else {"bytes": None, "path": clip} if isinstance(
        clip, str) else {"bytes": clip, "path": None}, "text": text} for clip, text in rows],
        features=features).to_parquet(tmp_path / "rows.parquet")
    with tarfile.open(tmp_path / "shard-00000.tar", "w") as tar:
        for key, (clip, caption) in enumerate([(b"broken", b'{"text": ["a broken clip"]}'),
                                               (encode_flac(tone(880.0, 1.0)), b'{"text": ["a high tone", "x"]}')]):
            for name, data in ((f"{key:05d}.flac", clip), (f"{key:05d}.json", caption)):
                member = tarfile.TarInfo(name)
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    model, tokenizer, extractor = build_contrastive(ModelArgs(), "audio")
    sources = [DataArgs(dataset_name="parquet", data_files=str(tmp_path / "rows.parquet"), audio_max_seconds=60.0),
               DataArgs(dataset_name="webdataset", data_files=str(tmp_path / "shard-00000.tar"), audio_column="flac",
                        caption_column="json")]
    counts, kept = [], []
    for args in sources:
        assert data_modality(args) == "audio"
        batches = list(build_dataloader(args, "train", args.data_files, tokenizer, extractor, batch_size=16,
                                        ranks=Ranks()))
        counts.append(dict(zip(AUDIO_PAIR_COUNTED, sum(batch["data_counts"] for batch in batches).tolist())))
        kept.append([text.strip() for batch in batches
                     for text in tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)])
        assert all(batch["input_features"].shape[1:] == (1, 201, 64) for batch in batches)
    assert counts[0] == {"no_caption": 1, "bad_text": 0, "bad_row": 0, "bad_shard": 0, "no_audio": 1,
                         "audio_undecodable": 1, "audio_empty": 0, "audio_too_long": 1, "audio_silent": 1,
                         "audio_cropped": 1}
    assert sorted(kept[0]) == ["a flac tone", "a long tone", "a wav tone, by path", "an mp3 tone"]
    assert counts[1]["audio_undecodable"] == 1 and kept[1] == ["a high tone"]
    outputs = run_on_ranks(_read_on_rank, 2, tmp_path / "rows.parquet")
    assert sorted(outputs[0] + outputs[1]) == sorted(kept[0])  # two ranks read every good row once


def _read_on_rank(rank, world_size, path):
    model, tokenizer, extractor = build_contrastive(ModelArgs(), "audio")
    args = DataArgs(dataset_name="parquet", data_files=str(path), audio_max_seconds=60.0)
    loader = build_dataloader(args, "train", args.data_files, tokenizer, extractor, batch_size=4,
                              ranks=Ranks(rank, world_size))
    return [text.strip() for batch in loader
            for text in tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)]


def test_crops_follow_the_row_seed_and_fusion_flags_as_the_extractor():
    """rand_trunc: a longer clip's crop is the extractor's own (numpy's generator at the row's seed), the same for the
    same seed wherever it runs, another for another; fusion: a longer clip gets the extractor's four views and its
    flag, and a batch with none longer gets one row flagged, as the extractor flags its batch."""
    rng = numpy.random.default_rng(0)
    long_clip = rng.uniform(-0.5, 0.5, 150_000).astype(numpy.float32)
    crop = ClapFeatureExtractor(truncation="rand_trunc", max_length_s=2)
    numpy.random.seed(7)
    expected = crop(long_clip, sampling_rate=48000, return_tensors="pt")["input_features"][0]
    assert torch.equal(clip_features(crop, long_clip, 7)["input_features"], expected)
    assert not torch.equal(clip_features(crop, long_clip, 8)["input_features"], expected)
    fusion = ClapFeatureExtractor(truncation="fusion", max_length_s=2)
    short = [rng.uniform(-0.5, 0.5, 48_000).astype(numpy.float32) for _ in range(3)]
    rows = [clip_features(fusion, clip, seed) for seed, clip in enumerate(short)]
    batch = stacked_clips(rows, fusion)
    reference = fusion(short, sampling_rate=48000, return_tensors="pt")
    assert torch.equal(batch["input_features"], reference["input_features"])
    assert batch["is_longer"].sum() == reference["is_longer"].sum() == 1
    with_long = stacked_clips(rows + [clip_features(fusion, long_clip, 3)], fusion)
    assert with_long["is_longer"].flatten().tolist() == [False, False, False, True]


STEPS = 3
# 101 training rows in file order (a shuffle block of one row): rank 0 reads rows 0, 2, ..., 100 and rank 1 rows 1,
# 3, ..., 99, 17 a step, so step 3's batches are 17 and 16 rows (uneven), and one process of 34 a step reads the
# same rows each step. None is longer than the 2 s window: a crop is drawn from the row's place in its rank's stream
# (as --train_augment's), which differs between 1 and 2 ranks.
RUN_ARGS = ["--dataset_name", "parquet", "--eval_data_files", str(PAIRS / "test-00000-of-00001.parquet"),
            "--zeroshot_dataset", "embedded:audio_zeroshot", "--max_steps", STEPS, "--logging_steps", 1,
            "--eval_steps", STEPS, "--shuffle_buffer_size", 1, "--save_steps", 2]
# (engine, loss): each engine with one loss, each loss on several engines, DDP with both (the references)
RUNS = [("ddp.yaml", "clip"), ("ddp.yaml", "siglip"), ("fsdp2.yaml", "siglip"), ("zero2.yaml", "clip"),
        ("zero3.yaml", "siglip")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results, rows = {}, tmp_path_factory.mktemp("clap_rows") / "train.parquet"
    pairs = datasets.load_dataset(str(PAIRS), split="train")
    short = [index for index, clip in enumerate(pairs["audio"]) if len(decode_audio(clip, 8000, 60.0)[0]) <= 16000]
    pairs.select(short[:101]).to_parquet(rows)
    for config, loss in [*RUNS, ("one process", "clip"), ("one process", "siglip")]:
        output_dir = tmp_path_factory.mktemp(f"clap_{config.split('.')[0]}_{loss}")
        args = [*RUN_ARGS, "--data_files", rows, "--loss", loss, "--output_dir", output_dir]
        if config == "one process":
            result = run_recipe(*args, "--per_device_train_batch_size", 34)
        elif (config, loss) == RUNS[0]:  # as a user launches it, from another directory
            result = accelerate_launch(config, *args, "--per_device_train_batch_size", 17, cwd=output_dir)
        else:
            result = run_engine(config, *args, "--per_device_train_batch_size", 17)
        results[config, loss] = (result, output_dir)
    # ZeRO-3's run again from its step-2 checkpoint
    config, loss = RUNS[-1]
    output_dir = tmp_path_factory.mktemp("clap_resumed")
    results["resumed"] = (run_engine(config, *RUN_ARGS, "--data_files", rows, "--loss", loss, "--output_dir",
                                     output_dir, "--per_device_train_batch_size", 17, "--resume_from_checkpoint",
                                     results[RUNS[-1]][1] / "checkpoints" / "checkpoint-2"), output_dir)
    return results


def zeroshot(log):
    return re.findall(r"zeroshot_top1 [\d.]+ \| zeroshot_top5 [\d.]+ \| zeroshot_images \d+", log)


@pytest.mark.launch
@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_two_ranks_train_as_one_process(runs, loss):
    """DDP on 2 ranks of 17 rows a step (the last 17 and 16) against one process of 34 (the last 33), the same rows:
    the same losses, retrieval and zero-shot scores, and weights. With the engines' agreement
    with DDP below, 2 ranks = one process under each."""
    (single, single_dir), (ddp, ddp_dir) = runs["one process", loss], runs["ddp.yaml", loss]
    assert single.returncode == 0 and ddp.returncode == 0, single.log[-3000:]
    assert_same_curves(ddp.log, single.log, range(1, STEPS + 1))
    assert zeroshot(ddp.log) == zeroshot(single.log)
    assert retrieval(ddp.log) == retrieval(single.log) and len(retrieval(ddp.log)) == 2
    assert_adam_weights_close(ClapModel.from_pretrained(ddp_dir).state_dict(),
                              ClapModel.from_pretrained(single_dir).state_dict(), learning_rate=2e-3, steps=STEPS)


def retrieval(log) -> list[float]:
    return [float(value) for value in re.findall(r"_R@1 ([\d.]+)", log)]


@pytest.mark.launch
@pytest.mark.parametrize("config, loss", RUNS[2:])
def test_engines_train_clap_as_ddp(runs, config, loss):
    """Same seed, same rows: the loss curve, the retrieval and zero-shot scores and the saved weights match DDP's."""
    (reference, reference_dir), (result, output_dir) = runs["ddp.yaml", loss], runs[config, loss]
    assert reference.returncode == 0 and result.returncode == 0, result.log[-3000:]
    wrapped = "ClapForContrastiveTraining" if loss == "clip" else "ClapForSigmoidTraining"
    assert_engine(result.log, config, wrapped=wrapped)
    assert sorted(losses(result.log)) == list(range(1, STEPS + 1))
    assert "101 audio-text pairs" in (output_dir / "README.md").read_text()  # 17 + 17 + 17 rows and 17 + 17 + 16
    assert_same_curves(result.log, reference.log, range(1, STEPS + 1))
    assert zeroshot(result.log) == zeroshot(reference.log) and "zeroshot_images 96" in result.log
    assert "eval_pairs 96" in result.log and "audio_to_text_R@1" in result.log
    assert_adam_weights_close(ClapModel.from_pretrained(output_dir).state_dict(),
                              ClapModel.from_pretrained(reference_dir).state_dict(), learning_rate=2e-3, steps=STEPS)


@pytest.mark.launch
def test_resume_repeats_the_straight_run(runs):
    """Step 3 and its evaluation, resumed from step 2's checkpoint under ZeRO-3 (the sigmoid loss's bias partitioned
    with the rest), are the straight run's to the last printed digit: the data continues where it stood."""
    (straight, _), (resumed, _) = runs[RUNS[-1]], runs["resumed"]
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert_resume_repeats(resumed.log, straight.log, [3])


@pytest.mark.launch
def test_saved_clap_answers_in_the_zero_shot_pipeline(runs):
    """The launched DDP run's output: a plain ClapModel (one scale, clamped, in both of its fields), its card, and the
    pipeline's scores on a held-out clip equal the model's own softmax over "This is a sound of {label}."."""
    result, output_dir = runs[RUNS[0]]
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, "ddp.yaml", wrapped="ClapForContrastiveTraining")
    assert "longer than the feature extractor's 2 s window: a random 2 s crop (rand_trunc" in result.log
    model = ClapModel.from_pretrained(output_dir)
    assert model.logit_scale_a.shape == () and model.logit_scale_a.item() == model.logit_scale_t.item()
    assert "zero-shot-audio-classification" in (output_dir / "README.md").read_text()
    classify = pipeline("zero-shot-audio-classification", model=str(output_dir))
    clip = av_decoded(datasets.load_dataset(str(EMBEDDED / "audio_zeroshot"), split="test")[0]["audio"],
                      classify.feature_extractor.sampling_rate)
    answers = classify(clip, candidate_labels=list(LABELS), hypothesis_template="This is a sound of {}.")
    inputs = classify.feature_extractor(clip, sampling_rate=48000, return_tensors="pt")
    texts = classify.tokenizer([f"This is a sound of {label}." for label in LABELS], padding=True,
                               return_tensors="pt")
    with torch.no_grad():
        expected = model(**texts, **inputs).logits_per_audio.softmax(-1)[0]
    assert {answer["label"]: answer["score"] for answer in answers} == pytest.approx(
        dict(zip(LABELS, expected.tolist())), abs=1e-6)


def av_decoded(raw: bytes, rate: int) -> numpy.ndarray:
    samples, problem = decode_audio(raw, rate, 60.0)
    assert problem is None
    return samples


def test_window_rule_said_in_the_log_matches_the_extractor():
    assert "three random crops" in window_rule(ClapFeatureExtractor(truncation="fusion"))
    assert "10 s window: a random 10 s crop" in window_rule(ClapFeatureExtractor(truncation="rand_trunc"))
    assert math.isclose(ClapFeatureExtractor().nb_max_samples / 48000, 10)


def test_mfu_counts_htsat_as_torch_counts_its_forward():
    """The MFU's FLOPs per clip (HTSAT's Swin stages, windowed attention) within 5% of 3x the forward's that
    torch's FlopCounterMode counts (backward: twice the forward)."""
    model, _, _ = build_contrastive(ModelArgs(), "audio")
    with FlopCounterMode(display=False) as counter:
        model.get_audio_features(input_features=torch.randn(4, 1, 201, 64))
    assert ContrastiveFlops(model, 32).per_clip == pytest.approx(3 * counter.get_total_flops() / 4, rel=0.05)
