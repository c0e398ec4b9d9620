"""The recipe under every engine config, 2 CPU processes: the engine is real, and engines agree.

Each run starts the logit scale at 5.0 > ln(100), so the post-step clamp must hold on whatever
copy each engine updates (DeepSpeed's fp32 master included) for the saved value to be <= ln(100).
"""

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from PIL import Image
from transformers import CLIPModel, pipeline

from gloo import free_port
from launch import accelerate_launch, engine_line, losses

pytestmark = pytest.mark.launch

EXPECTED_ENGINE = {
    "ddp.yaml": "distributed_type=MULTI_CPU num_processes=2 backend=gloo world_size=2 model=DistributedDataParallel",
    "fsdp2.yaml": "distributed_type=FSDP num_processes=2 backend=gloo world_size=2 model=FSDPCLIPForContrastiveTraining",
    "zero2.yaml": "distributed_type=DEEPSPEED num_processes=2 backend=gloo world_size=2 model=DeepSpeedEngine",
    "zero3.yaml": "distributed_type=DEEPSPEED num_processes=2 backend=gloo world_size=2 model=DeepSpeedEngine",
}
STEPS = 6
RUN_ARGS = ["--max_steps", STEPS, "--logging_steps", 1, "--eval_steps", STEPS, "--per_device_train_batch_size", 16,
            "--gradient_accumulation_steps", 2, "--logit_scale_init_value", 5.0, "--save_steps", 3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for config in EXPECTED_ENGINE:
        output_dir = tmp_path_factory.mktemp(config.split(".")[0])
        result = accelerate_launch(config, *RUN_ARGS, "--output_dir", output_dir)
        results[config] = (result, output_dir)
    return results


@pytest.mark.parametrize("config", list(EXPECTED_ENGINE))
def test_engine_is_real_and_trains(runs, config):
    result, output_dir = runs[config]
    assert result.returncode == 0, result.log[-3000:]
    assert EXPECTED_ENGINE[config] in engine_line(result.log)  # a silent fallback fails here
    loss = losses(result.log)
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert loss[STEPS] < 0.8 * loss[2]  # step 1 still ran at the unclamped scale
    model = CLIPModel.from_pretrained(output_dir)
    assert model.logit_scale.shape == ()
    assert model.logit_scale.item() <= math.log(100) + 1e-6


@pytest.mark.parametrize("config", ["fsdp2.yaml", "zero2.yaml", "zero3.yaml"])
def test_engines_agree_with_ddp(runs, config):
    """Same seed, same data, same math: the loss curve and the saved weights match DDP's."""
    ddp_result, ddp_dir = runs["ddp.yaml"]
    result, output_dir = runs[config]
    assert ddp_result.returncode == 0 and result.returncode == 0
    ddp_loss, loss = losses(ddp_result.log), losses(result.log)
    for step in range(1, STEPS + 1):
        assert loss[step] == pytest.approx(ddp_loss[step], rel=1e-4), f"step {step}"
    reference = CLIPModel.from_pretrained(ddp_dir).state_dict()
    for name, tensor in CLIPModel.from_pretrained(output_dir).state_dict().items():
        if name.endswith("k_proj.bias"):
            # Its true gradient is 0 (softmax ignores a key bias); Adam turns the engines' different
            # rounding noise into +-lr steps, so these differ by ~1e-5 while everything else matches.
            continue
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("config", list(EXPECTED_ENGINE))
def test_resume_from_engine_checkpoint(runs, config, tmp_path):
    """save_state at step 3 (sharded under FSDP2/ZeRO), resume: steps 4-6 repeat the straight run."""
    straight, output_dir = runs[config]
    checkpoint = output_dir / "checkpoints" / "checkpoint-3"
    assert checkpoint.is_dir()
    resumed = accelerate_launch(config, *RUN_ARGS, "--output_dir", tmp_path, "--resume_from_checkpoint", checkpoint)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert sorted(losses(resumed.log)) == [4, 5, 6]
    for step in (4, 5, 6):
        assert losses(resumed.log)[step] == pytest.approx(losses(straight.log)[step], abs=1e-5), f"step {step}"


def test_output_dir_works_in_zero_shot_pipeline(runs):
    _, output_dir = runs["ddp.yaml"]
    classify = pipeline("zero-shot-image-classification", model=str(output_dir))
    scores = classify(Image.new("RGB", (64, 64), (200, 30, 30)), candidate_labels=["a large red square", "a small blue circle"])
    assert {s["label"] for s in scores} == {"a large red square", "a small blue circle"}
    assert sum(s["score"] for s in scores) == pytest.approx(1.0, abs=1e-4)


def test_multi_node_template_rendezvous(runs, tmp_path):
    """multi_node.yaml as two 'nodes' on this machine (one process each, loopback): same losses as DDP."""
    port = free_port()

    def node(rank):
        return accelerate_launch("multi_node.yaml", "--max_steps", 2, "--logging_steps", 1, "--eval_steps", 2,
                                 "--per_device_train_batch_size", 16, "--gradient_accumulation_steps", 2,
                                 "--logit_scale_init_value", 5.0, "--output_dir", tmp_path / f"node{rank}",
                                 launcher_args=["--num_machines", 2, "--machine_rank", rank,
                                                "--main_process_ip", "127.0.0.1"], port=port)

    with ThreadPoolExecutor(2) as pool:
        main_node, other_node = pool.map(node, [0, 1])
    assert main_node.returncode == 0 and other_node.returncode == 0, main_node.log[-2000:] + other_node.log[-2000:]
    assert EXPECTED_ENGINE["ddp.yaml"] in engine_line(main_node.log)
    ddp_loss = losses(runs["ddp.yaml"][0].log)
    assert losses(main_node.log) == pytest.approx({1: ddp_loss[1], 2: ddp_loss[2]}, rel=1e-4)
