"""Hostile inputs, round five, in process: files that are not chat templates and templates without a generation
prompt, empty prompt files, teacher folders that are not image-text-to-text models. Each case failed raw or trained
silently before (the tests name what it did)."""

import json

import pytest

from launch import REPO, load_recipe
from mmrecipes.vlm.labels import TemplateError

RECIPES = REPO / "recipes"
TINY_SFT_TEMPLATE = (REPO / "data" / "tiny_sft_vlm" / "chat_template.jinja").read_text()


def run_main(recipe: str, *flags, tmp_path):
    return load_recipe(RECIPES / recipe).main([*map(str, flags), "--max_steps", "2", "--report_to", "none",
                                               "--output_dir", str(tmp_path / "out")])


@pytest.fixture(scope="module")
def not_templates(tmp_path_factory):
    """Files a user gives --chat_template_path by mistake, with what the refusal must say of each. Before, a binary
    file raised UnicodeDecodeError naming no flag, an empty file or a tokenizer_config.json trained into
    transformers' "0 <image> tokens and 1 images", and a missing file or a folder raised after the model loaded."""
    folder = tmp_path_factory.mktemp("not_templates")
    (folder / "binary.jinja").write_bytes(bytes(range(256)))
    (folder / "blank.jinja").write_text(" \n\t\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TINY_SFT_TEMPLATE,
                                                               "model_max_length": 512}))
    (folder / "notes.txt").write_text("user: hello\nassistant: hi")
    (folder / "checkpoint").mkdir()
    (folder / "checkpoint" / "chat_template.jinja").write_text(TINY_SFT_TEMPLATE)
    return {folder / "binary.jinja": "is not UTF-8 text", folder / "blank.jinja": "is empty",
            folder / "tokenizer_config.json": r'is JSON \(a tokenizer_config.json.*"chat_template" value is the '
                                              "template; write that value to a .jinja file",
            folder / "notes.txt": "holds no Jinja", folder / "missing.jinja": "No such file",
            folder / "checkpoint": r"is a folder.*give the file itself \(.*checkpoint/chat_template.jinja\)"}


@pytest.mark.parametrize("recipe", ["vlm_finetune.py", "vlm_grpo.py"])
def test_a_file_that_is_not_a_chat_template_is_refused_at_parse_time_saying_what_one_is(recipe, not_templates,
                                                                                      tmp_path):
    for path, problem in not_templates.items():
        with pytest.raises(ValueError, match=f"--chat_template_path {path}.*{problem}") as raised:
            run_main(recipe, "--chat_template_path", path, tmp_path=tmp_path)
        assert "chat template file is the Jinja text of one template" in str(raised.value)
        assert not (tmp_path / "out").exists()  # refused before anything was built


@pytest.mark.parametrize("recipe", ["vlm_grpo.py", "vlm_distill.py"])
def test_a_template_without_a_generation_prompt_is_refused_where_samples_follow_it(recipe, tmp_path):
    """It trained: each sample started right after the user's turn, with no assistant header."""
    template = tmp_path / "no_generation_prompt.jinja"
    template.write_text(TINY_SFT_TEMPLATE.split("{% if add_generation_prompt %}")[0])
    with pytest.raises(TemplateError, match=f"The chat template of {template} writes no generation prompt"):
        run_main(recipe, "--chat_template_path", template, tmp_path=tmp_path)


@pytest.mark.parametrize("recipe", ["vlm_grpo.py", "vlm_distill.py"])
@pytest.mark.parametrize("content", ["[]", ""])
def test_an_empty_prompts_file_says_there_are_no_training_rows(recipe, content, tmp_path):
    """A JSON array with no row, or a 0-byte JSONL: TypeError: 'NoneType' object is not iterable (prompts.py)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(content)
    with pytest.raises(RuntimeError, match="(?s)A data rank has no training rows.*file is empty"):
        run_main(recipe, "--dataset_name", "json", "--data_files", data, tmp_path=tmp_path)


@pytest.fixture(scope="module")
def not_teachers(tmp_path_factory):
    """Folders a user gives --teacher_model_name_or_path by mistake, with what the refusal must say. Before: an empty
    name and a missing folder gave huggingface_hub's HFValidationError about repo ids, 12 s after the student loaded;
    a training checkpoint (or a link to one) "Unrecognized model ... should have a model_type key"; a text-only
    language model or a BERT "Unrecognized configuration class"."""
    from transformers import BertConfig, BertForMaskedLM

    folder = tmp_path_factory.mktemp("not_teachers")
    checkpoint = folder / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "checkpoint.json").write_text("{}")
    (folder / "latest").symlink_to(checkpoint)
    bert = folder / "bert"
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(bert)
    return {"": "is empty: give a saved model's folder or a hub id", folder / "missing": "no such folder",
            checkpoint: "is a training checkpoint", folder / "latest": "is a training checkpoint",
            REPO / "data" / "tiny_lm": "model type 'llama' is not an image-text-to-text model",
            bert: "model type 'bert' is not an image-text-to-text model"}


def test_a_teacher_folder_that_is_no_vlm_is_refused_naming_the_flag_before_any_model_loads(not_teachers, tmp_path):
    recipe = load_recipe(RECIPES / "vlm_distill.py")

    def student_loads(*args, **kwargs):
        raise AssertionError("the student loaded before the teacher's folder was checked")

    recipe.vlm_parts = student_loads
    for path, problem in not_teachers.items():
        flags = ["--teacher_model_name_or_path", str(path), "--report_to", "none", "--output_dir", str(tmp_path)]
        with pytest.raises(ValueError, match=f"--teacher_model_name_or_path {path}.*{problem}"):
            recipe.main(flags)


def test_a_teacher_whose_weights_are_an_unsafe_pickle_is_refused_naming_the_file_and_safetensors(tmp_path):
    """torch's weights-only traceback, whose advice is to turn the protection off; nothing in the pickle ran."""
    import shutil

    import torch
    from safetensors.torch import load_file

    teacher = tmp_path / "teacher"
    shutil.copytree(REPO / "data" / "tiny_teacher_vlm", teacher)
    weights = load_file(teacher / "model.safetensors") | {"run": RunsCode()}
    (teacher / "model.safetensors").unlink()
    torch.save(weights, teacher / "pytorch_model.bin")
    with pytest.raises(ValueError, match=f"--teacher_model_name_or_path {teacher}: pytorch_model.bin is a pickle "
                                         "holding more than tensors.*save the model as safetensors"):
        run_main("vlm_distill.py", "--teacher_model_name_or_path", teacher, tmp_path=tmp_path)
    assert not RunsCode.ran


class RunsCode:
    ran = False

    def __reduce__(self):
        return setattr, (RunsCode, "ran", True)
