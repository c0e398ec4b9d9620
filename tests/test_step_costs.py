"""What would stall a GPU, checked on CPU: host reads in the training step (each a device
synchronisation on a GPU) and torch.compile recompiling after warm-up. tests/recipe_counting_steps.py
records both per optimizer step; each run is one process of a recipe."""

import json

import pytest
import torch

import recipe_counting_steps
from launch import RECIPE, REPO, VLM_RECIPE, run_script
from mmrecipes.contrastive.arguments import ModelArgs
from mmrecipes.contrastive.models import build_contrastive, text_attention_mask

COUNTING = REPO / "tests" / "recipe_counting_steps.py"


def step_counts(tmp_path, *recipe_args, reads: bool, backend: str = "", recipe=RECIPE) -> list[dict]:
    counts = tmp_path / "counts.json"
    result = run_script(COUNTING, *recipe_args, "--output_dir", tmp_path / "run",
                        env={"STEP_COUNTS": str(counts), "STEP_COUNTS_READS": "1" if reads else "0",
                             "STEP_COUNTS_BACKEND": backend, "STEP_COUNTS_RECIPE": str(recipe)})
    assert result.returncode == 0, result.log[-3000:]
    return json.loads(counts.read_text())


def test_transformers_2d_text_mask_reads_the_host_and_ours_does_not():
    """The old failure: from a 2D padding mask, transformers' mask creation reads `mask.all()` (twice
    with padding) in every text forward; the 4D mask the training forward builds is used as given."""
    model = build_contrastive(ModelArgs())[0]
    input_ids = torch.randint(5, 90, (4, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    reads = []
    for mask in (attention_mask, text_attention_mask(model, attention_mask, causal=True)):
        before = recipe_counting_steps.host_reads
        with recipe_counting_steps.CountHostReads():
            features = model.get_text_features(input_ids=input_ids, attention_mask=mask).pooler_output
        reads.append(recipe_counting_steps.host_reads - before)
        torch.testing.assert_close(features, model.get_text_features(input_ids=input_ids,
                                                                    attention_mask=attention_mask).pooler_output)
    assert reads == [2, 0]


@pytest.mark.launch
def test_clip_step_reads_only_the_previous_steps_verdict(tmp_path):
    """With collation in a worker and fused AdamW (the GPU path), a step that neither logs nor
    evaluates reads exactly one value on the host: the StepGuard verdict of the step before, copied
    to the host a whole step earlier (never waited for). Logging steps read their metrics."""
    steps = step_counts(tmp_path, "--max_steps", 12, "--logging_steps", 5, "--eval_steps", 100,
                        "--dataloader_num_workers", 1, "--fused_adamw", "true", reads=True)
    assert [entry["step"] for entry in steps] == list(range(1, 13))
    reads = {entry["step"]: entry["host_reads"] - previous["host_reads"] for previous, entry in zip(steps, steps[1:])}
    quiet = {step: count for step, count in reads.items() if (step - 1) % 5 and step > 2}
    assert len(quiet) == 8 and set(quiet.values()) == {1}, reads


@pytest.mark.launch
def test_vlm_step_reads_the_verdict_and_only_transformers_reads_more(tmp_path):
    """The VLM loop itself reads only the previous step's verdict (the collator counts the target
    tokens, on the host). transformers still reads in every forward of the tiny Llava: its image
    placeholder check (image tokens against the features' size) and its causal-mask check (is
    anything padded?), two reads each; a text-only micro-batch skips the first."""
    steps = step_counts(tmp_path, "--max_steps", 12, "--logging_steps", 5, "--eval_dataset_name", "",
                        "--dataloader_num_workers", 1, "--fused_adamw", "true", reads=True, recipe=VLM_RECIPE)
    quiet = [(entry, previous) for previous, entry in zip(steps, steps[1:])
             if (entry["step"] - 1) % 5 and entry["step"] > 2]
    ours = {entry["step"]: (entry["host_reads"] - entry["transformers_reads"])
            - (previous["host_reads"] - previous["transformers_reads"]) for entry, previous in quiet}
    theirs = {entry["step"]: entry["transformers_reads"] - previous["transformers_reads"] for entry, previous in quiet}
    assert len(ours) == 8 and set(ours.values()) == {1}, ours
    assert set(theirs.values()) <= {2, 4}, theirs


@pytest.mark.launch
def test_clip_compiles_nothing_after_warm_up(tmp_path):
    """--torch_compile on captions of every length the embedded data has, across an epoch end (a
    short last batch at step 16) and evaluations after steps 10 and 15 (retrieval and zero-shot: no
    grad, other batch sizes): every graph is compiled in the first steps and at the first
    evaluation (after step 5), none afterwards. The aot_eager backend: the guards every device
    shares (dynamo's, AOTAutograd's), without inductor's CPU code generator's own."""
    steps = step_counts(tmp_path, "--max_steps", 20, "--per_device_train_batch_size", 256, "--logging_steps", 5,
                        "--eval_steps", 5, "--torch_compile", "true", reads=False, backend="aot_eager")
    graphs = {entry["step"]: entry["graphs"] for entry in steps}
    assert graphs[1] > 0  # it compiled
    assert len(set(graphs[step] for step in range(6, 21))) == 1, graphs


@pytest.mark.launch
def test_vlm_compiles_nothing_after_warm_up(tmp_path):
    """The same for vlm_finetune.py: conversations of every length, with and without images, and
    answer evaluations (teacher-forced and generated) after steps 20 and 30 compile nothing after the first
    evaluation (step 10)."""
    steps = step_counts(tmp_path, "--max_steps", 30, "--logging_steps", 10, "--eval_steps", 10,
                        "--torch_compile", "true", "--eval_generation_rows", 16, reads=False, backend="aot_eager",
                        recipe=VLM_RECIPE)
    graphs = {entry["step"]: entry["graphs"] for entry in steps}
    assert graphs[1] > 0
    assert len(set(graphs[step] for step in range(11, 31))) == 1, graphs
