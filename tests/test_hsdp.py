"""accelerate_configs/hsdp.yaml (FSDP2 on a dp_replicate x dp_shard mesh) on 4 CPU processes: the
[engine] line names the 2 x 2 mesh, and both recipes give the losses of DDP on 4 processes (the VLM recipe on a
mixture of experts, with its load-balancing loss: the mesh is the same for every family, and the tiny Llava's
FSDP2 runs are test_vlm_engines.py's), which they only do if each of the 4 data ranks reads its own rows
(r_replicate * 2 + r_shard). The ranks are forked with the environment `accelerate launch` computes from hsdp.yaml
(its parallelism_config included)."""

import pytest

from launch import RECIPE, VLM_RECIPE, assert_same_curves, engine_line, run_engine
from test_moe_engines import aux_losses

pytestmark = pytest.mark.launch

VLM = ["--max_steps", 4, "--logging_steps", 1, "--per_device_train_batch_size", 2, "--eval_dataset_name", ""]
RUNS = {"clip": (RECIPE, ["--max_steps", 4, "--logging_steps", 1, "--per_device_train_batch_size", 8,
                          "--eval_split", ""]),
        # a mixture of experts (the tiny Qwen3-VL-MoE), its decoder layers sharded with their experts, balanced over
        # the optimizer step on all 4 ranks
        "vlm_moe": (VLM_RECIPE, [*VLM, "--router_aux_loss_coef", 0.01, "--router_aux_loss_scope", "global_batch"])}


@pytest.mark.parametrize("run", list(RUNS))
def test_hsdp_names_its_mesh_and_gives_ddps_losses(run, tmp_path, tiny_vlms):
    recipe, flags = RUNS[run]
    if run == "vlm_moe":
        flags = [*flags, "--model_name_or_path", tiny_vlms["qwen3_vl_moe"]]
    hsdp = run_engine("hsdp.yaml", *flags, "--output_dir", tmp_path / "hsdp", num_processes=4, recipe=recipe)
    ddp = run_engine("ddp.yaml", *flags, "--output_dir", tmp_path / "ddp", num_processes=4, recipe=recipe)
    assert hsdp.returncode == 0, hsdp.log[-3000:]
    assert ddp.returncode == 0, ddp.log[-3000:]
    assert "distributed_type=FSDP num_processes=4 backend=gloo world_size=4 mesh=dp_replicate:2,dp_shard:2" in (
        engine_line(hsdp.log))
    assert "mesh=" not in engine_line(ddp.log)
    assert_same_curves(hsdp.log, ddp.log, [1, 2, 3, 4], grad_norm=recipe == VLM_RECIPE)
    if run == "vlm_moe":
        assert hsdp.log.count("| aux_loss ") == 4
        assert aux_losses(hsdp.log) == pytest.approx(aux_losses(ddp.log), rel=1e-5)
