"""vlm_finetune.py on each tiny family checkpoint (conftest.py), as a user launches it: 2 CPU processes at per-device
batch size 1 on the default mixture, so text-only and image micro-batches meet on different ranks; no
find_unused_parameters anywhere. Qwen2.5-VL (clips in the tower's image call) and LLaVA-OneVision (a video path of
its own) train on the embedded video conversations too (video, image and text-only micro-batches meet), under DDP
and a sharded engine against it (Qwen2.5-VL: FSDP2; LLaVA-OneVision: ZeRO-3); Qwen3.5 (linear attention) under FSDP2
against DDP too; Gemma 4 E2B (per-layer embeddings, KV sharing, an audio tower) on a mixture with the embedded audio
questions, and the Qwen2.5-Omni thinker on it too (both under every engine against one process:
test_vlm_engines.py), a full Qwen2.5-Omni checkpoint trained as its thinker; Qwen2.5-VL also on LLaVA(-Video) JSON
with two-image and video rows under DDP and ZeRO-3 against it; SmolVLM runs that JSON under DDP and counts its video
rows (no video processor; its LoRA runs under ZeRO-3 in test_vlm_engines.py)."""

import json
import re

import datasets
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline

import tiny_vlm_2026
from launch import (
    HELD_OUT_64,
    REPO,
    VLM_RECIPE,
    assert_adam_weights_close,
    assert_engine,
    assert_same_curves,
    losses,
    run_engine,
    run_recipe,
)
from mmrecipes.audio import decode_audio
from mmrecipes.paths import VLM_SHAPES
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.module_groups import module_groups
from test_audio_rows import tone, wav_bytes
from tiny_vlm import save_family

pytestmark = pytest.mark.launch

# Llava: test_vlm_recipe.py; Qwen3-VL-MoE: test_moe_engines.py, test_hsdp.py
FAMILIES = ["qwen2_5_vl", "qwen3_vl", "idefics3", "gemma3", "llava_onevision", "qwen3_5", "gemma4", "qwen2_5_omni",
            "qwen3_omni_moe"]
MATRIX = "qwen2_5_vl"
VIDEO_FAMILIES = [MATRIX, "llava_onevision"]  # one of each video path that launches (test_video_training.py)
SHARDED = [(MATRIX, "fsdp2.yaml"), ("llava_onevision", "zero3.yaml"), ("qwen3_5", "fsdp2.yaml")]
TRAIN_MODULES = {"idefics3": "all"}  # the others: projector,language_model (the default)
# Qwen3.5-2B's template renders no think block unless asked: its own default said again, through the flag, tracked
# by TensorBoard (whose hparams take no mapping)
TEMPLATE_KWARGS = {"qwen3_5": ["--chat_template_kwargs", '{"enable_thinking": false}', "--report_to", "tensorboard"]}
STEPS = 16
RUN = ["--max_steps", STEPS, "--logging_steps", 4, "--per_device_train_batch_size", 1,
       "--gradient_accumulation_steps", 2, "--eval_steps", STEPS, "--eval_generation_rows", 8,  # 64: the default run
       "--eval_dataset_name", HELD_OUT_64]
WITH_VIDEO = ["--dataset_name", ",".join(str(VLM_SHAPES / name) for name in ("image_chat", "text_chat", "video_chat")),
              "--dataset_weights", "0.5,0.25,0.25"]
VIDEO_COUNTS = r"\| video 0 \| no_frames 0 \| video_too_long 0 \| video_mismatch 0 "  # every video row trained
# Gemma 4 E2B and the Omni thinkers hear: a quarter of their rows are the embedded audio questions (ranks and
# micro-batches with and without a clip meet)
AUDIO_FAMILIES = ["gemma4", "qwen2_5_omni", "qwen3_omni_moe"]
ROWS_A_SECOND = {"gemma4": 25, "qwen2_5_omni": 25, "qwen3_omni_moe": 13}  # a 1 s clip's placeholders
WITH_AUDIO = ["--dataset_name", ",".join(str(VLM_SHAPES / name) for name in ("image_chat", "text_chat", "audio_chat")),
              "--dataset_weights", "0.5,0.25,0.25"]
AUDIO_COUNTS = r"\| audio 0 \| .*\| audio_undecodable 0 \| audio_empty 0 \| audio_too_long 0 \| audio_mismatch 0$"


def launch(config, checkpoint, output_dir, *extra):
    result = run_engine(config, "--model_name_or_path", checkpoint, *RUN, "--output_dir", output_dir, *extra,
                               recipe=VLM_RECIPE)
    return result, output_dir


@pytest.fixture(scope="module")
def family_runs(tiny_vlms, tmp_path_factory):
    """{(family, config): (result, output_dir)}: every family under DDP, the video families (with clips) under
    sharded engines too."""
    runs = {}
    for family, config in [(family, "ddp.yaml") for family in FAMILIES] + SHARDED:
        preset = ["--train_modules", TRAIN_MODULES[family]] if family in TRAIN_MODULES else []
        preset += WITH_VIDEO if family in VIDEO_FAMILIES else WITH_AUDIO if family in AUDIO_FAMILIES else []
        preset += TEMPLATE_KWARGS.get(family, []) if config == "ddp.yaml" else []
        runs[family, config] = launch(config, tiny_vlms[family],
                                      tmp_path_factory.mktemp(f"{family}_{config[:-5]}"), *preset)
    return runs


def dummy_batches(log):
    return sum(map(int, re.findall(r"^step \d+/\d+ .*\| dummy_image_batches (\d+)", log, re.M)))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_on_mixed_ranks_under_ddp(family_runs, family):
    result, _ = family_runs[family, "ddp.yaml"]
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, "ddp.yaml")
    assert "assistant turns found by" in result.log
    assert re.search(r"^module groups: vision_tower [\d,]+ params", result.log, re.M)
    loss = losses(result.log)
    assert sorted(loss) == list(range(4, STEPS + 1, 4))
    assert loss[STEPS] < 0.95 * loss[4], loss
    assert dummy_batches(result.log) > 0  # text-only micro-batches ran the dummy on some rank
    assert "eval_answers 64" in result.log  # every held-out row
    if family in VIDEO_FAMILIES:
        assert re.search(r"^step 16/16 .*" + VIDEO_COUNTS, result.log, re.M), result.log[-3000:]
    if family in AUDIO_FAMILIES:  # every audio row trained, its tower among the groups
        assert re.search(r"^step 16/16 .*" + AUDIO_COUNTS, result.log, re.M), result.log[-3000:]
        # all of it (Gemma 4), or all but its last layer, the projector (Qwen2.5-Omni: model.audio_tower.proj)
        assert re.search(r"^module groups: .*; audio_tower [\d,]+ params \(model\.audio_tower[.)]", result.log, re.M)


@pytest.mark.parametrize("family", FAMILIES)
def test_output_loads_as_the_input_checkpoint_and_answers_through_the_pipeline(tiny_vlms, family_runs, family):
    """Same class and chat template as the input; exactly the preset's module groups trained (a
    frozen tower bit-identical); the image-text-to-text pipeline answers from the directory."""
    _, output_dir = family_runs[family, "ddp.yaml"]
    model = AutoModelForImageTextToText.from_pretrained(output_dir)
    source = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])
    assert type(model) is type(source)
    processor = AutoProcessor.from_pretrained(tiny_vlms[family])
    assert AutoProcessor.from_pretrained(output_dir).chat_template == processor.chat_template
    groups = module_groups(source, dummy_image_inputs(source, processor))
    before, after = source.state_dict(), model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    trained = {"vision_tower", "projector", "language_model"} if TRAIN_MODULES.get(family) == "all" else {
        "projector", "language_model"}
    for group, params in groups.items():
        names = {name for name, _ in params} - set(groups.unreached)
        assert bool(names & changed) == (group in trained), group
    assert not changed & set(groups.unreached)
    # The pipeline answers from the directory what the saved model generates through its own processor.
    answer = pipeline("image-text-to-text", model=str(output_dir))
    chat = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (32, 32), (200, 30, 30))},
                                         {"type": "text", "text": "What colour is the shape?"}]}]
    saved_processor = AutoProcessor.from_pretrained(output_dir)
    inputs = saved_processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                 return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    expected = saved_processor.decode(generated, skip_special_tokens=True)
    answered = answer(text=chat, max_new_tokens=4, return_full_text=False, generate_kwargs={"do_sample": False})
    assert answered[0]["generated_text"] == expected
    if family in AUDIO_FAMILIES:  # a model that hears answers a clip through the any-to-any pipeline
        clip, _ = decode_audio(wav_bytes(tone(1.0, 16000), 16000), 16000, 30.0)
        chat = [{"role": "user", "content": [{"type": "audio", "audio": clip},
                                             {"type": "text", "text": "How many beeps?"}]}]
        # the clip whole, as the recipe gives it (a reloaded Gemma 4 processor's own default, truncation, finds no
        # max_length and raises)
        inputs = saved_processor(text=saved_processor.apply_chat_template(chat, add_generation_prompt=True),
                                 audio=[clip], audio_kwargs={"truncation": False}, return_tensors="pt")
        assert int((inputs["input_ids"] == saved_processor.tokenizer.convert_tokens_to_ids(
            saved_processor.audio_token)).sum()) == ROWS_A_SECOND[family]
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        answered = pipeline("any-to-any", model=str(output_dir))(text=chat, max_new_tokens=4, return_full_text=False,
                                                                 generate_kwargs={"do_sample": False})
        assert answered[0]["generated_text"] == saved_processor.decode(generated, skip_special_tokens=True)


@pytest.mark.parametrize("family, projector, thinker_class", [
    ("qwen2_5_omni", "proj", "Qwen2_5OmniThinkerForConditionalGeneration"),
    ("qwen3_omni_moe", "proj2", "Qwen3OmniMoeThinkerForConditionalGeneration")])
def test_a_full_omni_checkpoint_trains_its_thinker_and_saves_one_the_auto_class_loads(tiny_vlms, tmp_path, family,
                                                                                      projector, thinker_class):
    """Given the whole Omni checkpoint (a talker beside the thinker), the recipe says it trains the thinker, trains it
    on the audio mixture, and saves a thinker that AutoModelForImageTextToText loads."""
    full = save_family(tiny_vlm_2026.WHOLE, f"{family}_full", tmp_path / "full")
    result = run_recipe("--model_name_or_path", full, "--max_steps", 4, "--logging_steps", 2, "--eval_dataset_name", "",
                        *WITH_AUDIO, "--output_dir", tmp_path / "run", recipe=VLM_RECIPE)
    assert result.returncode == 0, result.log[-3000:]
    assert (f"is a full {family} checkpoint: training its thinker ({thinker_class}), "
            "saved as a model of its own that loads with AutoModelForImageTextToText") in result.log
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "run")
    thinker = AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])  # the checkpoint's, untrained
    assert type(model) is type(thinker) and model.config.model_type == f"{family}_thinker"
    before, after = thinker.state_dict(), model.state_dict()
    assert before.keys() == after.keys()
    weight = f"model.audio_tower.{projector}.weight"
    assert not torch.equal(before[weight], after[weight])


@pytest.mark.parametrize("family, config", SHARDED)
def test_a_sharded_engine_matches_ddp_on_a_non_llava_family(family_runs, family, config):
    result, output_dir = family_runs[family, config]
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, config, wrapped="VLMForTraining")
    ddp, ddp_dir = family_runs[family, "ddp.yaml"]
    assert dummy_batches(result.log) == dummy_batches(ddp.log) > 0
    assert_same_curves(result.log, ddp.log, grad_norm=True, rel=1e-4)
    assert_adam_weights_close(load_file(output_dir / "model.safetensors"), load_file(ddp_dir / "model.safetensors"),
                              learning_rate=1e-3, steps=STEPS)


@pytest.fixture(scope="module")
def llava_json_data(tmp_path_factory):
    """The embedded conversations as LLaVA JSON: image files under a folder, `<image>` placeholders, text-only rows,
    and LLaVA-Video rows (`video` files in the same folder, `<video>` placeholders)."""
    folder = tmp_path_factory.mktemp("llava_json_run")
    rows = []
    for name, count in (("image_chat", 48), ("text_chat", 16)):
        files = str(REPO / f"data/vlm_shapes/{name}/train-00000-*.parquet")
        source = datasets.load_dataset("parquet", data_files=files, split="train").select(range(count))
        source = source.cast_column("images", datasets.List(datasets.Image(decode=False)))  # broken ones stay broken
        for index, example in enumerate(source):
            row = {"conversations": [
                {"from": "human" if m["role"] == "user" else "gpt",
                 "value": "".join("<image>\n" if part["type"] == "image" else part["text"] for part in m["content"])}
                for m in example["messages"]]}
            if example["images"]:
                (folder / f"{index}.png").write_bytes(example["images"][0]["bytes"])
                row["image"] = f"{index}.png"
            rows.append(row)
    for first, second in zip(rows[:48:8], rows[1:48:8]):  # six two-image rows: the next row's image shown first
        if "image" in first and "image" in second:
            first["image"] = [second["image"], first["image"]]
            first["conversations"][0]["value"] = "<image>\n" + first["conversations"][0]["value"]
    clips = datasets.load_dataset("parquet", data_files=str(VLM_SHAPES / "video_chat" / "train-*.parquet"),
                                  split="train").select(range(16))
    for index, example in enumerate(clips):
        (folder / f"{index}.mp4").write_bytes(example["videos"][0]["bytes"])
        question, answer = (m["content"][-1]["text"] for m in example["messages"])
        rows.append({"conversations": [{"from": "human", "value": f"<video>\n{question}"},
                                       {"from": "gpt", "value": answer}], "video": f"{index}.mp4"})
    # Text and video rows spread among the image rows
    rows = [row for four in zip(rows[:48:3], rows[1:48:3], rows[2:48:3], rows[48:64], rows[64:]) for row in four]
    (folder / "llava.json").write_text(json.dumps(rows))
    return folder


LLAVA_JSON_RUNS = [(MATRIX, "ddp.yaml"), (MATRIX, "zero3.yaml"), ("idefics3", "ddp.yaml")]


@pytest.fixture(scope="module")
def llava_json_runs(tiny_vlms, llava_json_data, tmp_path_factory):
    return {(family, config): launch(
        config, tiny_vlms[family], tmp_path_factory.mktemp(f"{family}_{config[:-5]}_json"), "--dataset_name", "json",
        "--data_files", llava_json_data / "llava.json", "--image_folder", llava_json_data, "--dataset_weights", "",
        "--eval_dataset_name", "", *(["--train_modules", "all"] if family in TRAIN_MODULES else []))[0]
        for family, config in LLAVA_JSON_RUNS}


@pytest.mark.parametrize("family, config", LLAVA_JSON_RUNS)
def test_llava_json_with_two_image_and_video_rows_trains_non_llava_families(llava_json_runs, family, config):
    """LLaVA(-Video) JSON with one-image, two-image, video and text-only rows in one file, 2 processes at batch 1:
    no row is lost to the mixed `image` column (the two-image rows are read, not counted as mismatched), the
    clips are found under --image_folder (no --video_folder given), and it trains: Qwen2.5-VL on every video row,
    under ZeRO-3 with DDP's losses; Idefics3 (no video processor) counts its video rows as `video`."""
    result = llava_json_runs[family, config]
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, config)
    loss = losses(result.log)
    assert loss[STEPS] < 0.95 * loss[4], loss
    assert dummy_batches(result.log) > 0
    assert re.search(r"^step 16/16 .*\| image_mismatch 0 \| .*\| unaligned 0 \| bad_text 0 \| bad_row 0 ", result.log,
                     re.M), result.log[-3000:]
    if family == MATRIX:
        assert re.search(r"^step 16/16 .*" + VIDEO_COUNTS, result.log, re.M), result.log[-3000:]
        assert_same_curves(result.log, llava_json_runs[MATRIX, "ddp.yaml"].log, grad_norm=True)
    else:
        assert re.search(r"^step 16/16 .*\| video [1-9]\d* \| no_frames 0 ", result.log, re.M), result.log[-3000:]


def test_chat_template_kwargs_are_said_tracked_and_kept_in_the_model_card(family_runs):
    """--chat_template_kwargs: the template line says what every rendering gets, the tracker holds it as JSON text
    and the model card says how to render as the model was trained."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, output_dir = family_runs["qwen3_5", "ddp.yaml"]
    assert result.returncode == 0, result.log[-3000:]
    assert re.search(r"^chat template of .*, rendered with \{\"enable_thinking\": false\} \(--chat_template_kwargs\):",
                     result.log, re.M), result.log[:3000]
    card = (output_dir / "README.md").read_text()
    assert '- chat template rendered with: `{"enable_thinking": false}` (--chat_template_kwargs;' in card
    assert EventAccumulator(str(output_dir / "vlm_finetune")).Reload().Scalars("loss")  # the tracker started
