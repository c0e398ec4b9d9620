"""Each bench/ script starts and writes its JSON line at toy size (numbers are not checked: no
timing is asserted in CI). They run in two Python processes at once (tests/run_benches.py), each
running its half one after another: the imports they share cost more than their toy runs. Each half
runs on one thread (OMP_NUM_THREADS=1, inherited by the recipe runs it starts): two halves of two
threads each on 2 cores spent a third of their CPU time waiting for each other (95 s -> 81 s)."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch import REPO, run_command, run_env

pytestmark = pytest.mark.launch

# Dealt to the two processes in turn (0, 1, 0, ...), in an order that gives each about half: toy-size seconds on
# 2 cores, both halves at once (2026-11-27), 40 | 14, 19 | 14, 16 | 13, 11 | 11, <1 | 9, <1 | 1, <1 | <1, <1 | <1,
# 1 | 23, <1 (88 s and 85 s). sequence_parallel_memory's ranks are fresh processes: their imports are most of it.
# gpu_recipe_throughput's toy recipe runs take no DataLoader workers: their fork server's start is half of such a run.
BENCHES = [
    ("sequence_parallel_memory.py", ["--quick"]),
    ("gpu_recipe_throughput.py", ["--mode", "vlm", "--toy", "--torch_compile", "false", "--workers", "0"]),
    ("data_loading.py", ["--quick"]),
    ("recipe_throughput.py", ["--quick"]),
    ("vlm_dummy.py", ["--quick"]),
    ("grad_comm.py", ["--quick"]),
    ("resume_time.py", ["--quick", "--repeats", "1"]),
    ("gpu_recipe_throughput.py", ["--toy", "--torch_compile", "false", "--workers", "0"]),
    ("gpu_clip_throughput.py", ["--toy", "--steps", "2", "--warmup", "1", "--compile", "off"]),
    ("vlm_packing.py", ["--quick"]),
    ("contrastive_loss.py", ["--quick", "--repeats", "1"]),
    ("lora_memory.py", ["--quick"]),
    ("vlm_loss_memory.py", ["--quick"]),
    ("patch_dropout.py", ["--quick"]),
    ("answers_by_kind.py", ["--quick"]),
    ("grpo_sampling.py", ["--quick"]),
    ("label_alignment.py", ["--quick"]),
    ("video.py", ["--quick"]),
    ("vlm_loss_memory.py", ["--quick", "--loss", "jsd"]),
    ("benchmark_cost.py", ["--quick"]),
    ("linear_attention_packing.py", ["--quick"]),
    ("zoom_task.py", ["--quick"]),
]
HALVES = 2


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    """{index in BENCHES: the path its run_benches.py files start with}."""
    out_dir = tmp_path_factory.mktemp("benches")

    def run_half(half):
        command = [sys.executable, str(REPO / "tests" / "run_benches.py"), str(out_dir / str(half))]
        for script, args in BENCHES[half::HALVES]:
            command += [script, *args, "--"]
        (out_dir / str(half)).mkdir()
        return run_command(command, timeout=1800, cwd=out_dir, environment=run_env({"OMP_NUM_THREADS": "1"}))

    with ThreadPoolExecutor(HALVES) as pool:
        list(pool.map(run_half, range(HALVES)))
    return {index: out_dir / str(index % HALVES) / str(index // HALVES) for index in range(len(BENCHES))}


@pytest.mark.parametrize("index", range(len(BENCHES)), ids=[" ".join([s, *a[:2]]) for s, a in BENCHES])
def test_bench_script_runs_at_toy_size(bench_runs, index):
    script, _ = BENCHES[index]
    files = bench_runs[index]
    log = files.with_suffix(".log").read_text() if files.with_suffix(".log").exists() else "(no log)"
    assert files.with_suffix(".rc").read_text() == "0", log[-3000:]
    (record,) = [json.loads(line) for line in files.with_suffix(".jsonl").read_text().splitlines()]
    assert record["bench"] == script.removesuffix(".py") and record["quick"] is True
