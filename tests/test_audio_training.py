"""Audio training on a model that hears, in process: the tiny Gemma 4 E2B with its audio tower, the Qwen2.5-Omni and
Qwen3-Omni-MoE thinkers, Qwen2-Audio and Voxtral (data_prep/tiny_vlm_2026.py: HEARING), each with its real processor
(Voxtral's given the clips by `WindowedAudio`, as the recipes load it). A clip's placeholders are its
encoder's rows, never targets, and its features never cut; a batch whose placeholders disagree with its clips is
refused clip by clip (shown silent without the check); a batch without audio runs the tower on the dummy sound at
zero weight; the presets and LoRA reach the audio tower by module structure; packed clips keep their own positions;
every bad clip is a counted skip. The two-rank runs (DDP, sharded engines against it, ranks with and without audio):
test_vlm_family_runs.py, test_vlm_engines.py."""

import functools
import io
import json

import jinja2
import numpy
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoProcessor, pipeline

from mmrecipes.audio import audio_kwargs, decode_audio
from mmrecipes.audio_windows import WINDOWS, WindowedAudio, windowed_audio
from mmrecipes.distributed import Ranks
from mmrecipes.images import to_device
from mmrecipes.paths import VLM_SHAPES
from mmrecipes.saved_models import trained_class
from mmrecipes.skips import SKIPPED, Skip
from mmrecipes.vlm.algorithms.preference import PreferenceCollator, PreferencePreprocessor
from mmrecipes.vlm.algorithms.sampling import generate_group, sample_group
from mmrecipes.vlm.algorithms.teacher import Teacher
from mmrecipes.vlm.arguments import ChatDataArgs, GRPOArgs, LoraArgs, PromptDataArgs, VLMModelArgs
from mmrecipes.vlm.model import audio_rows
from mmrecipes.vlm.model.module_groups import apply_train_modules
from mmrecipes.vlm.model.outputs import Hidden, Logits, LossSum, SequenceLogps
from mmrecipes.vlm.model.parts import vlm_parts
from mmrecipes.vlm.model.step import VLMForTraining, without_call_settings
from mmrecipes.vlm.rows import labels
from mmrecipes.vlm.rows.chat_data import ChatPreprocessor
from mmrecipes.vlm.rows.collate import AUDIO_KEYS, ChatCollator
from mmrecipes.vlm.rows.held_out import generation_prompts
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller
from mmrecipes.vlm.rows.prompts import DistillCollator, DistillPreprocessor, PromptPreprocessor
from test_audio_rows import encoded, preprocessed, tone, wav_bytes

RATE = 16000
QUESTION = "How many beeps?"


def audio_row(clip, question=QUESTION, answer="three"):
    return {"messages": [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "audios": [clip] if clip is not None else []}


TEXT_ROW = {"messages": [{"role": "user", "content": "One, two?"}, {"role": "assistant", "content": "three"}]}


def heard_image_row(seconds=0.5):
    """A question about an image and a clip together."""
    image = io.BytesIO()
    Image.new("RGB", (32, 32), (220, 40, 40)).save(image, format="PNG")
    return {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                                      {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "two"}]}],
            "images": [image.getvalue()], "audios": [wav_bytes(tone(seconds, RATE), RATE)]}


# what differs between the families that hear: each one's end of turn, its encoder rows for clips of 0.5, 1, 30 and
# 45 s, the parameters of its audio tower (the projector apart), its audio projector, why LoRA's MLP preset is
# refused, the tower's parameters no forward reaches, whether the family checks its audio placeholders at all
HEARING = {"gemma4": dict(end="<turn|>", rows={0.5: 13, 1: 25, 30: 750, 45: 1125}, tower_params=122_080,
                          projector="model.embed_audio.", mlp_refused=None, unreached=[], checks_total=True),
           # (PEFT itself refuses Gemma 4's vision MLP's clippable layers by these names)
           "qwen2_5_omni": dict(end="<|im_end|>", rows={0.5: 12, 1: 25, 30: 750, 45: 1125}, tower_params=32_640,
                                projector="model.audio_tower.proj.", unreached=[
                                    "model.audio_tower.audio_bos_eos_token.weight"], checks_total=False,
                                mlp_refused="reaches no linear layer of the audio tower"),
           # 12.5 rows a second: each window of 100 frames gives 13
           "qwen3_omni_moe": dict(end="<|im_end|>", rows={0.5: 7, 1: 13, 30: 390, 45: 585}, tower_params=23_552,
                                  projector="model.audio_tower.proj2.", unreached=[], checks_total=False,
                                  # its experts are 3-D parameters, no linear layers
                                  mlp_refused="no linear layer is called gate_proj, up_proj, down_proj"),
           # no vision tower; its encoder reads 30 s at most (a 45 s clip: counted audio_too_long, never cut)
           "qwen2_audio": dict(end="<|im_end|>", rows={0.5: 12, 1: 25, 30: 750, 45: None}, tower_params=80_512,
                               projector="model.multi_modal_projector.", unreached=[], checks_total=True,
                               mlp_refused="reaches no linear layer of the audio tower"),
           # no vision tower; each clip padded to whole 30 s windows of 375 rows (`WindowedAudio`): two clips whose
           # placeholders differ are a second and 45 s long
           "voxtral": dict(end="</s>", rows={0.5: 375, 1: 375, 30: 375, 45: 750}, tower_params=88_832,
                           projector="model.multi_modal_projector.", unreached=[], checks_total=True,
                           mlp_refused="reaches no linear layer of the audio tower", pair=(45.0, 1.0))}


@pytest.fixture(scope="module", params=list(HEARING))
def hearing(request, tiny_vlms):
    """(the recipe's parts of a tiny family that hears, its labeller that hears, a step, the family's HEARING)."""
    torch.manual_seed(0)
    vlm = vlm_parts(VLMModelArgs(model_name_or_path=str(tiny_vlms[request.param])), LoraArgs(), seq_len=128)
    labeller = AnswerLabeller(vlm.processor, vlm.stops, audio=vlm.hears)
    return vlm, labeller, VLMForTraining(vlm.model), HEARING[request.param] | {"family": request.param}


@pytest.fixture(scope="module")
def gemma4(tiny_vlms):
    """(the recipe's parts of the tiny Gemma 4 E2B, its labeller that hears, a step): what no family changes."""
    torch.manual_seed(0)
    vlm = vlm_parts(VLMModelArgs(model_name_or_path=str(tiny_vlms["gemma4"])), LoraArgs(), seq_len=128)
    labeller = AnswerLabeller(vlm.processor, vlm.stops, audio=vlm.hears)
    return vlm, labeller, VLMForTraining(vlm.model)


def audio_features(vlm, media_inputs):
    """The audio tower's output and its rows per clip (`AudioRows`)."""
    rows = VLMForTraining(vlm.model).audio_rows
    inputs = {name: media_inputs[name] for name in rows.input_names if name in media_inputs}
    output = rows.step(**inputs, return_dict=True)
    return output, rows.encoder_rows(output, inputs, media_inputs.get(WINDOWS))


def feature_mask(media_inputs):
    return next(media_inputs[name] for name in labels.FEATURE_MASKS if name in media_inputs)


def rows_of(labeller, rows, max_length=2048, **args):
    """(the collator rows of `rows` kept, the skips counted by reason)."""
    preprocessor = ChatPreprocessor(ChatDataArgs(max_length=max_length, **args), labeller, max_length)
    out = preprocessed(preprocessor, rows)
    kept = [dict(zip(ChatPreprocessor.OUTPUTS, values)) for values in zip(*(out[key] for key in
                                                                             ChatPreprocessor.OUTPUTS))]
    return kept, dict(preprocessor.drops.totals)


def test_a_45_second_clip_is_as_many_placeholders_as_encoder_rows_none_of_them_a_target(hearing):
    vlm, labeller, _, family = hearing
    clip = wav_bytes(tone(45.0, 44100, channels=2), 44100)  # resampled to the extractor's 16 kHz
    if family["rows"][45] is None:  # an encoder of a fixed window: the clip counted, from its header
        assert vlm.audio_window == 30.0
        assert rows_of(labeller, [audio_row(clip)], audio_max_seconds=vlm.clip_seconds(600.0)) == (
            [], {"audio_too_long": 1})
        return
    assert vlm.audio_window is None
    (row,), _ = rows_of(labeller, [audio_row(clip)])
    token = labeller.audio_token_id
    placeholders = int((row["input_ids"] == token).sum())
    _, rows = audio_features(vlm, row["media_inputs"])
    # the whole clip: the extractor's default would cut it at 30 s
    assert [placeholders] == rows == [family["rows"][45]]
    assert (row["labels"][row["input_ids"] == token] == IGNORE_INDEX).all()
    answer = vlm.processor.tokenizer.decode(row["labels"][row["labels"] != IGNORE_INDEX])
    assert answer.replace(" ", "").strip() == "three" + family["end"]


def test_an_extractor_that_truncates_or_pads_on_the_left_is_refused_before_the_first_step(hearing, tiny_vlms,
                                                                                          monkeypatch):
    vlm, _, _, family = hearing
    processor = windowed_audio(vlm.model, AutoProcessor.from_pretrained(tiny_vlms[family["family"]]))
    extractor_call = type(processor.feature_extractor).__call__

    def truncating(self, raw_speech, **kwargs):  # a processor that forces Whisper's 30 s window
        return extractor_call(self, raw_speech, **kwargs | {"truncation": True, "max_length": 30 * RATE})

    monkeypatch.setattr(type(processor.feature_extractor), "__call__", truncating)
    with pytest.raises(ValueError, match=r"keeps 30.0 s of a (45|60) s clip.*: it truncates"):
        AnswerLabeller(processor, vlm.stops, audio=True)
    if isinstance(processor, WindowedAudio):
        # a clip in whole windows (Voxtral's) is never silent: its windows are its features' length; the extractor
        # pads nothing, on either side
        monkeypatch.undo()
        processor.feature_extractor.padding_side = "left"
        AnswerLabeller(processor, vlm.stops, audio=True)
        return
    # the old failure is silent: placeholders and encoder rows agree at 30 s's, the last 15 s never heard
    clip = numpy.zeros(45 * RATE, numpy.float32)
    made = processor(text=processor.audio_token, audio=[clip], audio_kwargs=audio_kwargs(processor, [clip]),
                     return_tensors="pt")
    placeholders = int((made["input_ids"] == processor.tokenizer.convert_tokens_to_ids(processor.audio_token)).sum())
    assert [placeholders] == audio_features(vlm, made)[1] == [family["rows"][30]]
    monkeypatch.undo()
    processor.feature_extractor.padding_side = "left"  # the tokenizer's side, leaked: a short clip's frames last
    with pytest.raises(ValueError, match="pads its features on the left"):
        AnswerLabeller(processor, vlm.stops, audio=True)


def test_a_family_whose_clips_rows_cannot_be_told_is_refused_before_the_first_step(gemma4, tiny_vlms, monkeypatch):
    """An audio output without a mask from a tower without a length formula (Gemma 4's tower has none; Qwen3-Omni's
    formula is a function of its module, not of its tower): refused at start-up with the reason, not at the first
    batch with a clip."""
    vlm, _, _ = gemma4
    family = type(vlm.model.model)
    with_mask = family.get_audio_features

    @functools.wraps(with_mask)
    def without_mask(self, *args, **kwargs):
        output = with_mask(self, *args, **kwargs)
        output.attention_mask = None
        return output

    monkeypatch.setattr(family, "get_audio_features", without_mask)
    with pytest.raises(ValueError, match="gives no attention_mask, and the audio tower no length formula"):
        vlm_parts(VLMModelArgs(model_name_or_path=str(tiny_vlms["gemma4"])), LoraArgs(), seq_len=128)


def test_placeholders_that_disagree_with_a_clips_encoder_rows_are_refused_clip_by_clip(hearing, monkeypatch):
    vlm, labeller, step, family = hearing
    longer, shorter = family.get("pair", (1.0, 0.5))  # clips whose encoder rows differ
    rows, _ = rows_of(labeller, [audio_row(wav_bytes(tone(seconds, RATE), RATE)) for seconds in (longer, shorter)])
    collator = ChatCollator(vlm.processor.tokenizer.pad_token_id, vlm.dummy_inputs)
    token, half, second = labeller.audio_token_id, family["rows"][shorter], family["rows"][longer]
    # each row with the other's clip: `second` and `half` placeholders for clips of `half` and `second` rows
    swapped = [rows[0] | {"media_inputs": rows[1]["media_inputs"]}, rows[1] | {"media_inputs": rows[0]["media_inputs"]}]
    fewer = rows[0]["input_ids"].clone()
    fewer[(fewer == token).nonzero()[0]] = vlm.processor.tokenizer.pad_token_id
    one_fewer = [rows[0] | {"input_ids": fewer}]
    more = torch.cat([rows[1]["input_ids"][:1], torch.tensor([token]), rows[1]["input_ids"][1:]])
    one_more = [rows[1] | {"input_ids": more, "labels": torch.cat([rows[1]["labels"][:1], rows[1]["labels"]])}]
    for batch_rows, (placed, given) in ((swapped, (f"{second}, {half}", f"{half}, {second}")),
                                          (one_fewer, (f"{second - 1}", f"{second}")),
                                          (one_more, (f"1, {half}", f"{half}"))):
        expected = rf"per clip \[{placed}\], the audio encoder's rows per clip \[{given}\]"
        with pytest.raises(ValueError, match=expected):
            step(to_device(collator(batch_rows), "cpu"), LossSum())
    # without the check the swap trains, each clip's sound at the other's placeholders (Gemma 4 checks the total);
    # the Omni thinkers check nothing: one placeholder too few trains on the clip's head too
    for batch_rows in [swapped] + ([] if family["checks_total"] else [one_fewer]):
        batch = collator(batch_rows)
        runs = audio_rows.placeholder_runs(batch["input_ids"], token)
        monkeypatch.setattr(audio_rows.AudioRows, "encoder_rows", lambda self, output, inputs, windows=None: runs)
        assert torch.isfinite(step(to_device(batch, "cpu"), LossSum()).summed)


def test_a_batch_without_audio_runs_the_tower_on_the_dummy_sound_and_keeps_the_texts_loss(hearing):
    vlm, labeller, step, _ = hearing
    (text_row,), _ = rows_of(labeller, [TEXT_ROW])
    batch = ChatCollator(vlm.processor.tokenizer.pad_token_id, vlm.dummy_inputs)([text_row])
    # a tenth of a second: 10 ms hops (Voxtral's: padded to a window, 3000 frames)
    assert batch["dummy_audio"] and (batch["input_features"].shape[-1] == 3000 if WINDOWS in vlm.dummy_inputs
                                     else 0 < feature_mask(batch).sum() <= 10)
    tower = vlm.model.model.audio_tower
    trained = {name: p.requires_grad for name, p in tower.named_parameters()}  # the preset's (Omni: its `proj`)
    tower.requires_grad_(True)
    try:
        summed = step(to_device(batch, "cpu"), LossSum()).summed
        summed.backward()
        assert all(p.grad is not None and not p.grad.any() for name, p in tower.named_parameters()
                   if f"model.audio_tower.{name}" not in vlm.groups.unreached)  # reached, at zero weight
        without = {key: value for key, value in batch.items() if key not in ("dummy_audio", *AUDIO_KEYS)}
        assert torch.equal(step(to_device(without, "cpu"), LossSum()).summed, summed)
    finally:
        for name, p in tower.named_parameters():
            p.requires_grad_(trained[name])
        vlm.model.zero_grad(set_to_none=True)


def test_the_presets_and_lora_reach_the_audio_tower_by_module_structure(hearing, tiny_vlms):
    vlm, _, _, family = hearing
    groups = vlm.groups
    assert {name.split(".")[1] for name, _ in groups.audio_tower} == {"audio_tower"}
    assert {name for name, _ in groups.projector if "audio" in name or name.startswith(family["projector"])} == {
        name for name, _ in vlm.model.named_parameters() if name.startswith(family["projector"])}
    # every parameter reached, but the Qwen2.5-Omni tower's token embedding that its forward never calls
    assert groups.unreached == family["unreached"]
    tower_params = sum(p.numel() for _, p in groups.audio_tower)
    assert tower_params == family["tower_params"]
    assert f"; audio_tower {tower_params:,} params (model.audio_tower" in groups.describe()
    # the default preset trains the audio projector and freezes the tower; `all` trains it
    assert not any(p.requires_grad for _, p in groups.audio_tower)
    assert all(p.requires_grad for name, p in groups.projector if name.startswith(family["projector"]))
    everything = apply_train_modules(groups, "all")
    assert len(everything["audio_tower"]) == len(groups.audio_tower) - len(groups.unreached)
    apply_train_modules(groups, "projector,language_model")
    lora = vlm_parts(VLMModelArgs(model_name_or_path=str(tiny_vlms[family["family"]]), train_modules="all"),
                     LoraArgs(use_peft=True), seq_len=128)
    adapted = {name for name, p in lora.model.named_parameters() if p.requires_grad and ".lora_" in name}
    assert any(name.startswith("model.audio_tower.") for name in adapted) and lora.trainable["audio_tower"]
    # the MLP preset reaches the Qwen2.5-Omni thinker's language model and vision tower, not its audio tower (fc1,
    # fc2), which would stay frozen under --train_modules all
    if family["mlp_refused"]:
        with pytest.raises(ValueError, match=family["mlp_refused"]):
            vlm_parts(VLMModelArgs(model_name_or_path=str(tiny_vlms[family["family"]]), train_modules="all"),
                      LoraArgs(use_peft=True, lora_target_modules="gate_proj,up_proj,down_proj"), seq_len=128)


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
def test_packed_audio_rows_give_the_logits_they_give_alone(hearing):
    """Two clips of different lengths, one beside an image, packed after a text row: each sample's logits as alone
    (each clip's rows at its own run of placeholders; the Qwen2.5-Omni thinker's 3-D positions of the sample with an
    image computed from its own clip's frames), and --packing's check before the first step passes."""
    vlm, labeller, step, _ = hearing
    rows, _ = rows_of(labeller, [TEXT_ROW, audio_row(wav_bytes(tone(1.0, RATE), RATE)), heard_image_row()])
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
def test_dpo_reads_both_sides_clips_through_the_same_path(hearing):
    """A preference pair whose prompt plays a clip (TRL's string prompt with LLaMA-Factory's `<audio>` tag and `audios`
    column): each side carries the clip's features and placeholders, the answers alone differ, and each side's
    log-probability is its own row's as a batch of one."""
    vlm, labeller, step, family = hearing
    clip = wav_bytes(tone(1.0, RATE), RATE)
    pair = {"prompt": f"<audio>{QUESTION}", "chosen": "three", "rejected": "four", "audios": [clip]}
    # Voxtral's clip: 376 tokens, a 30 s window's
    out = preprocessed(PreferencePreprocessor(ChatDataArgs(max_length=1024), labeller, 1024), [pair])
    chosen, rejected = out["chosen"][0], out["rejected"][0]
    token = labeller.audio_token_id
    assert [int((side["input_ids"] == token).sum()) for side in (chosen, rejected)] == [family["rows"][1]] * 2
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


@torch.no_grad()
def test_grpo_prompts_play_their_clips_and_sample_alike_by_generate_and_by_the_synced_loop(hearing):
    """A GRPO prompt row with a clip (TRL's string prompt with an `<audio>` tag and an `audios` column) is rendered with
    the clip's placeholders and features, its reward columns without it; `generate` (a model whole on the rank, the
    family's own audio path in the prompt's forward) draws the tokens the synced loop draws through the step (the
    clip encoded and checked before the language model)."""
    vlm, labeller, step, family = hearing
    row = {"prompt": f"<audio>{QUESTION}", "audios": [wav_bytes(tone(1.0, RATE), RATE)], "solution": "three"}
    out = preprocessed(PromptPreprocessor(PromptDataArgs(), labeller, 1024), [row])
    prompt = {"input_ids": torch.as_tensor(out["input_ids"][0]), "media_inputs": out["media_inputs"][0]}
    assert int((prompt["input_ids"] == labeller.audio_token_id).sum()) == family["rows"][1]
    assert "input_features" in prompt["media_inputs"] and json.loads(out["reward_columns"][0]) == {"solution": "three"}
    collator = ChatCollator(vlm.processor.tokenizer.pad_token_id, vlm.dummy_inputs)
    args = GRPOArgs(num_generations=3, max_completion_length=4, temperature=2.0)
    step.eval()
    try:
        sampled = [sample(step, prompt, collator, args, vlm.stops, 7, "cpu", vlm.placeholders)
                   for sample in (sample_group, generate_group)]
        # the audio placeholder made the likeliest token: never sampled (an untrained model drew it in a GRPO run)
        token = labeller.audio_token_id
        bias = torch.zeros(vlm.model.get_output_embeddings().weight.shape[0])
        bias[token] = 50.0
        hook = vlm.model.get_output_embeddings().register_forward_hook(lambda module, inputs, output: output + bias)
        try:
            group = sample_group(step, prompt, collator, args, vlm.stops, 7, "cpu", vlm.placeholders)
            assert not any(token in ids for ids, _ in group)
            # the old failure: drawn and appended, the next forward finds a clip of one placeholder
            with pytest.raises(ValueError, match=rf"audio placeholders per clip \[{family['rows'][1]}, 1"):
                sample_group(step, prompt, collator, args, vlm.stops, 7, "cpu",
                             [other for other in vlm.placeholders if other != token])
        finally:
            hook.remove()
    finally:
        step.train()
    assert sampled[0] == sampled[1] and len(sampled[0]) == 3


@torch.no_grad()
def test_distillation_reads_clips_where_its_teacher_hears_and_a_deaf_teacher_reads_rows_of_its_own(gemma4, tiny_vlms):
    """A distillation row with a clip: the prompt plays it, the dataset's answer its only target. A teacher that hears
    (the same family) reads the student's rows; one that does not (Gemma 4 26B-A4B's layout: no audio tower) reads
    rows of its own, so the student's dummy sound never reaches it, and the student's clips are counted instead."""
    vlm, labeller, _ = gemma4
    row = {"prompt": f"<audio>{QUESTION}", "audios": [wav_bytes(tone(1.0, RATE), RATE)], "solution": "three"}
    hearing, deaf = (Teacher.load(str(tiny_vlms[name]), vlm.model, vlm.processor) for name in ("gemma4", "gemma4_moe"))
    assert (hearing.hears, hearing.own_processor) == (True, None)
    assert not deaf.hears and deaf.own_processor is not None and "or it does not hear" in deaf.describe()
    out = preprocessed(DistillPreprocessor(PromptDataArgs(), labeller, 256), [row])
    ids, labels = torch.as_tensor(out["input_ids"][0]), torch.as_tensor(out["labels"][0])
    assert int((ids == labeller.audio_token_id).sum()) == 25 and "input_features" in out["media_inputs"][0]
    assert vlm.processor.tokenizer.decode(labels[labels != IGNORE_INDEX]).replace(" ", "") == "three<turn|>"
    # the recipe's labeller for a deaf teacher: the clip counted; a text row's batch carries the student's dummy sound,
    # and the deaf teacher reads its own
    deaf_labeller = AnswerLabeller(vlm.processor, vlm.stops)
    preprocessor = DistillPreprocessor(PromptDataArgs(), deaf_labeller, 256, deaf.own_processor)
    out = preprocessed(preprocessor, [row, {"prompt": "One, two?", "solution": "three"}])
    assert len(out["input_ids"]) == 1 and out[SKIPPED][0]["audio"] == 1
    batch = DistillCollator(ChatCollator(vlm.processor.tokenizer.pad_token_id, vlm.dummy_inputs))(
        [{key: out[key][0] for key in DistillPreprocessor.OUTPUTS}])
    assert batch["answers"]["dummy_audio"]
    hidden = deaf.hidden(to_device(batch["answers"], "cpu"), batch["prompts"])
    assert hidden.shape[:2] == batch["answers"]["input_ids"].shape and torch.isfinite(hidden).all()
    # the old failure: given the student's rows, the deaf teacher's forward refuses the dummy sound
    with pytest.raises(ValueError, match="initialized without an audio_config"):
        deaf.model(to_device(batch["answers"], "cpu"), Hidden())


def test_librispeech_is_answered_in_the_loop_as_by_generate_on_the_saved_model(hearing, tmp_path):
    """The WER task (lmms-eval's librispeech_test_clean, on the embedded clips): the recipes' answerer in step over
    the ranks and `python -m mmrecipes.benchmarks` (generate, a KV cache) on the saved model hear the same clip (its
    placeholders in the prompt) and give the same greedy transcripts, so the same WER."""
    from mmrecipes.benchmarks.__main__ import GeneratedAnswers, main
    from mmrecipes.benchmarks.arguments import BenchmarkArgs
    from mmrecipes.benchmarks.harness import Benchmark, Benchmarks
    from mmrecipes.benchmarks.tasks import TASKS
    from mmrecipes.vlm.model.evaluation import BenchmarkAnswers

    vlm, labeller, step, _ = hearing
    vlm.model.save_pretrained(tmp_path)
    without_call_settings(vlm.processor.tokenizer)  # as save_vlm saves it
    vlm.processor.save_pretrained(tmp_path)
    args = BenchmarkArgs(benchmarks="librispeech_test_clean", benchmark_data_dir="embedded:benchmarks",
                         benchmark_limit=3, benchmark_max_new_tokens=4)
    answers = BenchmarkAnswers(step, vlm, "cpu")
    benchmark = Benchmark.load(TASKS["librispeech_test_clean"], args, 0, 1)
    _, request = benchmark.request(0, answers.sampling_rate)
    assert (answers.row(request)["input_ids"] == labeller.audio_token_id).sum() > 0
    # a clip over the longest the answerer reads (Qwen2-Audio's 30 s window) is counted, never cut
    assert answers.clip_seconds == vlm.audio_window
    with pytest.raises(Skip) as skipped:
        benchmark.request(0, answers.sampling_rate, clip_seconds=0.5)
    assert skipped.value.reason == "audio_too_long"
    in_the_loop = Benchmarks(args).run(answers)
    saved = main(["--model", str(tmp_path), "--benchmarks", "librispeech_test_clean", "--benchmark_data_dir",
                  "embedded:benchmarks", "--benchmark_limit", "3", "--benchmark_max_new_tokens", "4"])
    assert saved == in_the_loop and saved["bench/librispeech_test_clean/documents"] == 3
    assert saved["bench/librispeech_test_clean/wer"] > 0  # an untrained model's transcripts
    # the saved model loads with its Auto class (Qwen2-Audio: AutoModelForMultimodalLM) and answers a clip through
    # the any-to-any pipeline as its own generate does
    model = trained_class(AutoConfig.from_pretrained(tmp_path)).from_pretrained(tmp_path)
    processor = windowed_audio(model, AutoProcessor.from_pretrained(tmp_path))
    assert GeneratedAnswers(model, processor, "cpu").clip_seconds == vlm.audio_window  # found by its own forward
    clip, _ = decode_audio(wav_bytes(tone(1.0, RATE), RATE), RATE, 30.0)
    chat = [{"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": QUESTION}]}]
    inputs = processor(text=processor.apply_chat_template(chat, add_generation_prompt=True), audio=[clip],
                       audio_kwargs=audio_kwargs(processor, [clip]), return_tensors="pt")
    inputs.pop(WINDOWS, None)
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    answer = pipeline("any-to-any", model=str(tmp_path))
    if isinstance(processor, WindowedAudio):
        # the pipeline renders the checkpoint's template, which names no {"type": "audio"} part (mistral_common's
        # `input_audio`), then calls the processor with the clips, which Voxtral's refuses: only generate answers
        with pytest.raises(jinja2.TemplateError, match="Only text, input_audio and audio_url chunks"):
            answer(text=chat, max_new_tokens=4)
        return
    answered = answer(text=chat, max_new_tokens=4, return_full_text=False, generate_kwargs={"do_sample": False})
    assert answered[0]["generated_text"] == processor.decode(generated, skip_special_tokens=True)
