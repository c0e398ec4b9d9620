"""Every image-text-to-text family the VLM recipe supports, in one process: answer labels on each
family's official chat template, module groups by rule (and the table that backs it), families
that cannot train rejected from their config, LLaVA JSON rows through each family's processor,
collator and dummy-image step. Checkpoints: tiny models saved in their hub layout (conftest.py)."""

import json

import numpy
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, CLIPConfig, Pix2StructConfig

from helpers import END_OF_TURN, FAMILIES
from launch import VLM_RECIPE, load_recipe
from mmrecipes.distributed import Ranks, fsdp_block_classes
from mmrecipes.images import HOST_KEYS, to_device
from mmrecipes.vlm.arguments import ChatDataArgs, VLMModelArgs
from mmrecipes.vlm.model.evaluation import greedy_tokens
from mmrecipes.vlm.model.families import PROJECTORS, dummy_image_inputs
from mmrecipes.vlm.model.loading import check_trainable, stop_token_ids
from mmrecipes.vlm.model.losses import token_cross_entropy_sum
from mmrecipes.vlm.model.module_groups import apply_train_modules, module_groups
from mmrecipes.vlm.model.outputs import LossSum
from mmrecipes.vlm.model.parts import load_vlm
from mmrecipes.vlm.model.step import VLMForTraining
from mmrecipes.vlm.rows.chat_data import CHAT_COUNTED, build_chat_dataloader, encode_row, prompt_row
from mmrecipes.vlm.rows.collate import ChatCollator
from mmrecipes.vlm.rows.held_out import generation_prompts
from mmrecipes.vlm.rows.labels import IGNORE_INDEX, AnswerLabeller, TemplateError
from mmrecipes.vlm.rows.template_checks import check_template

MARKERS = {"llava", "llava_onevision"}  # the only official templates with {% generation %}
LAST_ANSWER_ONLY = {"qwen3_5", "qwen3_5_moe"}  # official templates that drop an earlier answer's think block
# The inputs each family needs besides pixel_values, which must reach the model from the collator.
EXTRA_INPUTS = {"llava": set(), "llava_next": {"image_sizes"}, "qwen2_vl": {"image_grid_thw", "mm_token_type_ids"},
                "qwen2_5_vl": {"image_grid_thw", "mm_token_type_ids"},
                "qwen3_vl": {"image_grid_thw", "mm_token_type_ids"}, "internvl3": set(),
                "idefics2": {"pixel_attention_mask"},
                "idefics3": {"pixel_attention_mask"},
                "gemma3": {"token_type_ids"},
                # its clips take a video path of their own: a batch without one carries the dummy clip
                "llava_onevision": {"image_sizes", "batch_num_images", "pixel_values_videos", "dummy_video"},
                "mistral3": {"image_sizes"},
                **dict.fromkeys(("qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"), {"image_grid_thw", "mm_token_type_ids"}),
                # E2B hears: a batch without a clip carries the dummy sound (26B-A4B does not)
                "gemma4": {"image_position_ids", "mm_token_type_ids", "input_features", "input_features_mask",
                           "dummy_audio"},
                "gemma4_moe": {"image_position_ids", "mm_token_type_ids"},
                **dict.fromkeys(("qwen2_5_omni", "qwen3_omni_moe"),
                                {"image_grid_thw", "input_features", "feature_attention_mask", "dummy_audio"})}
TWO_TURNS = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
             {"role": "user", "content": [{"type": "text", "text": "How many shapes are there?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "one"}]}]


def load(directory):
    return AutoModelForImageTextToText.from_pretrained(directory), AutoProcessor.from_pretrained(directory)


def labeller_of(directory):
    model, processor = load(directory)
    return AnswerLabeller(processor, stop_token_ids(model, processor))


def target_runs(labeller, encoded, target):
    ids = torch.as_tensor(encoded["input_ids"][0])
    runs, start = [], None
    for position, flag in enumerate(target.tolist() + [False]):
        if flag and start is None:
            start = position
        elif not flag and start is not None:
            runs.append(labeller.tokenizer.decode(ids[start:position]).strip())
            start = None
    return runs


@pytest.mark.parametrize("family", FAMILIES)
def test_targets_are_the_answers_and_their_end_of_turn_on_the_official_template(tiny_vlms, family):
    labeller = labeller_of(tiny_vlms[family])
    assert labeller.has_markers == (family in MARKERS)
    encoded, target = labeller(TWO_TURNS, [Image.new("RGB", (32, 32), (200, 30, 30))])
    end = END_OF_TURN[family]
    answers = ["one"] if family in LAST_ANSWER_ONLY else ["red", "one"]
    # a think template's empty block (Qwen3.5-35B-A3B's: its prompt opened it) is context by default
    assert target_runs(labeller, encoded, target) == [answer + end for answer in answers]
    image_positions = torch.as_tensor(encoded["input_ids"][0]) == labeller.image_token_id
    assert image_positions.sum() > 0 and not (target & image_positions).any()
    rule = "generation markers" if family in MARKERS else "prefix renderings"
    line = check_template(labeller, family)
    assert f"assistant turns found by {rule}" in line
    assert (f"ends each answer with {end}, a target" if end else "will not learn to stop") in line
    assert ("only the last answer of a conversation is a target" in line) == (family in LAST_ANSWER_ONLY)


def test_the_space_before_an_answer_is_a_target_where_the_tokenizer_splits_it_off(tiny_vlms):
    """LLaVA-NeXT's template renders `[/INST] 3</s>` and its generation prompt ends at `[/INST]`; a Mistral-style
    tokenizer makes the space a token of its own before a digit. The model must generate that token first,
    so it is the first target (trimmed spans left it out: the model never learnt how to start)."""
    labeller = labeller_of(tiny_vlms["llava_next"])
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "3"}]}]
    encoded, target = labeller(conversation, [Image.new("RGB", (32, 32), (200, 30, 30))])
    ids = torch.as_tensor(encoded["input_ids"][0])
    assert labeller.tokenizer.convert_ids_to_tokens(ids[target].tolist()) == ["▁", "3", "</s>"]
    prompt = labeller.processor.apply_chat_template(conversation[:1], add_generation_prompt=True)
    prompt_ids = labeller.processor(text=prompt, images=[Image.new("RGB", (32, 32))])["input_ids"][0]
    assert ids[:len(prompt_ids)].tolist() == prompt_ids and target.nonzero().min() == len(prompt_ids)


class OffsetTrustingLabeller(AnswerLabeller):
    """Answer spans mapped to tokens through the processor's offsets, shifted only by the expansions it reports:
    what the labels were before. Idefics2's processor expands `<image>` and reports nothing."""

    def __call__(self, messages, images):
        text, spans = self.answer_spans(messages)
        encoded = self.processor(text=text, images=[images], return_offsets_mapping=True)
        offsets = encoded.pop("offset_mapping")[0]
        target = torch.tensor([any(a < end and b > start for start, end in spans) for a, b in offsets])
        return encoded, target


def test_the_label_check_runs_an_image_conversation_and_catches_an_unreported_expansion(tiny_vlms):
    """On an image conversation the offset-trusting labels of Idefics2 are prompt text; the check before the
    first step refuses them. The labeller's own alignment gives exactly the answers."""
    model, processor = load(tiny_vlms["idefics2"])
    shifted = OffsetTrustingLabeller(processor, stop_token_ids(model, processor))
    encoded, target = shifted(TWO_TURNS, [Image.new("RGB", (32, 32), (200, 30, 30))])
    assert target_runs(shifted, encoded, target)[0].startswith("<fake_token_around_image>")
    with pytest.raises(TemplateError, match="cannot be used for training: the targets found by prefix renderings are"):
        check_template(shifted, "idefics2")
    labeller = labeller_of(tiny_vlms["idefics2"])
    assert "assistant turns found by prefix renderings" in check_template(labeller, "idefics2")


def test_transformers_assistant_mask_is_all_zero_without_generation_markers(tiny_vlms):
    """The old labelling (apply_chat_template's assistant mask) on Qwen's official template finds no
    target at all: every row was dropped as no_target and the run stopped. The labeller finds the answer."""
    _, processor = load(tiny_vlms["qwen2_5_vl"])
    conversation = [{"role": "user", "content": [{"type": "text", "text": "What colour is it?"}]}, TWO_TURNS[1]]
    encoded = processor.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    assert not any(encoded["assistant_masks"][0])
    labeller = labeller_of(tiny_vlms["qwen2_5_vl"])
    assert target_runs(labeller, *labeller(conversation, [])) == ["red<|im_end|>"]


def test_a_row_the_template_refuses_is_a_counted_skip(tiny_vlms, tmp_path):
    """Gemma 3's template raises on roles that do not alternate: that row is dropped and counted, the
    stream goes on."""
    model, processor = load(tiny_vlms["gemma3"])
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    user = {"from": "human", "value": "What comes after one?"}
    rows = [{"conversations": [user, user, {"from": "gpt", "value": "two"}]},
            {"conversations": [user, {"from": "gpt", "value": "two"}]}]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    args = ChatDataArgs(dataset_name="json", data_files=str(tmp_path / "rows.json"), dataset_weights=None,
                        dataloader_num_workers=0)
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    (batch,) = build_chat_dataloader(args, labeller, collator, batch_size=2, ranks=Ranks())
    assert len(batch["input_ids"]) == 1 and batch["data_counts"][CHAT_COUNTED.index("no_target")] == 1
    with pytest.raises(TemplateError, match="the template refuses the conversation: Conversation roles must alternate"):
        labeller([{"role": "user", "content": [{"type": "text", "text": "hi"}]}] * 2, [])


def test_a_template_whose_turns_no_rule_finds_is_rejected_before_the_first_step(tiny_vlms, tmp_path):
    """A generation prompt that is not the assistant header (here: a different role name) and no
    markers: the prefix rule cannot place the answers, and the recipe stops naming the template."""
    template = tmp_path / "odd.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ 'bot' if m['role'] == 'assistant' else m['role'] }}\n"
                        "{% for p in m['content'] %}{{ p['text'] if p['type'] == 'text' else "
                        "'<|vision_start|><|image_pad|>"
                        "<|vision_end|>' }}{% endfor %}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match=f"The chat template of {template} cannot be used for training: rendering "
                                            "the conversation up to assistant turn 1 is not a prefix"):
        load_recipe(VLM_RECIPE).main(["--model_name_or_path", str(tiny_vlms["qwen2_5_vl"]), "--chat_template_path",
                                      str(template), "--report_to", "none", "--output_dir", str(tmp_path / "out")])


def test_generation_markers_must_start_after_the_generation_prompt_and_lead_every_answer_alike(tiny_vlms):
    """A template's own text inside the markers before the answer is a target only when it follows the generation
    prompt and precedes every answer alike (Qwen3's empty think block); markers around the assistant header, or a
    text before one answer only, are refused."""
    model, processor = load_vlm(VLMModelArgs(model_name_or_path=str(tiny_vlms["qwen2_5_vl"])))

    def labeller(assistant_turn):
        processor.chat_template = (
            "{% for m in messages %}{% if m['role'] == 'assistant' %}" + assistant_turn + "<|im_end|>\n"
            "{% else %}<|im_start|>user\n{% for p in m['content'] %}{{ p['text'] if p['type'] == 'text' else "
            "'<|vision_start|><|image_pad|><|vision_end|>' }}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
        return AnswerLabeller(processor, stop_token_ids(model, processor))

    answer = "{{ m['content'][0]['text'] }}"
    line = check_template(labeller("<|im_start|>assistant\n{% generation %}(ok) " + answer + "{% endgeneration %}"),
                          "t")
    assert "it writes '(ok) ' before each answer, a target" in line
    with pytest.raises(TemplateError, match="markers of assistant turn 1 start inside its generation prompt"):
        check_template(labeller("{% generation %}<|im_start|>assistant\n" + answer + "{% endgeneration %}"), "t")
    with pytest.raises(TemplateError, match="not the answers"):
        check_template(labeller("<|im_start|>assistant\n{% generation %}{{ '(ok) ' if loop.index0 == 1 }}" + answer
                                + "{% endgeneration %}"), "t")


@pytest.mark.parametrize("family", FAMILIES)
def test_module_groups_by_rule_agree_with_the_table(tiny_vlms, family):
    """The projector found by the rule is exactly the table's modules; the language model is the
    decoder and head; everything else is the tower; each FSDP2 unit is one of the family's blocks."""
    model, processor = load(tiny_vlms[family])
    groups = module_groups(model, dummy_image_inputs(model, processor))
    # Idefics2's perceiver connector is made of blocks at the language model's width: only the table can tell
    assert groups.projector_by == ("table" if family == "idefics2" else "rule")
    table = PROJECTORS[model.config.model_type]
    assert {name for name, _ in groups.projector} == {
        name for name, _ in model.named_parameters() if any(name == t or name.startswith(t + ".") for t in table)}
    decoder = {id(p) for p in [*model.get_decoder().parameters(), *model.get_output_embeddings().parameters()]}
    assert {id(p) for _, p in groups.language_model} == decoder
    assert groups.vision_tower and all(id(p) not in decoder for _, p in groups.vision_tower)
    assert f"projector {sum(p.numel() for _, p in groups.projector):,} params" in groups.describe()
    trainable = apply_train_modules(groups, "projector")  # LLaVA stage 1, from the same rule for every family
    assert {name for name, p in model.named_parameters() if p.requires_grad} == {
        name for name, _ in groups.projector} - set(groups.unreached)
    assert list(trainable) == ["projector"]
    blocks = fsdp_block_classes(model)
    assert any("Decoder" in name for name in blocks) and len(blocks) >= 2  # the LM's layers and the tower's


def test_the_table_decides_where_the_tower_is_as_wide_as_the_language_model(tiny_vlms):
    """With vision width = LM width the rule cannot tell the merger from the tower: the table decides,
    and gives what the rule gives at different widths."""
    config = AutoConfig.from_pretrained(tiny_vlms["qwen2_5_vl"])
    config.vision_config.hidden_size = config.text_config.hidden_size
    model = AutoModelForImageTextToText.from_config(config)
    groups = module_groups(model, dummy_image_inputs(model))
    assert groups.projector_by == "table"
    assert {name.split(".")[2] for name, _ in groups.projector} == {"merger"}
    model.config.model_type = "unknown_vl"
    with pytest.raises(ValueError, match="Cannot tell the projector of model type 'unknown_vl'"):
        module_groups(model, dummy_image_inputs(model))


def test_families_the_recipe_cannot_train_are_rejected_from_their_config(tmp_path):
    Pix2StructConfig().save_pretrained(tmp_path / "pix2struct")
    with pytest.raises(ValueError, match="model type 'pix2struct' cannot be trained by this recipe: it is an "
                                         "encoder-decoder model"):
        check_trainable(str(tmp_path / "pix2struct"))
    CLIPConfig().save_pretrained(tmp_path / "clip")
    with pytest.raises(ValueError, match="model type 'clip' is not an image-text-to-text model"):
        check_trainable(str(tmp_path / "clip"))


@pytest.fixture(scope="module")
def llava_json(tmp_path_factory):
    """LLaVA-format rows: two images of different sizes (tiles and patches differ), one text-only row."""
    folder = tmp_path_factory.mktemp("llava_json")
    Image.new("RGB", (32, 32), (200, 30, 30)).save(folder / "square.png")
    Image.new("RGB", (64, 24), (30, 30, 200)).save(folder / "wide.png")
    text_only = {"conversations": [{"from": "human", "value": "What comes after one?"},
                                   {"from": "gpt", "value": "two"}]}
    rows = [{"image": "square.png", "conversations": [{"from": "human", "value": "<image>\nWhat colour is the shape?"},
                                                       {"from": "gpt", "value": "red"}]},
            {"image": "wide.png", "conversations": [{"from": "human", "value": "What colour is it?\n<image>"},
                                                     {"from": "gpt", "value": "blue"}]},
            text_only]
    (folder / "rows.json").write_text(json.dumps(rows))
    (folder / "text_only.json").write_text(json.dumps([text_only]))
    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_llava_json_rows_train_through_each_family(tiny_vlms, llava_json, family):
    """`<image>` placeholders become the family's image tokens, every extra image input reaches the
    model, images of different sizes share a batch, and a text-only batch runs the dummy: the
    vision step gets a gradient from real images and an exactly-zero one from the dummy."""
    model, processor = load(tiny_vlms[family])
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    dummy_inputs = dummy_image_inputs(model, processor)
    language_model = {name for name, _ in module_groups(model, dummy_inputs).language_model}
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_inputs)

    def batches(file, batch_size):
        # Mistral 3.1's template writes its 500-token default system prompt into every row
        args = ChatDataArgs(dataset_name="json", data_files=str(llava_json / file), image_folder=str(llava_json),
                            dataset_weights=None, dataloader_num_workers=0, max_length=1024)
        return list(build_chat_dataloader(args, labeller, collator, batch_size=batch_size, ranks=Ranks()))

    (batch,) = batches("rows.json", 3)
    assert dict(zip(CHAT_COUNTED, batch["data_counts"].tolist())) == dict.fromkeys(CHAT_COUNTED, 0)
    # besides the host's counts and the constants that finish uint8 pixels on the device (HOST_KEYS)
    assert set(batch) - {"input_ids", "attention_mask", "labels", "pixel_values", "dummy_image",
                         *HOST_KEYS} == EXTRA_INPUTS[family]
    end = END_OF_TURN[family]
    decoded = [processor.tokenizer.decode(row[row != IGNORE_INDEX]).replace(" ", "") for row in batch["labels"]]
    assert decoded == ["red" + end, "blue" + end, "two" + end]
    assert [(row == labeller.image_token_id).any().item() for row in batch["input_ids"]] == [True, True, False]
    wrapper = VLMForTraining(model)
    summed = wrapper(to_device(batch, "cpu"), LossSum()).summed
    summed.backward()
    assert torch.isfinite(summed)
    # The loss from the base model's hidden states and the output layer in slices is the loss of the
    # family's own forward (its whole logits): lm_head(base_model(...)) is all that forward adds. The dummy
    # clip and sound are not the batch's: the family's forward would look for their placeholders.
    not_given = {"labels", *(["pixel_values_videos"] if batch.get("dummy_video") else []),
                 *(wrapper.audio_input_names if batch.get("dummy_audio") else [])}
    with torch.no_grad():
        own_logits = model(**{name: value for name, value in to_device(batch, "cpu").items()
                              if name in wrapper.forward_input_names and name not in not_given}).logits
    torch.testing.assert_close(summed.detach(), token_cross_entropy_sum(own_logits, batch["labels"]), rtol=1e-5,
                               atol=1e-5)
    vision_step = [p for name, p in model.named_parameters() if p.grad is not None and name not in language_model]
    assert vision_step and any(p.grad.any() for p in vision_step)

    (text_only,) = batches("text_only.json", 1)
    assert text_only["dummy_image"]
    model.zero_grad(set_to_none=True)
    wrapper(to_device(text_only, "cpu"), LossSum()).summed.backward()
    assert all(p.grad is not None and not p.grad.any() for p in vision_step)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3"])
def test_a_two_image_llava_row_brings_both_images_to_the_loss(tiny_vlms, tmp_path, family):
    """`"image": [a, b]` with two `<image>` placeholders, in a file whose other rows have one image path: every
    row is kept, the row carries both images' tokens, and swapping the two images changes the loss."""
    model, processor = load(tiny_vlms[family])
    labeller = AnswerLabeller(processor, stop_token_ids(model, processor))
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "red.png")
    Image.new("RGB", (32, 32), (30, 30, 200)).save(tmp_path / "blue.png")  # same size: only the pixels differ
    one = {"image": "red.png", "conversations": [{"from": "human", "value": "<image>\nWhat colour is it?"},
                                                 {"from": "gpt", "value": "red"}]}
    question = [{"from": "human", "value": "<image>\n<image>\nWhich colour comes first?"},
                {"from": "gpt", "value": "red"}]
    wrapper, losses = VLMForTraining(model), []
    for name, pair in (("ab", ["red.png", "blue.png"]), ("ba", ["blue.png", "red.png"])):
        (tmp_path / f"{name}.json").write_text(json.dumps([one, {"image": pair, "conversations": question}]))
        args = ChatDataArgs(dataset_name="json", data_files=str(tmp_path / f"{name}.json"),
                            image_folder=str(tmp_path), dataset_weights=None, dataloader_num_workers=0)
        (batch,) = build_chat_dataloader(args, labeller, collator, batch_size=2, ranks=Ranks())
        assert not batch["data_counts"].any()
        image_tokens = (batch["input_ids"] == labeller.image_token_id).sum(dim=1)
        assert image_tokens[1] > image_tokens[0] > 0  # both images expanded in the two-image row
        with torch.no_grad():
            losses.append(wrapper(to_device(batch, "cpu"), LossSum()).summed)
    assert not torch.isclose(losses[0], losses[1], rtol=1e-6, atol=0)


# The families whose image processors give their own floats from uint8 finished on the device (the others pad after
# normalising, or return floats: their images cross the loader as float32)
UINT8_IMAGES = {"llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl3", "gemma3", "qwen3_5",
                "qwen3_vl_moe", "qwen3_5_moe", "qwen2_5_omni", "qwen3_omni_moe"}


def test_images_cross_the_loader_as_uint8_where_the_processor_gives_its_own_floats(tiny_vlms):
    """Two images of different sizes in one row, through each family's labeller: as uint8 finished by `to_device`,
    the same pixel values to the bit as the processor's own float32; uint8 exactly where the probe allows it."""
    random = numpy.random.default_rng(3)
    images = [Image.fromarray(random.integers(0, 256, (height, width, 3), dtype=numpy.uint8))
              for height, width in ((50, 40), (31, 77))]
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "a red circle"}]}]
    crossing = set()
    for family in FAMILIES:
        labeller = labeller_of(tiny_vlms[family])
        _, _, shipped = encode_row(labeller, conversation, images)
        labeller.normalization["pixel_values"] = None  # what the processor gives on its own
        _, _, floats = encode_row(labeller, conversation, images)
        assert floats["pixel_values"].dtype == torch.float32
        assert torch.equal(to_device(shipped, "cpu")["pixel_values"], floats["pixel_values"]), family
        if shipped["pixel_values"].dtype == torch.uint8:
            crossing.add(family)
    assert crossing == UINT8_IMAGES


@pytest.mark.parametrize("family", ["llava_next", "qwen2_5_vl", "gemma3"])
def test_greedy_decoding_in_the_evaluation_is_what_generate_gives(tiny_vlms, family):
    """The generated-answer evaluation decodes through the training wrapper (same forwards on every rank); on
    the processor's own generation prompt it appends exactly the tokens of transformers' greedy `generate`."""
    model, processor = load(tiny_vlms[family])
    model.eval()
    conversation = TWO_TURNS[:1]
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    inputs = processor(text=processor.apply_chat_template(conversation, add_generation_prompt=True), images=[[image]],
                       return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    collator = ChatCollator(processor.tokenizer.pad_token_id, dummy_image_inputs(model, processor))
    batch = collator([prompt_row(processor, conversation, [image])])
    assert greedy_tokens(VLMForTraining(model), to_device(batch, "cpu"), 5)[:len(expected)] == expected


def test_paligemma2_gets_eager_attention_and_is_refused_for_its_missing_template(tiny_vlms, tmp_path, caplog):
    """Gemma 2 has no sdpa kernel: the default falls back to eager there with a log line naming the flag (a kernel the
    user asked for by name is refused naming it). PaliGemma 2 ships no chat template (a prefix-LM), so the
    recipe stops before the first step and says what to give it."""
    with caplog.at_level("WARNING"):
        model, _ = load_vlm(VLMModelArgs(model_name_or_path=str(tiny_vlms["paligemma2"])))
    # its language model eager, its SigLIP tower sdpa: each part the kernel it has
    assert (model.config.text_config._attn_implementation, model.config.vision_config._attn_implementation) == (
        "eager", "sdpa")
    assert "PaliGemmaForConditionalGeneration: text_config has no sdpa attention and keeps eager" in caplog.text
    with pytest.raises(ValueError, match="--attn_implementation no_such_kernel: "):
        load_vlm(VLMModelArgs(model_name_or_path=str(tiny_vlms["paligemma2"]), attn_implementation="no_such_kernel"))
    with pytest.raises(TemplateError, match="the processor has no chat template \\(or several\\): give one with "
                                            "--chat_template_path"):
        load_recipe(VLM_RECIPE).main(["--model_name_or_path", str(tiny_vlms["paligemma2"]), "--report_to", "none",
                                      "--output_dir", str(tmp_path)])


def test_generation_prompts_skip_what_training_skips_and_read_nothing_outside_the_image_folder(tiny_vlms, tmp_path):
    """The held-out prompts for greedy generation go through the training rows' image checks: a path that leaves
    --image_folder is never opened, a row whose placeholders miss an image is left out."""
    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(folder / "red.png")
    Image.new("RGB", (32, 32), (30, 30, 200)).save(tmp_path / "outside.png")
    question = [{"from": "human", "value": "<image>\nWhat colour is it?"}, {"from": "gpt", "value": "red"}]
    rows = [{"image": "../outside.png", "conversations": question},
            {"conversations": question},  # a placeholder without its image
            {"image": "red.png", "conversations": question}]
    (tmp_path / "eval.json").write_text(json.dumps(rows))
    _, processor = load(tiny_vlms["qwen2_5_vl"])
    args = ChatDataArgs(eval_dataset_name="json", eval_data_files=str(tmp_path / "eval.json"), eval_split="train",
                        image_folder=str(folder))
    prompts = generation_prompts(args, processor, rows=8, ranks=Ranks())
    assert [held.answer for held in prompts] == ["red"]
    assert (prompts[0].prompt["input_ids"] == processor.image_token_id).any()
