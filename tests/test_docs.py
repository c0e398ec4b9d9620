"""The commands in README.md and docs/ are ones that run: every `accelerate launch` in a bash block
names config files and a recipe that exist, and the recipe's own parser accepts its flags (a renamed
or removed flag fails here, not in a reader's terminal). In-process: parsing only, no launch."""

import importlib.util
import re
import shlex

import pytest

from launch import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def bash_commands(page):
    """Each command of the page's ```bash blocks: continuations joined, comments dropped, split at &&."""
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                yield from (command.strip() for command in line.split("&&"))


def documented_launches():
    for page in PAGES:
        for command in bash_commands(page):
            words = shlex.split(command)
            if words[:2] == ["accelerate", "launch"]:
                yield pytest.param(words[2:], id=f"{page.name}: {command[:80]}")


def recipe_arguments(recipe):
    spec = importlib.util.spec_from_file_location(recipe.stem, recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ARGUMENTS


def test_the_pages_document_every_recipe_and_their_scripts_exist():
    recipes = {word for launch in documented_launches() for word in launch.values[0] if word.startswith("recipes/")}
    assert {"recipes/clip_pretrain.py", "recipes/vlm_finetune.py", "recipes/vlm_dpo.py"} <= recipes
    scripts = [shlex.split(command)[1] for page in PAGES for command in bash_commands(page)
               if command.startswith("python ") and shlex.split(command)[1].endswith(".py")]
    assert scripts and all((REPO / script).exists() for script in scripts), scripts


@pytest.mark.parametrize("words", documented_launches())
def test_documented_launch_parses(words):
    from mmrecipes.config import parse_args

    recipe_at = next(index for index, word in enumerate(words) if word.endswith(".py"))
    launcher, recipe, recipe_argv = words[:recipe_at], REPO / words[recipe_at], words[recipe_at + 1:]
    if not recipe.exists():  # a recipe copied out of the repo (docs/data.md) is launched by its bare name
        recipe = REPO / "recipes" / recipe.name
    assert recipe.exists(), recipe
    if "--config_file" in launcher:
        config = REPO / launcher[launcher.index("--config_file") + 1]
        assert config.exists() or config.name.startswith("my_"), f"{config} does not exist"
    try:
        parse_args(recipe_arguments(recipe), [str(REPO / word) if word.endswith(".yaml") else word
                                             for word in recipe_argv])
    except SystemExit as error:  # argparse's way of refusing a flag
        pytest.fail(f"{recipe.name} refuses {shlex.join(recipe_argv)} (exit {error.code})")


def test_a_stale_flag_fails_the_check():
    from mmrecipes.config import parse_args

    with pytest.raises((SystemExit, ValueError)):
        parse_args(recipe_arguments(REPO / "recipes/clip_pretrain.py"), ["--zeroshot_templatez", "a {}."])
