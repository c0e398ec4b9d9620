"""Audio training on a model that hears, in process: the tiny Gemma 4 E2B with its audio tower (data_prep/
tiny_vlm_2026.py) and its real processor. A clip's placeholders are its encoder's rows, never targets, and its
features never cut; a batch whose placeholders disagree with its clips is refused clip by clip (shown silent without
the check); a batch without audio runs the tower on the dummy sound at zero weight; the presets and LoRA reach the
audio tower by module structure; every bad clip is a counted skip. The two-rank runs (DDP, ZeRO-3 against it, ranks
with and without audio): test_vlm_family_runs.py."""

import numpy
import pytest
import torch
from transformers import AutoProcessor

from mmrecipes.distributed import Ranks
from mmrecipes.images import to_device
from mmrecipes.paths import VLM_SHAPES
from mmrecipes.vlm.algorithms.preference import PreferenceCollator, PreferencePreprocessor
from mmrecipes.vlm.arguments import ChatDataArgs, LoraArgs, VLMModelArgs
from mmrecipes.vlm.model import audio_rows
from mmrecipes.vlm.model.module_groups import apply_train_modules
from mmrecipes.vlm.model.outputs import Logits, LossSum, SequenceLogps
from mmrecipes.vlm.model.parts import vlm_parts
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows import labels
from mmrecipes.vlm.rows.chat_data import ChatPreprocessor
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.held_out import generation_prompts
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller
from test_audio_rows import encoded, preprocessed, tone, wav_bytes

RATE = 16000
QUESTION = "How many beeps?"


def audio_row(clip, question=QUESTION, answer="three"):
    return {"messages": [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "audios": [clip] if clip is not None else []}


TEXT_ROW = {"messages": [{"role": "user", "content": "One, two?"}, {"role": "assistant", "content": "three"}]}


@pytest.fixture(scope="module")
def gemma4(tiny_vlms):
    """(the recipe's parts of the tiny Gemma 4 E2B, its labeller that hears, a step)."""
    torch.manual_seed(0)
    vlm = vlm_parts(VLMModelArgs(model_name_or_path=str(tiny_vlms["gemma4"])), LoraArgs(), seq_len=128)
    labeller = AnswerLabeller(vlm.processor, vlm.stops, audio=vlm.hears)
    return vlm, labeller, VLMForTraining(vlm.model)


def rows_of(labeller, rows, max_length=2048, **args):
    """(the collator rows of `rows` kept, the skips counted by reason)."""
    preprocessor = ChatPreprocessor(ChatDataArgs(max_length=max_length, **args), labeller, max_length)
    out = preprocessed(preprocessor, rows)
    kept = [dict(zip(ChatPreprocessor.OUTPUTS, values)) for values in zip(*(out[key] for key in
                                                                             ChatPreprocessor.OUTPUTS))]
    return kept, dict(preprocessor.drops.totals)


def test_a_45_second_clip_is_as_many_placeholders_as_encoder_rows_none_of_them_a_target(gemma4):
    vlm, labeller, step = gemma4
    clip = wav_bytes(tone(45.0, 44100, channels=2), 44100)  # resampled to the extractor's 16 kHz
    (row,), _ = rows_of(labeller, [audio_row(clip)])
    token = labeller.audio_token_id
    placeholders = int((row["input_ids"] == token).sum())
    output = vlm.model.base_model.get_audio_features(**{name: row["media_inputs"][name] for name in
                                                        ("input_features", "input_features_mask")})
    # 25 a second, the whole clip: the extractor's default would cut it at 30 s (750)
    assert placeholders == int(output.attention_mask.sum()) == 1125
    assert (row["labels"][row["input_ids"] == token] == IGNORE_INDEX).all()
    answer = vlm.processor.tokenizer.decode(row["labels"][row["labels"] != IGNORE_INDEX])
    assert answer.replace(" ", "") == "three<turn|>"


def test_an_extractor_that_truncates_or_pads_on_the_left_is_refused_before_the_first_step(gemma4, tiny_vlms,
                                                                                          monkeypatch):
    vlm, _, _ = gemma4
    processor = AutoProcessor.from_pretrained(tiny_vlms["gemma4"])
    extractor_call = type(processor.feature_extractor).__call__

    def truncating(self, raw_speech, **kwargs):  # a processor that forces Whisper's 30 s window
        return extractor_call(self, raw_speech, **kwargs | {"truncation": True})

    monkeypatch.setattr(type(processor.feature_extractor), "__call__", truncating)
    with pytest.raises(ValueError, match="keeps 30.0 s of a 45 s clip: it truncates"):
        AnswerLabeller(processor, vlm.stops, audio=True)
    # the old failure is silent: placeholders and encoder rows agree at 750, the last 15 s never heard
    made = processor(text=processor.audio_token, audio=[numpy.zeros(45 * RATE, numpy.float32)],
                     audio_kwargs=labels.audio_kwargs(processor), return_tensors="pt")
    rows = vlm.model.base_model.get_audio_features(made["input_features"], made["input_features_mask"])
    assert int((made["input_ids"] == processor.tokenizer.convert_tokens_to_ids(processor.audio_token)).sum()) == int(
        rows.attention_mask.sum()) == 750

    def left_padded(self, raw_speech, **kwargs):  # the clip at the end of its features, padding first
        made = extractor_call(self, raw_speech, **kwargs)
        for name in ("input_features", "input_features_mask"):
            features = numpy.asarray(made[name])
            made[name] = numpy.concatenate([numpy.zeros_like(features[:, :7]), features], axis=1)
        return made

    monkeypatch.setattr(type(processor.feature_extractor), "__call__", left_padded)
    with pytest.raises(ValueError, match="pads its features on the left"):
        AnswerLabeller(processor, vlm.stops, audio=True)


def test_placeholders_that_disagree_with_a_clips_encoder_rows_are_refused_clip_by_clip(gemma4, monkeypatch):
    vlm, labeller, step = gemma4
    clips = [wav_bytes(tone(seconds, RATE), RATE) for seconds in (1.0, 0.5)]
    rows, _ = rows_of(labeller, [audio_row(clip) for clip in clips])
    collator = ChatCollator(vlm.processor.tokenizer.pad_token_id, vlm.dummy_inputs)
    token = labeller.audio_token_id
    # each row with the other's clip: 25 and 13 placeholders for clips of 13 and 25 rows, the same total
    swapped = [rows[0] | {"media_inputs": rows[1]["media_inputs"]}, rows[1] | {"media_inputs": rows[0]["media_inputs"]}]
    fewer = rows[0]["input_ids"].clone()
    fewer[(fewer == token).nonzero()[0]] = vlm.processor.tokenizer.pad_token_id  # Gemma 4's own total check too
    one_fewer = rows[0] | {"input_ids": fewer}
    for batch_rows, expected in ((swapped, r"per clip \[25, 13\], the audio encoder's rows per clip \[13, 25\]"),
                                 ([one_fewer], r"per clip \[24\], the audio encoder's rows per clip \[25\]")):
        with pytest.raises(ValueError, match=expected):
            step(to_device(collator(batch_rows), "cpu"), LossSum())
    # without the check the swap trains, each clip's sound at the other's placeholders (Gemma 4 checks the total)
    monkeypatch.setattr(audio_rows, "encoder_rows", lambda output: audio_rows.placeholder_runs(
        collator(swapped)["input_ids"], token))
    assert torch.isfinite(step(to_device(collator(swapped), "cpu"), LossSum()).summed)


def test_a_batch_without_audio_runs_the_tower_on_the_dummy_sound_and_keeps_the_texts_loss(gemma4):
    vlm, labeller, step = gemma4
    (text_row,), _ = rows_of(labeller, [TEXT_ROW])
    batch = ChatCollator(vlm.processor.tokenizer.pad_token_id, vlm.dummy_inputs)([text_row])
    assert batch["dummy_audio"] and batch["input_features"].shape[:2] == (1, 10)  # a tenth of a second
    tower = vlm.model.model.audio_tower
    tower.requires_grad_(True)
    try:
        summed = step(to_device(batch, "cpu"), LossSum()).summed
        summed.backward()
        assert all(p.grad is not None and not p.grad.any() for p in tower.parameters())  # reached, at zero weight
        without = {key: value for key, value in batch.items() if key not in ("input_features", "input_features_mask",
                                                                           "dummy_audio")}
        assert torch.equal(step(to_device(without, "cpu"), LossSum()).summed, summed)
    finally:
        tower.requires_grad_(False)
        vlm.model.zero_grad(set_to_none=True)


def test_the_presets_and_lora_reach_the_audio_tower_by_module_structure(gemma4, tiny_vlms):
    vlm, _, _ = gemma4
    groups = vlm.groups
    assert {name.split(".")[1] for name, _ in groups.audio_tower} == {"audio_tower"}
    assert {name for name, _ in groups.projector if "audio" in name} == {
        name for name, _ in vlm.model.named_parameters() if name.startswith("model.embed_audio.")}
    assert not groups.unreached
    assert "; audio_tower 122,080 params (model.audio_tower)" in groups.describe()
    # the default preset trains the audio projector and freezes the tower; `all` trains it
    assert not any(p.requires_grad for _, p in groups.audio_tower)
    assert all(p.requires_grad for name, p in groups.projector if "embed_audio" in name)
    everything = apply_train_modules(groups, "all")
    assert len(everything["audio_tower"]) == len(groups.audio_tower)
    apply_train_modules(groups, "projector,language_model")
    lora = vlm_parts(VLMModelArgs(model_name_or_path=str(tiny_vlms["gemma4"]), train_modules="all"),
                     LoraArgs(use_peft=True), seq_len=128)
    adapted = {name for name, p in lora.model.named_parameters() if p.requires_grad and ".lora_" in name}
    assert any(name.startswith("model.audio_tower.") for name in adapted) and lora.trainable["audio_tower"]


def test_every_bad_clip_is_a_counted_skip_and_the_rest_train(gemma4, tmp_path):
    _, labeller, _ = gemma4
    broken_mp3 = b"ID3\x03\x00\x00\x00\x00\x00\x00" + bytes(300)  # its header broken, no frame after it
    rows = [audio_row(str(tmp_path / "missing.wav")), audio_row(wav_bytes(tone(0.0, RATE), RATE)),
            audio_row(broken_mp3), audio_row(None),  # a placeholder without its clip
            audio_row(wav_bytes(tone(1.0, 96000, channels=8), 96000)),  # trained: averaged, resampled
            audio_row(encoded("mp4", seconds=1.0, with_video=True)),  # a video's audio track: trained
            TEXT_ROW]
    kept, skipped = rows_of(labeller, rows)
    assert skipped == {"audio_undecodable": 2, "audio_empty": 1, "audio_mismatch": 1}
    # a second each: AAC's encoder delay (its priming samples, which PyAV does not trim) adds 2 placeholders
    assert [int((row["input_ids"] == labeller.audio_token_id).sum()) for row in kept] == [25, 27, 0]
    # over --audio_max_seconds: counted from the header
    assert rows_of(labeller, [audio_row(wav_bytes(tone(3.0, RATE), RATE))], audio_max_seconds=2.0) == (
        [], {"audio_too_long": 1})


def test_held_out_audio_questions_are_asked_with_their_clips(gemma4):
    """The evaluation by generation asks the embedded audio questions with their sound (a model that does not hear
    leaves them out, counted)."""
    vlm, _, _ = gemma4
    args = ChatDataArgs(eval_dataset_name=str(VLM_SHAPES / "audio_chat"), eval_split="test")
    prompts = generation_prompts(args, vlm.processor, rows=4, ranks=Ranks(), hears=True)
    token = vlm.processor.tokenizer.convert_tokens_to_ids(vlm.processor.audio_token)
    assert [int((held.prompt["input_ids"] == token).sum()) for held in prompts] == [25] * 4
    assert all(held.answer in ("one", "two", "three", "four", "first", "second") for held in prompts)
    assert {"input_features", "input_features_mask"} <= set(prompts[0].prompt["media_inputs"])
    with pytest.raises(RuntimeError, match="this rank left out: audio 64"):
        generation_prompts(args, vlm.processor, rows=4, ranks=Ranks())


@torch.no_grad()
def test_packed_audio_rows_give_the_logits_they_give_alone(gemma4):
    """Two clips of different lengths packed after a text row: each sample's logits as alone (each clip's rows at
    its own run of placeholders), and --packing's check before the first step passes."""
    vlm, labeller, step = gemma4
    clips = [audio_row(wav_bytes(tone(seconds, RATE), RATE)) for seconds in (1.0, 0.5)]
    rows, _ = rows_of(labeller, [TEXT_ROW, *clips])
    collator = ChatCollator(vlm.processor.tokenizer.pad_token_id, vlm.dummy_inputs, packing=True)
    step.eval()
    try:
        packed = step(to_device(collator(rows), "cpu"), Logits())
        alone = torch.cat([step(to_device(ChatCollator(0, vlm.dummy_inputs)([row]), "cpu"), Logits())
                           for row in rows], dim=1)
        vlm.check_packing(labeller)
    finally:
        step.train()
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_dpo_reads_both_sides_clips_through_the_same_path(gemma4):
    """A preference pair whose prompt plays a clip (TRL's string prompt with LLaMA-Factory's `<audio>` tag and `audios`
    column): each side carries the clip's features and placeholders, the answers alone differ, and each side's
    log-probability is its own row's as a batch of one."""
    vlm, labeller, step = gemma4
    clip = wav_bytes(tone(1.0, RATE), RATE)
    pair = {"prompt": f"<audio>{QUESTION}", "chosen": "three", "rejected": "four", "audios": [clip]}
    out = preprocessed(PreferencePreprocessor(ChatDataArgs(max_length=256), labeller, 256), [pair])
    chosen, rejected = out["chosen"][0], out["rejected"][0]
    token = labeller.audio_token_id
    assert [int((side["input_ids"] == token).sum()) for side in (chosen, rejected)] == [25, 25]
    assert torch.equal(chosen["media_inputs"]["input_features"], rejected["media_inputs"]["input_features"])
    batch = PreferenceCollator(ChatCollator(vlm.processor.tokenizer.pad_token_id, vlm.dummy_inputs))([
        {"chosen": chosen, "rejected": rejected}])
    step.eval()
    try:
        logps = step(to_device(batch, "cpu"), SequenceLogps())
        alone = [step(to_device(ChatCollator(0, vlm.dummy_inputs)([side]), "cpu"), SequenceLogps())
                 for side in (chosen, rejected)]
    finally:
        step.train()
    torch.testing.assert_close(logps, torch.cat(alone), rtol=1e-5, atol=1e-5)
