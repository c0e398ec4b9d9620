"""The package outside this checkout: a wheel carries what the defaults need, and a recipe copied
into a user's own directory runs there with no arguments (how people fork a recipe)."""

import shutil
import subprocess
import sys

import pytest
from transformers import CLIPModel

from launch import REPO, losses, run_command, run_env

pytestmark = pytest.mark.launch


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory):
    """The wheel `pip wheel .` builds, installed into an empty target directory (not editable)."""
    root = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools builds in the source tree, and a stale build/ would leak into the wheel.
    shutil.copytree(REPO, root / "source", ignore=shutil.ignore_patterns(
        ".git", ".venv", ".whl", ".gl", "build", "dist", "outputs", "runs", "*.egg-info", "__pycache__",
        ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(root / "source"), "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(root / "dist")], check=True, cwd=root)
    (wheel,) = (root / "dist").glob("mmrecipes-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(root / "site"),
                    str(wheel)], check=True, cwd=root)
    return root / "site"


def run_copied(recipe: str, project, site, *args):
    """Copy `recipes/<recipe>` into `project` and run it there, importing mmrecipes from `site` only."""
    project.mkdir()
    shutil.copy(REPO / "recipes" / recipe, project)
    env = run_env({"PYTHONPATH": str(site)})
    where = subprocess.run([sys.executable, "-c", "import mmrecipes.paths as m; print(m.__file__); print(m.EMBEDDED)"],
                           cwd=project, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(path.startswith(str(site)) for path in where), where  # not this checkout
    return run_command([sys.executable, recipe, "--report_to", "none", *args], cwd=project, environment=env)


def test_clip_recipe_copied_out_of_the_checkout_trains_and_saves(installed_wheel, tmp_path):
    project = tmp_path / "my_project"
    result = run_copied("clip_pretrain.py", project, installed_wheel)
    assert result.returncode == 0, result.log[-3000:]
    assert losses(result.log)[300] < 0.5 * losses(result.log)[20]
    assert "eval_pairs 512" in result.log  # the embedded test split came from the wheel
    CLIPModel.from_pretrained(project / "outputs" / "clip_pretrain")


def test_vlm_recipe_copied_out_of_the_checkout_starts(installed_wheel, tmp_path):
    project = tmp_path / "my_vlm_project"
    result = run_copied("vlm_finetune.py", project, installed_wheel, "--max_steps", 2, "--eval_steps", 2)
    assert result.returncode == 0, result.log[-3000:]
    assert sorted(losses(result.log)) == [2] and "answer_accuracy" in result.log
    assert (project / "outputs" / "vlm_finetune" / "config.json").is_file()
