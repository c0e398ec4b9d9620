"""A LLaVA composed from a vision tower and a language model (mmrecipes.vlm.model.compose), in process, on tiny
checkpoints built from their configs: towers with a class token (CLIP) and without (SigLIP); language models with
their own tokenizer classes and official chat templates (data_prep/tiny_language_models.py: Llama 3.2 and Gemma 3
text with tied embeddings, Qwen3 untied and padded past its tokenizer); and the recipe's stage 1 on
clip_pretrain.py's own output."""
from pathlib import Path

import numpy
import pytest
import torch
import trl
from PIL import Image
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    CLIPModel,
    SiglipModel,
    pipeline,
)

from helpers import MEAN, STD, save_tower
from launch import REPO, VLM_RECIPE, run_recipe
from mmrecipes.checkpointing import checkpoint_weights
from mmrecipes.images import to_device
from mmrecipes.paths import PLAIN_CHAT_TEMPLATE, TINY_LM
from mmrecipes.vlm.arguments import VLMModelArgs
from mmrecipes.vlm.model.compose import FLATTEN_CONTENT, IMAGE_TOKEN, compose_llava
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.loading import stop_token_ids
from mmrecipes.vlm.model.module_groups import apply_train_modules, module_groups
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import encode_row
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.labels import AnswerLabeller
from mmrecipes.vlm.rows.template_checks import _runs, check_template
from tiny_language_models import save_tiny_language_model

DPO_RECIPE = REPO / "recipes" / "vlm_dpo.py"
LANGUAGE_MODELS = ("llama3", "qwen3", "gemma3_text")
TIED = ("llama3", "gemma3_text")  # Llama 3.2 1B/3B and Gemma 3 tie their embeddings; Qwen3 8B and up do not
# TRL's training patch of Qwen3's template: the think block before every answer, {% generation %} markers
QWEN3_TRAINING = Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja"
CAPTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
           {"role": "assistant", "content": [{"type": "text", "text": "a red circle"}]}]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    towers = {kind: save_tower(kind, root / kind) for kind in ("clip", "siglip", "siglip2")}
    languages = {family: str(save_tiny_language_model(family, root / family))
                 for family in LANGUAGE_MODELS + ("phi3_5",)}
    return towers, languages


def image():
    return Image.fromarray(numpy.random.default_rng(0).integers(0, 256, (40, 52, 3), dtype=numpy.uint8))


@pytest.mark.parametrize("tower", ["clip", "siglip"])
@pytest.mark.parametrize("language", LANGUAGE_MODELS)
def test_a_composed_llava_counts_its_image_tokens_keeps_its_parts_and_stage_1_trains_the_projector_only(
        parts, tmp_path, tower, language):
    towers, languages = parts
    model, processor = compose_llava(towers[tower], languages[language], chat_template="plain")
    source_tower = (CLIPModel if tower == "clip" else SiglipModel).from_pretrained(towers[tower]).vision_model
    source_lm = AutoModelForCausalLM.from_pretrained(languages[language])
    source_tokenizer = AutoTokenizer.from_pretrained(languages[language])
    tokenizer = processor.tokenizer
    assert type(tokenizer) is type(source_tokenizer)  # the LM's own tokenizer class, special tokens and BOS rule

    # The parts' own weights, the strategy their class token calls for, the processor's constants
    assert torch.equal(model.model.vision_tower.embeddings.patch_embedding.weight,
                       source_tower.embeddings.patch_embedding.weight)
    assert torch.equal(model.model.language_model.layers[0].mlp.up_proj.weight,
                       source_lm.model.layers[0].mlp.up_proj.weight)
    assert model.config.vision_feature_select_strategy == ("default" if tower == "clip" else "full")
    assert model.config.vision_feature_layer == -2
    assert list(processor.image_processor.image_mean) == MEAN and list(processor.image_processor.image_std) == STD

    # <image> added, and a pad token where the LM has none (Llama 3); the new rows start at the mean of the
    # tokenizer's rows; a vocabulary padded past its tokenizer (Qwen's) is never shrunk; a tie stays a tie
    old, added = len(source_tokenizer), 1 + (source_tokenizer.pad_token is None)
    assert len(tokenizer) == old + added and tokenizer.pad_token is not None
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == model.config.image_token_id >= old
    rows = source_lm.get_input_embeddings().num_embeddings
    assert (rows > old + added) == (language == "qwen3")
    for layer, source in ((model.get_input_embeddings(), source_lm.get_input_embeddings()),
                          (model.get_output_embeddings(), source_lm.get_output_embeddings())):
        assert layer.weight.shape[0] == max(rows, old + added)
        assert torch.equal(layer.weight[:old], source.weight[:old])
        assert torch.equal(layer.weight[old + added:], source.weight[old + added:])
        mean = source.weight[:old].mean(dim=0)
        assert all(torch.allclose(row, mean, atol=1e-6) for row in layer.weight[old:old + added])
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == (language in TIED)

    # As many <image> tokens as the tower gives features (the "tokens 729, features 728" error otherwise)
    inputs = processor(text=processor.apply_chat_template(CAPTION), images=[image()], return_tensors="pt")
    features = model.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).pooler_output
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == sum(len(f) for f in features) == 16
    model(**inputs)

    # The tower's layer after the feature layer and its post-layernorm (SigLIP: and its pooling head) get no
    # gradient: found, to be frozen and named
    dummy = dummy_image_inputs(model, processor)
    groups = module_groups(model, dummy)
    tower_parts = {name.removeprefix("model.vision_tower.").split(".")[0] for name in groups.unreached}
    assert any(name.startswith("model.vision_tower.encoder.layers.2.") for name in groups.unreached)
    assert "model.vision_tower.post_layernorm.weight" in groups.unreached
    assert ("head" in tower_parts) == (tower == "siglip")
    assert not any(".layers.1." in name for name in groups.unreached)  # the feature layer itself trains

    # Stage 1: only the projector moves
    trainable = apply_train_modules(groups, "projector")
    assert processor.chat_template == FLATTEN_CONTENT + source_tokenizer.chat_template  # stage 2's; stage 1: plain
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor), template=PLAIN_CHAT_TEMPLATE.read_text())
    check_template(labeller, "the plain chat template")
    input_ids, labels, media = encode_row(labeller, CAPTION, [image()])
    target = tokenizer.decode(input_ids[labels != -100]).strip()
    assert target == "a red circle" + tokenizer.eos_token
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.SGD([p for params in trainable.values() for p in params], lr=0.1)
    batch = ChatCollator(tokenizer.pad_token_id, dummy)([{"input_ids": input_ids, "labels": labels,
                                                           "media_inputs": media}])
    VLMForTraining(model)(to_device(batch, "cpu"), LossSum()).summed.backward()
    optimizer.step()
    moved = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    assert moved and all(name.startswith("model.multi_modal_projector.") for name in moved)

    # A standard Llava: saved, it loads with the Auto classes and answers through the pipeline
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert type(reloaded).__name__ == "LlavaForConditionalGeneration"
    assert list(AutoProcessor.from_pretrained(tmp_path).image_processor.image_mean) == MEAN
    answer = pipeline("image-text-to-text", model=str(tmp_path))(
        text=[{"role": "user", "content": [{"type": "image", "image": image()}]}], max_new_tokens=2)
    assert answer[0]["generated_text"][-1]["role"] == "assistant"


@pytest.mark.parametrize("language", LANGUAGE_MODELS + ("phi3_5",))
def test_stage_2_labels_the_answers_in_the_language_models_own_template(parts, language):
    """Each LM's official template, images written before the text: the targets are the answers and the
    end-of-turn token. Phi-3.5's closes a rendering without a generation prompt with <|endoftext|> (it was refused:
    "not a prefix"): read without it, and not a target. Qwen3's writes its empty think block before the last answer
    only, so an earlier answer renders differently once later turns follow (it was refused): the last answer is the
    target, the earlier ones context, and the log line says so; TRL's training patch of it (given as
    --chat_template_path) trains the think block before every answer."""
    towers, languages = parts
    model, processor = compose_llava(towers["clip"], languages[language])
    conversation = CAPTION + [{"role": "user", "content": [{"type": "text", "text": "And the shape?"}]},
                              {"role": "assistant", "content": [{"type": "text", "text": "circle"}]}]
    assert f"{IMAGE_TOKEN}\nDescribe it." in processor.apply_chat_template(conversation)
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    end = {"llama3": "<|eot_id|>", "qwen3": "<|im_end|>", "gemma3_text": "<end_of_turn>", "phi3_5": "<|end|>"}[language]
    lead, answers = ("<think>\n\n</think>\n\n", ["circle"]) if language == "qwen3" else ("", ["a red circle", "circle"])
    line = check_template(labeller, languages[language])
    assert ("only the last answer of a conversation is a target" in line) == (language == "qwen3")
    if language == "qwen3":
        input_ids, labels, _ = encode_row(labeller, conversation, [image()])
        assert [processor.tokenizer.decode(input_ids[run]) for run in _runs(labels != -100)] == [f"{lead}circle{end}"]
        model, processor = compose_llava(towers["clip"], languages[language], chat_template_path=QWEN3_TRAINING)
        assert processor.chat_template == FLATTEN_CONTENT + QWEN3_TRAINING.read_text()
        labeller, answers = AnswerLabeller(processor, stop_token_ids(model, processor)), ["a red circle", "circle"]
        line = check_template(labeller, languages[language])
    assert f"ends each answer with {end}, a target" in line and (repr(lead) in line) == bool(lead)
    input_ids, labels, _ = encode_row(labeller, conversation, [image()])
    targets = [processor.tokenizer.decode(input_ids[run]) for run in _runs(labels != -100)]
    assert targets == [f"{lead}{answer}{end}" for answer in answers]
    assert int((input_ids == model.config.image_token_id).sum()) == 16


def test_what_cannot_be_composed_is_refused_with_the_reason(parts, tmp_path):
    towers, languages = parts
    with pytest.raises(ValueError, match="NaFlex.*one fixed grid"):
        compose_llava(towers["siglip2"], languages["llama3"])
    old = tmp_path / "checkpoint-4"  # written before checkpoints held their model's config
    old.mkdir()
    (old / "checkpoint.json").write_text("{}")
    with pytest.raises(ValueError, match="saved before checkpoints held their model's config"):
        compose_llava(old, languages["llama3"])
    base = save_tiny_language_model("llama3", tmp_path / "base")
    (base / "chat_template.jinja").unlink()  # a base model ships none
    with pytest.raises(ValueError, match="no chat template \\(a base model\\).*--chat_template_path.*plain"):
        compose_llava(towers["clip"], base)
    instruct = Path(languages["llama3"]) / "chat_template.jinja"  # the fix named: the instruct sibling's template
    _, processor = compose_llava(towers["clip"], base, chat_template_path=instruct)
    assert processor.chat_template == FLATTEN_CONTENT + instruct.read_text()
    _, processor = compose_llava(towers["clip"], base, chat_template="plain")  # stage 1 needs none
    assert processor.chat_template == PLAIN_CHAT_TEMPLATE.read_text()  # and the model keeps plain
    with pytest.raises(ValueError, match="--chat_template 'chatml': must be one of plain"):  # checked when parsed
        VLMModelArgs(chat_template="chatml")


def test_the_wrong_parts_are_refused_each_with_its_own_reason_before_any_weight_is_read(parts, tmp_path):
    """What transformers raised from inside: a text model as the tower ("NaFlex"), a built Llava as the tower (no
    attribute 'embeddings'), a BERT as the language model (no attribute embed_tokens), a language model without its
    tokenizer ("install sentencepiece or tiktoken"), a missing tower ("Repo id must be in the form"), a feature layer
    the tower does not have (IndexError; 0: 'NoneType' object is not subscriptable)."""
    towers, languages = parts
    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(bert)
    AutoTokenizer.from_pretrained(languages["llama3"]).save_pretrained(bert)
    untokenized = tmp_path / "untokenized"
    AutoModelForCausalLM.from_pretrained(languages["llama3"]).save_pretrained(untokenized)
    for (tower, language, layer), reason in {
        (languages["llama3"], languages["llama3"], -2): "is a llama model with no vision config",
        (str(REPO / "data" / "tiny_sft_vlm"), languages["llama3"], -2): "is a built image-text-to-text model",
        (towers["clip"], bert, -2): "is a BertForMaskedLM, not a decoder-only causal language model",
        (towers["clip"], untokenized, -2): "has no tokenizer",
        (str(tmp_path / "no_tower"), languages["llama3"], -2): "no such folder",
        ("outputs/no_tower", languages["llama3"], -2): "neither a model folder here nor a model transformers",
        (towers["clip"], languages["llama3"], 99): "has 3 layers; give 1 to 3, or -1 \\(its last\\) to -3",
        (towers["clip"], languages["llama3"], -99): "has 3 layers",
        (towers["clip"], languages["llama3"], 0): "0 and -4 are its patch embeddings",
    }.items():
        with pytest.raises(ValueError, match=reason):
            compose_llava(tower, language, vision_feature_layer=layer)


def test_a_composed_models_stage_2_with_a_chat_template_path_keeps_the_content_prelude(parts, tmp_path):
    """Stage 2 of a composed Qwen3 trains the last answer only in its template, and the log line points to TRL's
    training template: given with --chat_template_path to the saved stage-1 model, it replaced the composed
    template and its content prelude (TypeError: can only concatenate str (not "list") to str)."""
    towers, languages = parts
    model, processor = compose_llava(towers["clip"], languages["qwen3"])
    model.save_pretrained(tmp_path / "stage1")
    processor.save_pretrained(tmp_path / "stage1")
    model, processor = load_vlm(VLMModelArgs(model_name_or_path=str(tmp_path / "stage1"),
                                             chat_template_path=str(QWEN3_TRAINING)))
    assert processor.chat_template == FLATTEN_CONTENT + QWEN3_TRAINING.read_text()
    line = check_template(AnswerLabeller(processor, stop_token_ids(model, processor)), "stage1")
    assert "ends each answer with <|im_end|>, a target" in line


@pytest.mark.launch
def test_the_embedded_pipeline_from_clip_pretrain_to_dpo(tmp_path):
    """README's "Build your own VLM" at a few steps each: clip_pretrain.py's output composed with the embedded tiny
    base LM; stage 1 on the CLIP captions in the plain format (the tower's unused layer frozen and named, only the
    projector trains, every readable caption kept); stage 2 from stage 1's output in the LM's own template with no
    template flag; DPO from stage 2's. Each output loads with the Auto classes and answers through the pipeline."""
    tower = tmp_path / "clip"
    assert run_recipe("--max_steps", 2, "--save_steps", 1, "--output_dir", tower).returncode == 0
    # A checkpoint of that run is a tower too (its config and image processor are saved beside the weights)
    checkpoint = tower / "checkpoints" / "checkpoint-1"
    model, _ = compose_llava(checkpoint, TINY_LM, chat_template="plain")
    expected = checkpoint_weights(checkpoint)["vision_model.embeddings.patch_embedding.weight"]
    assert torch.equal(model.model.vision_tower.embeddings.patch_embedding.weight, expected)
    assert not torch.equal(expected, CLIPModel.from_pretrained(tower).vision_model.embeddings.patch_embedding.weight)
    result = run_recipe("--vision_model_name_or_path", tower, "--language_model_name_or_path", "embedded:tiny_lm",
                        "--chat_template", "plain", "--train_modules", "projector", "--dataset_name",
                        "embedded:shapes", "--dataset_weights", "none", "--eval_dataset_name", "none",
                        "--max_steps", 3, "--logging_steps", 3, "--output_dir", tmp_path / "stage1", recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert "froze 18 parameters no forward path reaches: model.vision_tower.encoder.layers.1." in result.log
    assert "trainable parameters" in result.log and "no_target 0" in result.log
    language_template = AutoTokenizer.from_pretrained(TINY_LM).chat_template
    assert AutoProcessor.from_pretrained(tmp_path / "stage1").chat_template == FLATTEN_CONTENT + language_template
    result = run_recipe("--model_name_or_path", tmp_path / "stage1", "--max_steps", 2, "--eval_steps", 2,
                        "--eval_generation_rows", 0, "--output_dir", tmp_path / "stage2", recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert f"chat template of {tmp_path / 'stage1'}: assistant turns found by generation markers" in result.log
    assert "no_target 0" in result.log
    result = run_recipe("--model_name_or_path", tmp_path / "stage2", "--max_steps", 2, "--eval_steps", 2,
                        "--output_dir", tmp_path / "dpo", recipe=DPO_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    for stage in ("stage1", "stage2", "dpo"):
        assert type(AutoModelForImageTextToText.from_pretrained(tmp_path / stage)).__name__ == (
            "LlavaForConditionalGeneration")
        answer = pipeline("image-text-to-text", model=str(tmp_path / stage))(
            text=[{"role": "user", "content": [{"type": "image", "image": image()}, {"type": "text", "text": "?"}]}],
            max_new_tokens=2)
        assert answer[0]["generated_text"][-1]["role"] == "assistant"
