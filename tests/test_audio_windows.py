"""Voxtral's clips in whole windows (`mmrecipes.audio_windows.WindowedAudio`), in process on the tiny Voxtral with its
real processor: the recipes' rows are the tokens mistral_common itself writes for the same conversations
(tests/fixtures/mistral_common_voxtral.json, written by data_prep/mistral_common_parity.py: mistral_common does not
install beside this repository's numpy), their answers the only targets, and the features the processor's own feature
path gives. The engines' runs: tests/test_vlm_engines.py; the checks every family that hears passes:
tests/test_audio_training.py."""

import json
from pathlib import Path

import numpy
import pytest
import torch
from transformers import AutoProcessor

from mmrecipes.audio_windows import AUDIO_PARTS, WINDOWS, WindowedAudio, windowed_audio
from mmrecipes.vlm.model.loading import load_pretrained, stop_token_ids
from mmrecipes.vlm.rows.labels import AnswerLabeller

PARITY = json.loads((Path(__file__).parent / "fixtures" / "mistral_common_voxtral.json").read_text())
RATE = PARITY["sampling_rate"]


def as_rows(conversation):
    """(messages in transformers' layout, the clips: noise of the lengths given, as the fixture's)."""
    clips = [numpy.random.default_rng(0).uniform(-0.5, 0.5, round(part["seconds"] * RATE)).astype(numpy.float32)
             for turn in conversation for part in turn["content"] if part["type"] == "audio"]
    messages = [{"role": turn["role"], "content": [{"type": "audio"} if part["type"] == "audio" else part
                                                   for part in turn["content"]]} for turn in conversation]
    return messages, clips


@pytest.fixture(scope="module")
def voxtral(tiny_vlms):
    model, processor = load_pretrained(str(tiny_vlms["voxtral"]))
    return model, processor


def test_the_rows_are_the_tokens_mistral_common_writes_and_their_answers_the_only_targets(voxtral):
    model, processor = voxtral
    assert isinstance(processor, WindowedAudio) and processor.rows_per_window == 375
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor), audio=True)
    for conversation, tokens in zip(PARITY["conversations"], PARITY["tokens"]):
        messages, clips = as_rows(conversation)
        asked = messages[-1]["role"] == "user"
        if asked:  # a prompt for generation, as the held-out questions and GRPO's prompts are rendered
            text = processor.apply_chat_template(messages, add_generation_prompt=True)
            ids = processor(text=text, audio=clips, add_special_tokens=False)["input_ids"][0]
        else:  # a training row, as the recipes label it
            encoded, target = labeller(messages, [], audios=clips)
            ids = list(encoded["input_ids"][0])
            answers = [part["text"] for turn in messages if turn["role"] == "assistant" for part in turn["content"]]
            runs = processor.tokenizer.decode(torch.tensor(ids)[target]).split("</s>")
            assert runs == [*answers, ""]  # each answer and its end of turn, nothing else
        assert ids == tokens, f"{len(ids)} tokens, mistral_common's {len(tokens)}"
    # the 45 s clip: two windows, never cut; each window's rows the encoder's
    made = processor(text=processor.audio_token * 2, audio=as_rows(PARITY["conversations"][0])[1])
    assert made[WINDOWS].tolist() == [1, 2] and made["input_features"].shape[0] == 3
    rows = model.get_audio_features(made["input_features"]).pooler_output
    assert len(rows) == 3 * processor.rows_per_window


def test_the_features_are_the_processors_own_and_its_own_call_refuses_clips(voxtral, tiny_vlms):
    model, processor = voxtral
    _, clips = as_rows(PARITY["conversations"][0])
    made = processor(text=processor.audio_token * 2, audio=clips)
    own = AutoProcessor.from_pretrained(tiny_vlms["voxtral"])
    # what VoxtralProcessor gives mistral_common's clips: its own defaults, padded to whole windows
    kwargs = own._merge_kwargs()["audio_kwargs"]
    features = own._retrieve_input_features(clips, kwargs.pop("max_source_positions"), **kwargs)
    assert torch.equal(made["input_features"], features)
    # the old failure: the recipes' call, text with a placeholder a clip, refused by the processor itself
    with pytest.raises(ValueError, match="is present in the provided text which is not supported"):
        own(text=own.audio_token, audio=clips[:1])
    # a tokenizer that reads the template's special tokens as letters (mistral_common's backend does) is refused
    own.tokenizer.split_special_tokens = True
    with pytest.raises(ValueError, match="reads the special tokens a chat template writes as plain text"):
        windowed_audio(model, own)


def test_the_template_renders_transformers_audio_parts_and_is_saved_as_the_checkpoints(voxtral, tmp_path):
    model, processor = voxtral
    messages, _ = as_rows(PARITY["conversations"][1])
    assert processor.chat_template.startswith(AUDIO_PARTS)
    assert processor.apply_chat_template(messages).count(processor.audio_token) == 2
    processor.save_pretrained(tmp_path)
    assert AutoProcessor.from_pretrained(tmp_path).tokenizer.chat_template == (
        Path(__file__).parents[1] / "data_prep" / "chat_templates" / "voxtral.jinja").read_text()
