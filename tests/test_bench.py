"""Each bench/ script starts and writes its JSON line at toy size (numbers are not checked: no
timing is asserted in CI)."""

import json
import subprocess
import sys

import pytest

from launch import REPO, run_env

pytestmark = pytest.mark.launch


@pytest.mark.parametrize("script, args", [
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
])
def test_bench_script_runs_at_toy_size(script, args, tmp_path):
    results = tmp_path / "results.jsonl"
    run = subprocess.run([sys.executable, str(REPO / "bench" / script), *args, "--results", str(results)],
                         cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["bench"] == script.removesuffix(".py") and record["quick"] is True
