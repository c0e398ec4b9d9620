"""Each bench/ script starts and writes its JSON line at toy size (numbers are not checked: no
timing is asserted in CI). All of them run in one Python process (tests/run_benches.py), one after
another: the imports they share cost more than their toy runs."""

import json
import sys

import pytest

from launch import REPO, run_command

pytestmark = pytest.mark.launch

BENCHES = [
    ("contrastive_loss.py", ["--quick", "--repeats", "1"]),
    ("grad_comm.py", ["--quick"]),
    ("recipe_throughput.py", ["--quick"]),
    ("data_loading.py", ["--quick"]),
    ("resume_time.py", ["--quick", "--repeats", "1"]),
    ("vlm_dummy.py", ["--quick"]),
    ("lora_memory.py", ["--quick"]),
    ("vlm_packing.py", ["--quick"]),
    ("vlm_loss_memory.py", ["--quick"]),
    ("gpu_clip_throughput.py", ["--toy", "--steps", "2", "--warmup", "1", "--compile", "off"]),
    ("gpu_recipe_throughput.py", ["--toy", "--torch_compile", "false"]),
    ("gpu_recipe_throughput.py", ["--mode", "vlm", "--toy", "--torch_compile", "false"]),
]


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("benches")
    command = [sys.executable, str(REPO / "tests" / "run_benches.py"), str(out_dir)]
    for script, args in BENCHES:
        command += [script, *args, "--"]
    run_command(command, timeout=1800, cwd=out_dir)
    return out_dir


@pytest.mark.parametrize("index", range(len(BENCHES)), ids=[" ".join([s, *a[:2]]) for s, a in BENCHES])
def test_bench_script_runs_at_toy_size(bench_runs, index):
    script, _ = BENCHES[index]
    log = (bench_runs / f"{index}.log").read_text() if (bench_runs / f"{index}.log").exists() else "(no log)"
    assert (bench_runs / f"{index}.rc").read_text() == "0", log[-3000:]
    (record,) = [json.loads(line) for line in (bench_runs / f"{index}.jsonl").read_text().splitlines()]
    assert record["bench"] == script.removesuffix(".py") and record["quick"] is True
