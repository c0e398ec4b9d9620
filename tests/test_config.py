"""Arguments from flags and YAML, through each recipe's own ARGUMENTS: what a YAML file sets reaches its
dataclass, flags override it, and a YAML mistake is an error that says what to write (in process)."""

import dataclasses
import re
import subprocess
import sys

import pytest
import yaml

from launch import RECIPE, REPO, VLM_RECIPE, load_recipe
from mmrecipes.config import parse_args
from mmrecipes.contrastive.arguments import ModelArgs
from mmrecipes.vlm.arguments import VLMModelArgs


@pytest.mark.parametrize("text, message", [
    ("learning_rate: 2e-5\n", "YAML read learning_rate: 2e-5 as a string"),
    ("mixed_precision: no\n", "quote it (e.g. 'no')"),
    ("max_step: 10\n", "unknown key 'max_step' (did you mean 'max_steps'?)"),
    ("max_steps: '10'\n", "'max_steps' must be int"),
])
def test_bad_yaml_rejected_with_a_fix(tmp_path, text, message):
    recipe = load_recipe()
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(recipe.ARGUMENTS, [str(config)])


# Values unlike every default, a key for each of the recipe's dataclasses.
YAML_VALUES = {
    RECIPE: {"hidden_size": 48, "caption_column": "caption", "shuffle_buffer_size": 77, "zeroshot_templates": "a {}.",
             "learning_rate": 3.0e-4, "max_steps": 11, "loss_tile_size": 8,
             "contrastive_accumulation": "feature_cache"},
    VLM_RECIPE: {"text_layers": 3, "lora_r": 4, "max_length": 99, "dataset_weights": "0.5,0.5", "max_steps": 11,
                 "vision_tower_learning_rate": 1.0e-5, "image_folder": "/images", "debug_divergence": True},
}


@pytest.mark.parametrize("path", [RECIPE, VLM_RECIPE], ids=["clip", "vlm"])
def test_yaml_values_reach_their_dataclass_and_flags_override_them(tmp_path, path):
    recipe, values = load_recipe(path), YAML_VALUES[path]
    fields = {field.name: field for cls in recipe.ARGUMENTS for field in dataclasses.fields(cls)}
    assert all(fields[name].default != value for name, value in values.items())  # a default would prove nothing
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(values))
    parsed = parse_args(recipe.ARGUMENTS, [str(tmp_path / "run.yaml"), "--max_steps", "5"])
    owner = {field.name: instance for instance in parsed for field in dataclasses.fields(instance)}
    for name, value in values.items():
        assert getattr(owner[name], name) == (5 if name == "max_steps" else value), name
    # The shipped hyper-parameter files parse with the recipe's arguments, every value where it belongs.
    shipped = REPO / "recipes" / "configs" / ("clip_tiny.yaml" if path == RECIPE else "vlm_tiny.yaml")
    parsed = parse_args(recipe.ARGUMENTS, [str(shipped)])
    owner = {field.name: instance for instance in parsed for field in dataclasses.fields(instance)}
    for name, value in yaml.safe_load(shipped.read_text()).items():
        assert getattr(owner[name], name) == value, name


def test_a_choice_is_checked_alike_from_yaml_and_from_the_command_line(tmp_path):
    """YAML values never meet argparse's `choices`: `contrastive_accumulation: featurecache` ran plain accumulation
    without a word. One rule (`checked(..., choices=...)`) checks both, as every other value rule does."""
    recipe = load_recipe()
    (tmp_path / "run.yaml").write_text("contrastive_accumulation: featurecache\n")
    message = "--contrastive_accumulation 'featurecache': must be one of plain, feature_cache (the default is plain)"
    for argv in ([str(tmp_path / "run.yaml")], ["--contrastive_accumulation", "featurecache"]):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_args(recipe.ARGUMENTS, argv)


@pytest.mark.parametrize("argv, message", [
    (["--max_caption_length", "32"], "Leave --max_caption_length unset"),
    (["--loss_tile_size", "8"], "siglip_loss never holds a [b, N] matrix"),
])
def test_bad_siglip_settings_rejected_before_training(argv, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe().main(["--loss", "siglip", "--report_to", "none", "--output_dir", str(tmp_path), *argv])


@pytest.mark.parametrize("values, message", [
    ({"lr_scheduler_type": "warmup_stable_decay"}, "--lr_scheduler_kwargs '{\"num_decay_steps\": 60}'"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "steps on an evaluation metric"),
    ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": "num_cycles=2"}, "write a JSON object"),
    ({"lr_scheduler_type": "no_such_schedule"}, "--lr_scheduler_type no_such_schedule"),
    ({"adam_beta2": 1.0}, "--adam_beta2 1.0: must be a number from 0 up to (not including) 1"),
    ({"adam_epsilon": float("nan")}, "--adam_epsilon nan: must be a finite number above 0"),
])
def test_optimizer_and_schedule_settings_rejected_when_parsed(values, message):
    """A schedule transformers cannot build from the flags (WSD without its decay steps raised a TypeError once
    the model was built), or one the loop cannot step, and impossible AdamW settings: refused when parsed."""
    train_args = load_recipe().ARGUMENTS[-1]
    with pytest.raises(ValueError, match=re.escape(message)):
        train_args(**values)


@pytest.mark.parametrize("path, shown", [
    (RECIPE, ["--max_steps MAX_STEPS, --max-steps MAX_STEPS optimizer steps (default: 300)",
              "--zeroshot_templates ZEROSHOT_TEMPLATES, --zeroshot-templates ZEROSHOT_TEMPLATES"]),
    (VLM_RECIPE, ["--max_length MAX_LENGTH, --max-length MAX_LENGTH longer rows are skipped and counted, never "
                  "truncated (default: 256)", "--use_peft [USE_PEFT], --use-peft [USE_PEFT] train LoRA adapters"]),
], ids=["clip", "vlm"])
def test_help_shows_each_flags_comment_and_default(capsys, path, shown):
    """`recipe.py --help`: every flag with its default, and the comment its dataclass gives it (it showed names
    only)."""
    recipe = load_recipe(path)
    with pytest.raises(SystemExit) as stop:
        parse_args(recipe.ARGUMENTS, ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert stop.value.code == 0 and all(line in text for line in shown), text[:3000]
    fields = sum(len(dataclasses.fields(cls)) for cls in recipe.ARGUMENTS)
    assert text.count("(default: ") == fields


def test_tiny_model_shapes_beside_a_pretrained_model_are_refused_not_ignored():
    """`--image_size 224 --model_name_or_path <dir>` trained at the checkpoint's size and saved its config, without
    a word; every tiny-model shape flag changed beside a checkpoint is now refused."""
    with pytest.raises(ValueError, match=re.escape("--image_size 224: not used with --model_name_or_path")):
        ModelArgs(model_name_or_path="openai/clip-vit-base-patch32", image_size=224)
    with pytest.raises(ValueError, match=re.escape("--patch_size 14, --text_layers 4: not used with")):
        VLMModelArgs(model_name_or_path="llava-hf/llava-1.5-7b-hf", text_layers=4, patch_size=14)
    ModelArgs(model_name_or_path="openai/clip-vit-base-patch32", loss="clip", attn_implementation="eager")
    ModelArgs(image_size=224)  # the tiny model's own shape


def test_help_and_a_bad_flag_answer_before_torch_loads():
    """Each recipe parses its flags (mmrecipes.arguments) before it imports torch and the models: `--help` took
    4.5 s here (38-58 s on a cold disk), about 1 s now. Checked by what the process imported, not by the clock."""
    script = (
        "import contextlib, io, runpy, sys\n"
        "answers = []\n"
        f"for recipe in {[str(path) for path in sorted((REPO / 'recipes').glob('*.py'))]!r}:\n"
        "    for argv in (['--help'], ['--max_steps', '0']):\n"
        "        sys.argv = [recipe, *argv]\n"
        "        try:\n"
        "            with contextlib.redirect_stdout(io.StringIO()):\n"
        "                runpy.run_path(recipe, run_name='__main__')\n"
        "        except SystemExit as exit:\n"
        "            answers.append('help' if exit.code == 0 else exit.code)\n"
        "        except ValueError as error:\n"
        "            answers.append(str(error).split(':')[0])\n"
        "print(*answers, 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    recipes = len(list((REPO / "recipes").glob("*.py")))
    assert result.stdout.split() == ["help", "--max_steps", "0"] * recipes + ["False"], result.stdout + result.stderr
