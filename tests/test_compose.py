"""A LLaVA composed from a vision tower and a language model (mmrecipes.vlm.compose), in process, on tiny
checkpoints built from their configs: towers with a class token (CLIP) and without (SigLIP), language models with
untied (Llama, Qwen3) and tied embeddings (SmolLM2's Llama layout); and the recipe's stage 1 on clip_pretrain.py's
own output."""

import numpy
import pytest
import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Siglip2Config,
    Siglip2ImageProcessor,
    Siglip2Model,
    SiglipConfig,
    SiglipImageProcessor,
    SiglipModel,
    pipeline,
)

from launch import REPO, VLM_RECIPE, run_recipe
from mmrecipes.checkpointing import checkpoint_weights
from mmrecipes.images import to_device
from mmrecipes.paths import PLAIN_CHAT_TEMPLATE, TINY_LM, TINY_TOKENIZER
from mmrecipes.vlm.chat_data import CHAT_COUNTED, encode_row
from mmrecipes.vlm.collate import ChatCollator
from mmrecipes.vlm.compose import FLATTEN_CONTENT, IMAGE_TOKEN, compose_llava
from mmrecipes.vlm.families import dummy_image_inputs
from mmrecipes.vlm.labels import AnswerLabeller, check_template
from mmrecipes.vlm.models import VLMForTraining, apply_train_modules, stop_token_ids
from mmrecipes.vlm.module_groups import module_groups

DPO_RECIPE = REPO / "recipes" / "vlm_dpo.py"
VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2, image_size=32,
              patch_size=8)
TEXT_TOWER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  max_position_embeddings=16)
MEAN, STD = [0.25, 0.5, 0.75], [0.2, 0.3, 0.4]  # not the processor's defaults: they must survive into the VLM
# Renders a message's content as a string, as a text-only LM's template does (the compose prelude feeds it one)
STRING_TEMPLATE = ("{% for message in messages %}{{ message.role }}:\n{{ message.content }}{{ eos_token }}\n"
                   "{% endfor %}{% if add_generation_prompt %}assistant:\n{% endif %}")
CAPTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
           {"role": "assistant", "content": [{"type": "text", "text": "a red circle"}]}]


def save_tower(kind: str, directory) -> str:
    if kind == "clip":
        model = CLIPModel(CLIPConfig(vision_config=VISION, text_config=TEXT_TOWER))
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                       image_mean=MEAN, image_std=STD)
    elif kind == "siglip":
        model = SiglipModel(SiglipConfig(vision_config=VISION, text_config=TEXT_TOWER))
        processor = SiglipImageProcessor(size={"height": 32, "width": 32}, image_mean=MEAN, image_std=STD)
    else:  # NaFlex
        vision = {key: value for key, value in VISION.items() if key != "image_size"} | {"num_patches": 16}
        model = Siglip2Model(Siglip2Config(vision_config=vision, text_config=TEXT_TOWER))
        processor = Siglip2ImageProcessor(max_num_patches=16, patch_size=8)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return str(directory)


def save_language_model(kind: str, directory, chat_template: str | None = STRING_TEMPLATE, padded_rows: int = 0) -> str:
    """A tiny causal LM with the embedded byte-level tokenizer, its pad token removed (the composer adds one);
    `padded_rows`: embedding rows past the tokenizer's (Qwen pads its vocabulary to a multiple of 128)."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    tokenizer.pad_token = None
    tokenizer.chat_template = chat_template
    size = dict(vocab_size=len(tokenizer) + padded_rows, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**size, head_dim=32, tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**size, tie_word_embeddings=kind == "tied"))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    towers = {kind: save_tower(kind, root / kind) for kind in ("clip", "siglip", "siglip2")}
    languages = {kind: save_language_model(kind, root / kind) for kind in ("llama", "qwen3", "tied")}
    return towers, languages


def image():
    return Image.fromarray(numpy.random.default_rng(0).integers(0, 256, (40, 52, 3), dtype=numpy.uint8))


@pytest.mark.parametrize("tower", ["clip", "siglip"])
@pytest.mark.parametrize("language", ["llama", "qwen3", "tied"])
def test_a_composed_llava_counts_its_image_tokens_keeps_its_parts_and_stage_1_trains_the_projector_only(
        parts, tmp_path, tower, language):
    towers, languages = parts
    model, processor = compose_llava(towers[tower], languages[language], chat_template="plain")
    source_tower = (CLIPModel if tower == "clip" else SiglipModel).from_pretrained(towers[tower]).vision_model
    source_lm = (Qwen3ForCausalLM if language == "qwen3" else LlamaForCausalLM).from_pretrained(languages[language])
    tokenizer = processor.tokenizer

    # The parts' own weights, the strategy their class token calls for, the processor's constants
    assert torch.equal(model.model.vision_tower.embeddings.patch_embedding.weight,
                       source_tower.embeddings.patch_embedding.weight)
    assert torch.equal(model.model.language_model.layers[0].mlp.up_proj.weight,
                       source_lm.model.layers[0].mlp.up_proj.weight)
    assert model.config.vision_feature_select_strategy == ("default" if tower == "clip" else "full")
    assert model.config.vision_feature_layer == -2
    assert list(processor.image_processor.image_mean) == MEAN and list(processor.image_processor.image_std) == STD

    # <image> and a pad token added; the new rows start at the mean of the old ones; a tie stays a tie
    old_rows = source_lm.get_input_embeddings().num_embeddings
    assert len(tokenizer) == old_rows + 2 and tokenizer.pad_token is not None
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == model.config.image_token_id >= old_rows
    for layer, source in ((model.get_input_embeddings(), source_lm.get_input_embeddings()),
                          (model.get_output_embeddings(), source_lm.get_output_embeddings())):
        assert torch.equal(layer.weight[:old_rows], source.weight)
        mean = source.weight.mean(dim=0)
        assert all(torch.allclose(row, mean, atol=1e-6) for row in layer.weight[old_rows:])
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == (language == "tied")

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
    assert processor.chat_template == FLATTEN_CONTENT + STRING_TEMPLATE  # kept for stage 2; stage 1 trains in plain
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor), template=PLAIN_CHAT_TEMPLATE.read_text())
    check_template(labeller, "the plain chat template")
    input_ids, labels, media = encode_row(labeller, CAPTION, [image()])
    target = tokenizer.decode(input_ids[labels != -100]).strip()
    assert target == "a red circle" + tokenizer.eos_token
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.SGD([p for params in trainable.values() for p in params], lr=0.1)
    batch = ChatCollator(tokenizer.pad_token_id, dummy)([{"input_ids": input_ids, "labels": labels,
                                                           "media_inputs": media, **dict.fromkeys(CHAT_COUNTED, 0)}])
    VLMForTraining(model)(**to_device(batch, "cpu"))[0].backward()
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


def test_a_vocabulary_padded_past_its_tokenizer_is_not_shrunk(parts, tmp_path):
    """Qwen's embeddings have more rows than its tokenizer has tokens: the new tokens take padding rows, set to the
    mean of the real tokens' rows, and no row is dropped."""
    towers, _ = parts
    language = save_language_model("qwen3", tmp_path / "padded", padded_rows=20)
    source = Qwen3ForCausalLM.from_pretrained(language).get_input_embeddings().weight
    model, processor = compose_llava(towers["clip"], language)
    real = len(AutoTokenizer.from_pretrained(language))
    assert len(processor.tokenizer) == real + 2 < len(source)
    weight = model.get_input_embeddings().weight
    assert weight.shape == source.shape
    assert torch.allclose(weight[real:real + 2], source[:real].mean(dim=0).expand(2, -1), atol=1e-6)
    assert torch.equal(weight[:real], source[:real]) and torch.equal(weight[real + 2:], source[real + 2:])


def test_stage_2_uses_the_language_models_template_with_images_written_before_the_text(parts):
    towers, languages = parts
    _, processor = compose_llava(towers["clip"], languages["llama"])
    assert processor.chat_template == FLATTEN_CONTENT + STRING_TEMPLATE
    text = processor.apply_chat_template(CAPTION)
    assert text == (f"user:\n{IMAGE_TOKEN}\nDescribe it.{processor.tokenizer.eos_token}\n"
                    f"assistant:\na red circle{processor.tokenizer.eos_token}\n")


def test_what_cannot_be_composed_is_refused_with_the_reason(parts, tmp_path):
    towers, languages = parts
    with pytest.raises(ValueError, match="NaFlex.*one fixed grid"):
        compose_llava(towers["siglip2"], languages["llama"])
    old = tmp_path / "checkpoint-4"  # written before checkpoints held their model's config
    old.mkdir()
    (old / "checkpoint.json").write_text("{}")
    with pytest.raises(ValueError, match="saved before checkpoints held their model's config"):
        compose_llava(old, languages["llama"])
    base = save_language_model("llama", tmp_path / "base", chat_template=None)
    with pytest.raises(ValueError, match="no chat template \\(a base model\\).*--chat_template_path.*plain"):
        compose_llava(towers["clip"], base)
    _, processor = compose_llava(towers["clip"], base, chat_template="plain")  # stage 1 needs none
    assert processor.chat_template == PLAIN_CHAT_TEMPLATE.read_text()  # and the model keeps plain
    with pytest.raises(ValueError, match="plain \\(LLaVA's stage 1\\) or unset"):
        compose_llava(towers["clip"], base, chat_template="chatml")


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
