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


def copied_into(project, site, *recipes) -> dict:
    """Copy `recipes/<recipe>`s into `project`; returns the environment that imports mmrecipes from `site` only."""
    project.mkdir()
    for recipe in recipes:
        shutil.copy(REPO / "recipes" / recipe, project)
    env = run_env({"PYTHONPATH": str(site)})
    where = subprocess.run([sys.executable, "-c", "import mmrecipes.paths as m; print(m.__file__); print(m.EMBEDDED)"],
                           cwd=project, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(path.startswith(str(site)) for path in where), where  # not this checkout
    return env


def run_copied(recipe: str, project, site, *args):
    """Copy `recipes/<recipe>` into `project` and run it there, importing mmrecipes from `site` only."""
    env = copied_into(project, site, recipe)
    return run_command([sys.executable, recipe, "--report_to", "none", *args], cwd=project, environment=env)


def test_clip_recipe_copied_out_of_the_checkout_trains_and_saves(installed_wheel, tmp_path):
    project = tmp_path / "my_project"
    result = run_copied("clip_pretrain.py", project, installed_wheel)
    assert result.returncode == 0, result.log[-3000:]
    assert losses(result.log)[300] < 0.5 * losses(result.log)[20]
    assert "eval_pairs 512" in result.log  # the embedded test split came from the wheel
    CLIPModel.from_pretrained(project / "outputs" / "clip_pretrain")
    # the WER task's British-to-American spellings travel in the wheel too (read beside the scorer's module)
    words = subprocess.run([sys.executable, "-c", "from mmrecipes.benchmarks.scoring import transcript_words; "
                            "print(transcript_words('The colour is grey', 'en'))"], cwd=project,
                           env=run_env({"PYTHONPATH": str(installed_wheel)}), capture_output=True, text=True,
                           check=True).stdout
    assert words.strip() == "['the', 'color', 'is', 'gray']"


# The VLM recipes in one Python process, one after the other: their imports are shared (about 15 s each). 16
# generated answers, not 256: the held-out set read is the wheel's all the same (distillation's two evaluations of
# both models generated 1,024 answers: 15 of its 17 s).
BOTH_VLM_RECIPES = """
import runpy, sys
for recipe in ("vlm_finetune.py", "vlm_dpo.py", "vlm_grpo.py", "vlm_distill.py"):
    fewer = [] if recipe == "vlm_dpo.py" else ["--eval_generation_rows", "16"]  # DPO generates none
    sys.argv = [recipe, "--report_to", "none", "--max_steps", "2", "--eval_steps", "2", *fewer]
    runpy.run_path(recipe, run_name="__main__")
    print("== finished", recipe, flush=True)
"""


def test_vlm_recipes_copied_out_of_the_checkout_start(installed_wheel, tmp_path):
    project = tmp_path / "my_vlm_project"
    env = copied_into(project, installed_wheel, "vlm_finetune.py", "vlm_dpo.py", "vlm_grpo.py", "vlm_distill.py")
    result = run_command([sys.executable, "-c", BOTH_VLM_RECIPES], cwd=project, environment=env)
    assert result.returncode == 0, result.log[-3000:]
    finetune, rest = result.log.split("== finished vlm_finetune.py")
    dpo, rest = rest.split("== finished vlm_dpo.py")
    grpo, distill = rest.split("== finished vlm_grpo.py")
    assert sorted(losses(finetune)) == [2] and "answer_accuracy" in finetune
    assert sorted(losses(dpo)) == [2] and "eval_pairs 256" in dpo  # the embedded preference pairs came from the wheel
    assert "step 2/2 | loss" in grpo and "eval_generated 16" in grpo  # and the SFT'd start model
    assert "step 2/2 | loss" in distill and "teacher_generated_accuracy" in distill  # and the teacher
    for output in ("vlm_finetune", "vlm_dpo", "vlm_grpo", "vlm_distill"):
        assert (project / "outputs" / output / "config.json").is_file()

