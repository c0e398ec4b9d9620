"""Each bench/ script starts and writes its JSON line at toy size (numbers are not checked: no
timing is asserted in CI). They run in three Python processes at once (tests/run_benches.py), each
running its share one after another: the imports they share cost more than their toy runs. Each
process runs on one thread (OMP_NUM_THREADS=1, inherited by the recipe runs it starts): two halves of
two threads each on 2 cores spent a third of their CPU time waiting for each other (95 s -> 81 s), and
two halves of one thread left a quarter of the 2 cores idle (their launches' start-up: 197 CPU seconds
in 131 s), which a third process fills."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch import REPO, run_command, run_env

pytestmark = pytest.mark.launch

# Each process's scripts, in the order it runs them, about a third of the toy-size seconds each. Measured with the three
# processes side by side on 2 cores and nothing else running (2026-12-02, 110 s in all, 188 CPU seconds), the first of
# a process with its imports: vlm_dummy 37, data_loading 44 (a fresh recipe process with a DataLoader worker),
# resume_time 20; sequence_parallel_memory 34 (its ranks are fresh processes), recipe_throughput 28, video 29,
# vlm_packing 16; gpu_recipe_throughput --mode vlm 39, grad_comm 29, gpu_recipe_throughput 15 (their toy recipe runs
# take no DataLoader workers: their fork server's start was half of such a run), zoom_task 6; every other under 3 s.
PROCESSES = [
    [("vlm_dummy.py", ["--quick"]),
     ("data_loading.py", ["--quick"]),
     ("resume_time.py", ["--quick", "--repeats", "1"]),
     ("gpu_clip_throughput.py", ["--toy", "--steps", "2", "--warmup", "1", "--compile", "off"]),
     ("contrastive_loss.py", ["--quick", "--repeats", "1"]),
     ("vlm_loss_memory.py", ["--quick"]),
     ("patch_dropout.py", ["--quick"])],
    [("sequence_parallel_memory.py", ["--quick"]),
     ("recipe_throughput.py", ["--quick"]),
     ("video.py", ["--quick"]),
     ("vlm_packing.py", ["--quick"])],
    [("gpu_recipe_throughput.py", ["--mode", "vlm", "--toy", "--torch_compile", "false", "--workers", "0"]),
     ("grad_comm.py", ["--quick"]),
     ("gpu_recipe_throughput.py", ["--toy", "--torch_compile", "false", "--workers", "0"]),
     ("lora_memory.py", ["--quick"]),
     ("answers_by_kind.py", ["--quick"]),
     ("grpo_sampling.py", ["--quick"]),
     ("label_alignment.py", ["--quick"]),
     ("vlm_loss_memory.py", ["--quick", "--loss", "jsd"]),
     ("benchmark_cost.py", ["--quick"]),
     ("linear_attention_packing.py", ["--quick"]),
     ("zoom_task.py", ["--quick"]),
     ("reasoning_modes.py", ["--quick"])],
]
BENCHES = [(process, position, script, args) for process, scripts in enumerate(PROCESSES)
           for position, (script, args) in enumerate(scripts)]


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    """The folder each process's run_benches.py files go to."""
    out_dir = tmp_path_factory.mktemp("benches")

    def run_process(process):
        command = [sys.executable, str(REPO / "tests" / "run_benches.py"), str(out_dir / str(process))]
        for script, args in PROCESSES[process]:
            command += [script, *args, "--"]
        (out_dir / str(process)).mkdir()
        return run_command(command, timeout=1800, cwd=out_dir, environment=run_env({"OMP_NUM_THREADS": "1"}))

    with ThreadPoolExecutor(len(PROCESSES)) as pool:
        list(pool.map(run_process, range(len(PROCESSES))))
    return out_dir


@pytest.mark.parametrize("process, position, script, args", BENCHES,
                         ids=[" ".join([script, *args[:2]]) for _, _, script, args in BENCHES])
def test_bench_script_runs_at_toy_size(bench_runs, process, position, script, args):
    files = bench_runs / str(process) / str(position)
    log = files.with_suffix(".log").read_text() if files.with_suffix(".log").exists() else "(no log)"
    assert files.with_suffix(".rc").read_text() == "0", log[-3000:]
    (record,) = [json.loads(line) for line in files.with_suffix(".jsonl").read_text().splitlines()]
    assert record["bench"] == script.removesuffix(".py") and record["quick"] is True
