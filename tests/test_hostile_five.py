"""Hostile inputs, round five, in process: files that are not chat templates and templates without a generation
prompt, empty prompt files, teacher folders that are not image-text-to-text models. Each case failed raw or trained
silently before (the tests name what it did)."""

import json
import re
import time

import pytest
import torch

from helpers import ended_by_the_watchdog
from launch import REPO, load_recipe, run_engine
from mmrecipes.vlm.algorithms.rewards import RewardScorer, load_reward_funcs
from mmrecipes.vlm.rows.labels import TemplateError

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


def test_a_reward_that_swallows_every_exception_is_timed_out_and_counted(capsys):
    """`while True: try: sleep(1) except Exception: pass`: SIGALRM's TimeoutError was caught by the user's own
    except, and the step (and a SIGTERM waiting for it) never ended. The timeout is no Exception now."""
    started = time.monotonic()
    scorer = RewardScorer(load_reward_funcs(["rewards_for_tests:retries"], ""), [1.0], timeout=0.5)
    scores = scorer(["q"], ["a"], [[1]], {})
    said = []
    assert scorer.take_failures(say=said.append) == {"rewards_for_tests:retries": 1} and torch.isnan(scores).all()
    assert said == ["reward function rewards_for_tests:retries failed on rank 0: RewardTimeout: reward function "
                    "rewards_for_tests:retries ran past --reward_timeout 0.5 s"]
    assert time.monotonic() - started < 5


def test_a_reward_that_swallows_even_the_timeout_ends_the_process_naming_itself():
    """A bare `except:` catches any exception the timer raises: the process ends STUCK_S past the timeout, and says
    which function was stuck (it waited forever, naming nothing)."""
    stderr = ended_by_the_watchdog([
        "from mmrecipes.vlm.algorithms import rewards",
        "scorer = rewards.RewardScorer(rewards.load_reward_funcs(['rewards_for_tests:swallows_everything'], ''), "
        "[1.0], timeout=0.5)",
        "scorer(['q'], ['a'], [[1]], {})"])
    assert re.search(r"reward function rewards_for_tests:swallows_everything ran \d s past --reward_timeout 0.5 s, "
                     "catching every timeout raised in it: ending the process", stderr), stderr


def test_a_reward_module_whose_import_blocks_is_named_within_the_timeout(tmp_path, monkeypatch):
    """The log stayed empty (the import ran before any print; --reward_timeout covered calls only)."""
    (tmp_path / "blocking_reward.py").write_text("import time\ntime.sleep(120)\n\ndef score(completions, **kw):\n"
                                                 "    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"importing blocking_reward \(--reward_funcs blocking_reward:score\) ran "
                                         r"past --reward_timeout 1 s: its module blocks while it is imported"):
        run_main("vlm_grpo.py", "--reward_funcs", "blocking_reward:score", "--reward_timeout", 1, tmp_path=tmp_path)
    assert time.monotonic() - started < 10


@pytest.mark.launch
def test_a_reward_failing_on_another_rank_is_named_in_the_main_log_with_its_rank(tmp_path):
    """Rank 1's failures were counted (`failed 8`) and never said: `take_failures` printed on the main process
    only, its own failures."""
    result = run_engine("ddp.yaml", "--reward_funcs", "accuracy,rewards_for_tests:fails_off_rank_0", "--max_steps", 2,
                        "--logging_steps", 1, "--per_device_train_batch_size", 8, "--num_generations", 4,
                        "--eval_dataset_name", "", "--output_dir", tmp_path, recipe=RECIPES / "vlm_grpo.py",
                        env={"PYTHONPATH": str(REPO / "tests")})
    assert result.returncode == 0, result.log[-3000:]
    said = "reward function rewards_for_tests:fails_off_rank_0 failed on rank 1: RuntimeError: the judge is down"
    assert result.log.count(said) == 1, result.log[-3000:]  # each failure once, from the main process
    assert "failed on rank 0" not in result.log


def test_a_resume_with_another_schedule_says_so(tmp_path, capsys):
    """GRPO, 4 steps with a checkpoint at 2, resumed to 6: step 6's gradient norm was not the straight 6-step run's,
    silently (its first steps had followed a 4-step cosine schedule). A resume repeats a straight run exactly only
    under the same schedule (test_grpo_engines.py, test_distill_recipe.py); under another it says so."""
    flags = ["--save_steps", 2, "--logging_steps", 1, "--eval_dataset_name", "", "--dataloader_num_workers", 0,
             "--per_device_train_batch_size", 8, "--num_generations", 4]
    recipe = load_recipe(RECIPES / "vlm_grpo.py")
    common = [*map(str, flags), "--report_to", "none", "--output_dir", str(tmp_path / "run")]
    recipe.main([*common, "--max_steps", "4"])
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-2"
    capsys.readouterr()
    recipe.main([*common, "--max_steps", "6", "--resume_from_checkpoint", str(checkpoint)])
    assert (f"resumed with --max_steps 6 where {checkpoint} was saved with --max_steps 4: the learning rate of the "
            "steps after 2 follows this run's schedule") in capsys.readouterr().out
    recipe.main([*common, "--max_steps", "4", "--resume_from_checkpoint", str(checkpoint)])
    assert "resumed with" not in capsys.readouterr().out.replace("resumed from", "")
