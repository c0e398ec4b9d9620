"""Run the recipes from tests: launched as a user does (`accelerate launch --config_file ... recipes/...`), on
ranks forked with the environment that launch gives them (`run_engine`), or in this process (`run_recipe`)."""

import atexit
import contextlib
import importlib.util
import io
import math
import multiprocessing
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

from gloo import become_rank, free_port, run_on_ranks, settle_forked_process, start_rank_server
from mmrecipes.loader import GROUP_SIGNALS
from mmrecipes.output_dir import release_held

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "clip_pretrain.py"
VLM_RECIPE = REPO / "recipes" / "vlm_finetune.py"
WITH_FAULTS = REPO / "tests" / "recipe_with_faults.py"  # the recipe with faults injected (see its docstring)
# Short, fast runs; a collective that waits longer than ddp_timeout fails the run instead of hanging.
# No DataLoader workers unless a test asks for them (their fork server costs seconds per rank on 2 cores).
QUICK = ["--report_to", "none", "--ddp_timeout", "120", "--per_device_eval_batch_size", "256",
         "--dataloader_num_workers", "0"]
# The embedded held-out conversations' first 64 rows (data/vlm_shapes/image_chat's test split), for VLM runs whose
# subject is not the held-out set: tokenising all 512 was most of a 2-step run's time.
HELD_OUT_64 = REPO / "tests" / "fixtures" / "held_out_64"


def accelerate_launch(config: str | Path, *recipe_args, num_processes=2, launcher_args=(), port=None,
                      timeout=600, recipe=RECIPE, env=None, cwd=REPO) -> subprocess.CompletedProcess:
    command = launch_command(config, *recipe_args, num_processes=num_processes, launcher_args=launcher_args,
                             port=port, recipe=recipe)
    return _run(command, timeout, run_env(env), cwd)


def launch_command(config: str | Path, *recipe_args, num_processes=2, launcher_args=(), port=None, recipe=RECIPE):
    config_file = str(REPO / "accelerate_configs" / config)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file, "--num_processes",
            str(num_processes), "--main_process_port", str(port or free_port()), *map(str, launcher_args),
            str(recipe), *QUICK, *map(str, recipe_args)]


def run_recipe(*recipe_args, recipe=RECIPE) -> SimpleNamespace:
    """One process, no launcher (what `accelerate launch` with no config does), run in this process: the
    recipe's `main`, its output captured, its signal handlers and sys.argv put back afterwards. `.returncode`
    is 0, the exit code it asked for, or 1 if it raised (the traceback is in `.log`)."""
    return _in_process(recipe, [*QUICK, *map(str, recipe_args)])


def run_script(script, *args, timeout=600, env=None) -> SimpleNamespace:
    """A recipe or a recipe wrapper (tests/recipe_with_faults.py, ...) run as a script in a process of its own,
    forked from the fork server (`run_engine`): for runs that need environment variables or a fresh process."""
    return _forked(script, [*QUICK, *map(str, args)], env, 1, timeout)


def run_engine(config: str, *recipe_args, num_processes=2, recipe=RECIPE, env=None, timeout=600) -> SimpleNamespace:
    """What `accelerate launch --config_file accelerate_configs/<config>` runs, on ranks forked from the fork
    server that the DataLoader workers use (mmrecipes.loader; it imported torch, transformers and datasets
    once per session): each rank gets the variables accelerate's launcher computes from the config
    (`launched_env`) and those torchrun adds, so the engine, its `[engine]` line and the losses are the
    launched ones, without the 10-15 s of start-up a launch costs on 2 cores. For tests whose subject is a
    feature; the launcher's own behaviour is tested through `accelerate_launch`. As under torchrun, the
    first rank that fails ends the others. `.log`: rank 0's output, then the other ranks'."""
    environment = {**launched_env(config, num_processes), **(env or {})}
    return _forked(recipe, [*QUICK, *map(str, recipe_args)], environment, num_processes, timeout)


def launched_env(config: str, num_processes: int) -> dict:
    """The variables `accelerate launch` sets for every rank of this config, from the launcher's own code."""
    arguments = launch_command_parser().parse_args(
        ["--config_file", str(REPO / "accelerate_configs" / config), "--num_processes", str(num_processes), "x.py"])
    arguments, defaults, precision_from_config = _validate_launch_command(arguments)
    if arguments.use_deepspeed:
        fields = [*defaults.deepspeed_config, *(["mixed_precision"] if precision_from_config else [])]
        arguments.deepspeed_fields_from_accelerate_config = ",".join(fields)
        environment = prepare_deepspeed_cmd_env(arguments)[1]
    else:
        environment = prepare_multi_gpu_env(arguments)
    return {name: value for name, value in environment.items() if os.environ.get(name) != value}


def _in_process(recipe, argv) -> SimpleNamespace:
    log, returncode = io.StringIO(), 0
    saved_argv, saved_handlers = sys.argv, {sig: signal.getsignal(sig) for sig in GROUP_SIGNALS}
    sys.argv = [str(recipe), *argv]  # what the model card records as the command
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                load_recipe(recipe).main(argv)
            except SystemExit as stop:
                returncode = exit_code(stop)
            except Exception:
                traceback.print_exc()
                returncode = 1
    finally:
        release_held()  # what the end of the process does: its output_dir lock goes, however the run ended
        sys.argv = saved_argv
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)
    return SimpleNamespace(returncode=returncode, log=log.getvalue().replace("\r", "\n"))


def _forked(script, argv, env, world_size, timeout) -> SimpleNamespace:
    start_rank_server()
    port = free_port()
    with tempfile.TemporaryDirectory() as log_dir:
        ranks = [multiprocessing.get_context("forkserver").Process(
            target=_forked_rank, args=(rank, world_size, port, str(script), argv, env or {}, log_dir))
            for rank in range(world_size)]
        for rank in ranks:
            rank.start()
        deadline, returncode = time.monotonic() + timeout, 0
        while any(rank.is_alive() for rank in ranks):
            failed = [rank.exitcode for rank in ranks if rank.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                returncode = failed[0] if failed else 124
                for rank in ranks:
                    rank.kill()
            time.sleep(0.1)
        returncode = returncode or next((rank.exitcode for rank in ranks if rank.exitcode), 0)
        log = "".join(path.read_text(errors="replace") for rank in range(world_size)
                      if (path := Path(log_dir, f"{rank}.log")).exists())
    return SimpleNamespace(returncode=returncode, log=log.replace("\r", "\n"))


def _forked_rank(rank, world_size, port, recipe, argv, env, log_dir):
    os.environ.update(run_env(env))
    if world_size > 1:
        become_rank(rank, world_size, port)
    else:  # a process of its own: no distributed environment, the default threads
        settle_forked_process()
    log = os.open(Path(log_dir, f"{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv, returncode = [recipe, *argv], 0
    try:
        runpy.run_path(recipe, run_name="__main__")  # a recipe, or a wrapper such as tests/recipe_with_faults.py
    except SystemExit as stop:
        returncode = exit_code(stop)
    except BaseException:
        traceback.print_exc()
        returncode = 1
    atexit._run_exitfuncs()  # what the end of a process runs (the output_dir lock, a wrapper's report)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(returncode)


def exit_code(stop: SystemExit) -> int:
    return 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1


def run_recipe_on_ranks(fn, world_size, *args):
    """`fn(rank, world_size, *args)` on W gloo processes (tests/gloo.py) where `fn` runs a recipe's `main`."""
    return _on_ranks(fn, world_size, *args)


_on_ranks = run_on_ranks


def run_command(command, timeout=600, environment=None, cwd=REPO) -> subprocess.CompletedProcess:
    """Any other command that starts a recipe (a copied recipe, a Slurm script, the benches); `environment`:
    the whole environment (default `run_env()`)."""
    return _run([str(part) for part in command], timeout, environment or run_env(), cwd)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (the launcher's ranks, their fork servers and DataLoader workers)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, stack = [], [pid]
    while stack:
        tree.append(stack.pop())
        stack += children.get(tree[-1], [])
    return tree


def run_env(extra=None) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(extra or {})}


def _run(command, timeout, environment, cwd=REPO):
    result = subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)
    result.log = (result.stdout + result.stderr).replace("\r", "\n")
    return result


# What each engine config's `[engine]` line says on 2 CPU processes (`wrapped`: the model class the
# recipe prepares, which FSDP2 prefixes): a silent fallback to another engine fails the match.
ENGINES = {
    "ddp.yaml": "distributed_type=MULTI_CPU num_processes=2 backend=gloo world_size=2 model=DistributedDataParallel",
    "fsdp2.yaml": "distributed_type=FSDP num_processes=2 backend=gloo world_size=2 model=FSDP{wrapped}",
    "zero2.yaml": "distributed_type=DEEPSPEED num_processes=2 backend=gloo world_size=2 model=DeepSpeedEngine",
    "zero3.yaml": "distributed_type=DEEPSPEED num_processes=2 backend=gloo world_size=2 model=DeepSpeedEngine",
}


def assert_engine(log: str, config: str, wrapped: str = "CLIPForContrastiveTraining"):
    assert ENGINES[config].format(wrapped=wrapped) in engine_line(log), engine_line(log)


def assert_same_curves(log: str, reference: str, steps=None, *, rel=1e-4, abs=None, grad_norm=False):
    """The loss (and gradient norm) of every step both logged is the same in `log` as in `reference`; `steps`
    says which steps `log` must have logged (default: all that `reference` logged)."""
    got, expected = losses(log), losses(reference)
    assert sorted(got) == sorted(steps if steps is not None else expected), (sorted(got), log[-2000:])
    got_norms, expected_norms = grad_norms(log), grad_norms(reference)
    assert set(got) & set(expected), "no step logged by both"
    for step in set(got) & set(expected):
        assert got[step] == pytest.approx(expected[step], rel=rel, abs=abs), f"loss, step {step}"
        if grad_norm:
            assert got_norms[step] == pytest.approx(expected_norms[step], rel=rel, abs=abs), (
                f"grad norm, step {step}: {got_norms[step]} against {expected_norms[step]}")


# what two runs of the same steps may differ in
TIMED = ("samples/s", "tokens/s", "MFU", "data_wait", "generation_share")


def assert_resume_repeats(resumed: str, straight: str, steps):
    """Every number the resumed run logged at `steps` (step and eval lines) is the straight run's, to the last printed
    digit, but for the timings (`TIMED`): a resume is exact on CPU, where a tolerance would hide a state it lost."""
    def lines(log):
        found = {}
        for line in log.splitlines():
            if match := re.match(r"^(eval )?step (\d+)(?:/\d+)? \| ", line):
                fields = [field for field in line.split(" | ")[1:] if field.split(" ")[0] not in TIMED]
                found[(bool(match[1]), int(match[2]))] = fields
        return found

    got, expected = lines(resumed), lines(straight)
    assert sorted(step for evaluation, step in got if not evaluation) == list(steps), sorted(got)
    for key, fields in got.items():
        assert fields == expected[key], (key, fields, expected[key])


def adam_step_bound(steps: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The most one AdamW step moves a weight, in learning rates, over the first `steps` steps: |m_hat / sqrt(v_hat)|
    at step t is at most (1 - beta1) / (1 - beta1^t) * sqrt((1 - beta2^t) / (1 - beta2)) * sqrt(sum_k<t (beta1^2 /
    beta2)^k) (Cauchy-Schwarz on the moments' sums): 1 at step 1, 1.10 by step 16 with torch's betas."""
    return max((1 - beta1) / (1 - beta1 ** t) * math.sqrt((1 - beta2 ** t) / (1 - beta2))
               * math.sqrt(sum((beta1 ** 2 / beta2) ** k for k in range(t))) for t in range(1, steps + 1))


def assert_adam_weights_close(got: dict, expected: dict, *, learning_rate: float, steps: int, rtol: float = 1e-4,
                              atol: float = 1e-6):
    """Weights after `steps` AdamW steps at learning rates up to `learning_rate`, from two runs that summed the same
    gradients in another order (two engines, or one engine on two CPUs: AVX2 and AVX-512 kernels round otherwise).
    What the engines promise, the losses and gradient norms, the tests compare at float32's tolerance; here, where an
    element's gradient is within float32 rounding of zero (a key bias, an embedding row a step barely reaches), AdamW
    divides the rounding by its own size and steps up to the learning rate either way. So every element is within the
    two runs' largest parting, 2 x steps x learning_rate x `adam_step_bound`, and all but one in a thousand (the runs
    show one in 65,536) within rtol/atol of the other run: a weight the engine did not train or save would fail
    both."""
    bound = 2 * steps * learning_rate * adam_step_bound(steps) + atol
    loose = elements = 0
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
    for name, tensor in got.items():
        # equal infinities (Gemma 4's audio clipping bounds, unset) are equal
        difference = (tensor.float() - expected[name].float()).abs().masked_fill(tensor == expected[name], 0)
        assert difference.max() <= bound, (name, float(difference.max()), bound)
        loose += int((difference > atol + rtol * expected[name].float().abs()).sum())
        elements += tensor.numel()
    assert loose <= 1 + elements // 1000, f"{loose} of {elements} values beyond rtol {rtol}, atol {atol}"


def losses(log: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+)/\d+ \| loss (-?[\d.]+)", log, re.M)}


def grad_norms(log: str) -> dict[int, float]:
    pairs = re.findall(r"^step (\d+)/\d+ \|.*\| grad_norm ([\d.]+)", log, re.M)
    return {int(step): float(norm) for step, norm in pairs}


def metric(log: str, name: str, nan: bool = False) -> dict[int, float]:
    """{step: value} of a log line's `name` (`nan`: its nan values too; else a step logging nan is left out)."""
    value = r"(-?[\d.e+-]+|nan)" if nan else r"(-?[\d.e+-]+)"
    pattern = rf"^step (\d+)/\d+ \|(?:.*\|)? {re.escape(name)} {value}"
    return {int(step): float(number) for step, number in re.findall(pattern, log, re.M)}


def engine_line(log: str) -> str:
    return re.search(r"^\[engine\] .*$", log, re.M).group(0)


def load_recipe(recipe=RECIPE):
    spec = importlib.util.spec_from_file_location(recipe.stem, recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
