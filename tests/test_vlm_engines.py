"""vlm_finetune.py on 2 CPU processes where text-only and image micro-batches meet on different ranks: under
every engine the token-mean loss and gradient norm of every step equal one process holding the whole
window, full fine-tuning and LoRA (Llava and Qwen2.5-VL, with gradient checkpointing), resume repeats
the straight run, and without the dummy image the same runs fail.

Scenario data (one parquet shard per data rank, read in order): per-device batch 1 and accumulation 2,
so one rank's whole first window is text-only while the other's has images, the second window is the
reverse, and the third mixes both within each rank. Text answers are 6x longer than image answers: a
per-micro-batch mean would weight the ranks' tokens unequally.

Features across engines, not every feature under every engine (tests/README.md):

| run | DDP | FSDP2 | ZeRO-2 | ZeRO-3 |
|---|---|---|---|---|
| full fine-tuning = one process | yes | yes, divergence guard on | yes | yes, resumed |
| LoRA = one process | Llava, resumed | Llava, checkpointing | | Qwen2.5-VL, checkpointing |
| without the dummy image: fails | yes | divergence guard names the modules | | yes |
| a Llava composed from a CLIP tower and Gemma 3 text = one process | stage 2 | stage 1 (projector only) | | stage 2 |
| a thinking Qwen3.5 on reasoning and plain rows = one process | yes | yes | | yes |
| Gemma 4 E2B on rows that show an image and play a clip, and text-only rows = one process | yes | yes | yes | yes |
| the Qwen2.5-Omni thinker on the same rows = one process | yes | LoRA, below | LoRA, below | yes |
| the Qwen3-Omni-MoE thinker on the same rows = one process | yes | yes | yes | yes |
| Qwen2-Audio (no vision tower) on rows that play a clip, and text-only rows = one process | yes | yes | yes | yes |
| Voxtral (no vision tower, clips in 30 s windows) on the same rows = one process | yes | yes | yes | yes |
| LoRA on every tower of the Qwen2.5-Omni thinker (its audio tower too), those rows = one process | | yes | yes | |

The reasoning runs (the tiny `qwen3_5_think`, its official template) read image rows whose answers carry
`reasoning_content` and text-only rows that answer at once: one rank's window all reasoned, the other's all plain;
the reasoning trained, the plain rows' empty think block context. The audio runs (the tiny `gemma4`, `qwen2_5_omni`
and `qwen3_omni_moe`, which hear) read rows holding an image and a one-second clip of beeps where the others read image
rows: a text-only micro-batch carries the dummy image and the dummy sound together. Qwen2-Audio, which only hears,
reads rows holding the clip alone: its text-only micro-batches carry the dummy sound, its ranks of text alone none;
so does Voxtral, whose processor gets its clips from the recipes in whole windows (`WindowedAudio`).

The full fine-tuning runs end with two benchmarks (`--benchmarks`, 5 embedded documents each, uneven over the 2
ranks): every engine's scores equal one process's.
"""

import random

import pytest
import torch
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file
from transformers import (
    AutoModelForImageTextToText,
    AutoModelForMultimodalLM,
    AutoProcessor,
    GenerationConfig,
    LlavaForConditionalGeneration,
)

from helpers import adapted_layers, chat_row, save_tower, settings, tiny, write_chat_parquet
from launch import (
    REPO,
    VLM_RECIPE,
    accelerate_launch,
    assert_adam_weights_close,
    assert_engine,
    assert_same_curves,
    losses,
    run_engine,
    run_recipe,
)
from make_audio import beeps, encode_flac
from mmrecipes.vlm.arguments import LoraArgs
from mmrecipes.vlm.model.lora import lora_config
from tiny_language_models import save_tiny_language_model

pytestmark = pytest.mark.launch

WITHOUT_DUMMY = REPO / "tests" / "recipe_without_dummy.py"
STEPS = 6
COMMON = ["--max_steps", STEPS, "--logging_steps", 1, "--per_device_train_batch_size", 1,
          "--gradient_accumulation_steps", 2, "--ddp_timeout", 60]
SCENARIO = [*COMMON, "--dataset_name", "parquet", "--dataset_weights", "", "--shuffle_buffer_size", 1,
            "--eval_dataset_name", ""]
LORA = ["--use_peft", "true", "--lora_r", 4, "--lora_alpha", 8, "--lora_dropout", 0.0]  # dropout 0: same on any ranks
# benchmarks at the end, 5 documents over 2 ranks (3 and 2): every engine's scores equal one process's
BENCHMARKS = ["--benchmarks", "docvqa_val,ai2d", "--benchmark_data_dir", "embedded:benchmarks", "--benchmark_limit", 5,
              "--benchmark_max_new_tokens", 4]
# What each run trains, on top of the scenario: its single-process ground truth has the same flags.
FEATURES = {"full": BENCHMARKS, "lora": LORA, "lora_qwen": LORA,
            # a Llava composed from a CLIP tower and Gemma 3 text (mmrecipes.vlm.model.compose): stage 2, and
            # stage 1's preset
            "composed": [], "composed_stage1": ["--train_modules", "projector"],
            # reasoning and plain rows on a thinking template (its own data: the scenario's rows with reasoning)
            "reasoning": [],
            # image-and-audio rows and text-only ones on a model that hears (its own data): Gemma 4 E2B, and the
            # Qwen2.5-Omni and Qwen3-Omni-MoE thinkers (their encoder rows checked by their length formulas, no mask)
            "audio": [], "audio_omni": [], "audio_qwen3_omni": [],
            # clip-only rows and text-only ones on a model that only hears (no vision tower): Qwen2-Audio, and
            # Voxtral (each clip in whole 30 s windows, its rows checked by its windows: 376 tokens a clip)
            "audio_qwen2_audio": [], "audio_voxtral": ["--max_length", 512],
            # LoRA under --train_modules all: adapters in the audio tower too
            "audio_lora": [*LORA, "--train_modules", "all"]}
HEARING = {"audio": "gemma4", "audio_omni": "qwen2_5_omni", "audio_qwen3_omni": "qwen3_omni_moe",
           "audio_lora": "qwen2_5_omni", "audio_qwen2_audio": "qwen2_audio", "audio_voxtral": "voxtral"}
ONLY_HEARS = {"audio_qwen2_audio", "audio_voxtral"}  # read the clip-only rows
RUNS = {  # (engine, feature): extra flags of the 2-process run
    ("ddp.yaml", "full"): [],
    ("fsdp2.yaml", "full"): [],  # with the divergence guard switched on by its environment variable
    ("zero2.yaml", "full"): [],
    ("zero3.yaml", "full"): ["--save_steps", 3],
    ("ddp.yaml", "lora"): ["--save_steps", 3],
    ("fsdp2.yaml", "lora"): ["--gradient_checkpointing", "true"],
    ("zero3.yaml", "lora_qwen"): ["--gradient_checkpointing", "true"],
    ("ddp.yaml", "composed"): [],
    ("fsdp2.yaml", "composed_stage1"): [],
    ("zero3.yaml", "composed"): [],
    ("ddp.yaml", "reasoning"): [],
    ("fsdp2.yaml", "reasoning"): [],
    ("zero3.yaml", "reasoning"): [],
    **{(config, feature): [] for config in ("ddp.yaml", "fsdp2.yaml", "zero2.yaml", "zero3.yaml")
       for feature in HEARING if feature not in ("audio_lora", "audio_omni")},
    # the Qwen2.5-Omni thinker: fully under DDP and ZeRO-3, LoRA on every tower under FSDP2 and ZeRO-2
    ("ddp.yaml", "audio_omni"): [],
    ("zero3.yaml", "audio_omni"): [],
    ("fsdp2.yaml", "audio_lora"): [],
    ("zero2.yaml", "audio_lora"): [],
}


def image_row():
    return chat_row("What colour is the shape?", "red", Image.new("RGB", (32, 32), (220, 40, 40)))


def text_row():
    return chat_row("What is the opposite of above?", "below, below, below, below, below, below, below")


def reasoned_image_row():
    return chat_row("What colour is the shape?", "red", Image.new("RGB", (32, 32), (220, 40, 40)),
                    reasoning="The image shows one large red square, so its colour is red.")


def heard_image_row():
    """An image and a second of three beeps (data_prep/make_audio.py's), one question about both."""
    clip = encode_flac(beeps(3, 440.0, random.Random(0)))
    return chat_row("What colour is the shape, and how many beeps?", "red, three",
                    Image.new("RGB", (32, 32), (220, 40, 40)), audio=clip)


def heard_row():
    """The second of three beeps alone."""
    return chat_row("How many beeps?", "three", audio=encode_flac(beeps(3, 440.0, random.Random(0))))


def write_scenario(data, image=None, text=None):
    """rank{0,1}.parquet (one shard per data rank) and single/all.parquet (the same windows for one process)."""
    image, text = image or image_row(), text or text_row()
    data.mkdir(exist_ok=True)
    write_chat_parquet(data / "rank0.parquet", [image, image, text, text, image, text] * 4)
    write_chat_parquet(data / "rank1.parquet", [text, text, image, image, text, image] * 4)
    (data / "single").mkdir()
    write_chat_parquet(data / "single" / "all.parquet", [image, image, text, text] * 12)
    return data


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("scenario")
    write_scenario(root / "reasoning", reasoned_image_row())
    write_scenario(root / "audio", heard_image_row())
    write_scenario(root / "heard", heard_row())
    return write_scenario(root)


def data_of(scenario, feature):
    if feature in HEARING:
        return scenario / ("heard" if feature in ONLY_HEARS else "audio")
    return scenario / feature if feature == "reasoning" else scenario


@pytest.fixture(scope="module")
def composed_parts(tmp_path_factory):
    """A tiny CLIP tower and a tiny Gemma 3 text LM with its official template (tests/test_compose.py's parts; not
    Llama 3.2, whose template writes today's date: a run across midnight would compare different prompts)."""
    root = tmp_path_factory.mktemp("composed_parts")
    return ["--vision_model_name_or_path", save_tower("clip", root / "clip"),
            "--language_model_name_or_path", str(save_tiny_language_model("gemma3_text", root / "gemma3_text"))]


def feature_args(feature, tiny_vlms, composed_parts):
    model = {"lora_qwen": ["--model_name_or_path", tiny_vlms["qwen2_5_vl"]],
             "reasoning": ["--model_name_or_path", tiny_vlms["qwen3_5_think"]],
             **{audio: ["--model_name_or_path", tiny_vlms[family]] for audio, family in HEARING.items()}
             }.get(feature, [])
    return [*FEATURES[feature], *model, *(composed_parts if feature.startswith("composed") else [])]


@pytest.fixture(scope="module")
def truth(scenario, tiny_vlms, composed_parts, tmp_path_factory):
    """The ground truth of each feature: one process holds each whole window as ONE batch of 4 rows, where the
    mean over the batch's tokens is the token mean (a per-micro-batch mean on 2 ranks x 2 micro-batches of 1
    row would weight a 2-token answer like a 15-token one, and fail the comparison)."""
    runs = {}
    for feature in FEATURES:
        output_dir = tmp_path_factory.mktemp(f"single_{feature}")
        result = run_recipe(*SCENARIO, *feature_args(feature, tiny_vlms, composed_parts),
                            "--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 1,
                            "--data_files", data_of(scenario, feature) / "single" / "all.parquet",
                            "--output_dir", output_dir,
                            recipe=VLM_RECIPE)
        assert result.returncode == 0, result.log[-3000:]
        runs[feature] = result, output_dir
    return runs


@pytest.fixture(scope="module")
def runs(scenario, tiny_vlms, composed_parts, tmp_path_factory):
    results = {}
    for (config, feature), extra in RUNS.items():
        output_dir = tmp_path_factory.mktemp(f"{feature}_{config[:-5]}")
        env = {"MMRECIPES_DEBUG_DIVERGENCE": "1"} if (config, feature) == ("fsdp2.yaml", "full") else None
        results[config, feature] = run_engine(
            config, *SCENARIO, *feature_args(feature, tiny_vlms, composed_parts), *extra,
            "--data_files", data_of(scenario, feature) / "rank*.parquet", "--output_dir", output_dir,
            recipe=VLM_RECIPE, env=env), output_dir
    return results


@pytest.mark.parametrize("config, feature", list(RUNS), ids=[f"{c[:-5]}-{f}" for c, f in RUNS])
def test_mixed_ranks_match_one_process(runs, truth, config, feature):
    """Text-only and image micro-batches on different ranks run under every engine (LoRA too: ZeRO-3 with
    non-reentrant gradient checkpointing, the CheckpointError of transformers#47254 / TRL#2514), and every
    step's token-mean loss and gradient norm equal one process holding the whole window; so do the weights."""
    result, output_dir = runs[config, feature]
    assert result.returncode == 0, result.log[-3000:]
    assert_engine(result.log, config, wrapped="VLMForTraining")
    reference, reference_dir = truth[feature]
    assert_same_curves(result.log, reference.log, range(1, STEPS + 1), grad_norm=True)
    assert losses(result.log)[STEPS] < losses(result.log)[1]
    if feature in ("full", "composed"):
        assert_adam_weights_close(LlavaForConditionalGeneration.from_pretrained(output_dir).state_dict(),
                                  LlavaForConditionalGeneration.from_pretrained(reference_dir).state_dict(),
                                  learning_rate=1e-3, steps=STEPS)
    elif feature in ("reasoning", *HEARING) and feature != "audio_lora":
        auto = AutoModelForMultimodalLM if feature in ONLY_HEARS else AutoModelForImageTextToText
        assert_adam_weights_close(auto.from_pretrained(output_dir).state_dict(),
                                  auto.from_pretrained(reference_dir).state_dict(), learning_rate=1e-3, steps=STEPS)
        # the plain rows' empty think block was context, the reasoning a target; every clip trained
        assert ("an empty think block: context, not a target" if feature == "reasoning" else
                "| audio 0 | video 0 |") in result.log
    elif feature == "audio_lora":  # the adapters, the audio tower's among them, are one process's; every clip trained
        adapter, reference_adapter = (load_file(folder / "adapter" / "adapter_model.safetensors")
                                      for folder in (output_dir, reference_dir))
        assert any("audio_tower" in name and "lora_" in name for name in adapter)
        assert_adam_weights_close(adapter, reference_adapter, learning_rate=1e-3, steps=STEPS)
        assert "| audio 0 | video 0 |" in result.log
    else:
        assert "trainable parameters" in result.log and "frozen" in result.log
    if config == "fsdp2.yaml" and feature == "full":  # the guard was on, found nothing, changed no number
        assert "divergence guard on" in result.log and "divergence guard:" not in result.log
    if feature == "full":  # the benchmarks: greedy answers in step over the ranks, scored as by one process
        scores = [line for line in reference.log.splitlines() if line.startswith(f"eval step {STEPS} | bench/")]
        assert len(scores) == 1 and "bench/docvqa_val/documents 5 |" in scores[0] and scores[0] in result.log


@pytest.mark.parametrize("config, feature", [("zero3.yaml", "full"), ("ddp.yaml", "lora")])
def test_resume_repeats_the_straight_run(runs, scenario, tiny_vlms, composed_parts, config, feature, tmp_path):
    """From checkpoint-3: the same losses and the same weights (ZeRO-3's partitions; LoRA's adapter).
    LoRA's frozen weights hold no optimizer state."""
    straight, output_dir = runs[config, feature]
    checkpoint = output_dir / "checkpoints" / "checkpoint-3"
    if feature == "lora":
        optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=False)
        model = load_file(checkpoint / "model.safetensors")
        trainable = [name for name in model if ".lora_" in name or ".modules_to_save." in name]
        assert len(optimizer["state"]) == len(trainable) < len(model)  # adapters and projector copy only
    resumed = run_engine(config, *SCENARIO, *feature_args(feature, tiny_vlms, composed_parts), *RUNS[config, feature],
                                "--data_files", scenario / "rank*.parquet", "--output_dir", tmp_path,
                                "--resume_from_checkpoint", checkpoint, recipe=VLM_RECIPE)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert_same_curves(resumed.log, straight.log, [4, 5, 6], abs=1e-5)
    saved_file = "adapter/adapter_model.safetensors" if feature == "lora" else "model.safetensors"
    saved = load_file(output_dir / saved_file)
    for name, tensor in load_file(tmp_path / saved_file).items():
        torch.testing.assert_close(tensor, saved[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("config, family", [("fsdp2.yaml", None), ("zero3.yaml", "qwen2_5_vl")])
def test_adapter_reloads_on_the_base_and_gives_the_merged_models_logits(runs, tiny_vlms, config, family):
    """output_dir/adapter on the untouched base = the merged model in output_dir; only the adapted
    layers and the projector differ from the base; frozen weights bit-identical."""
    _, output_dir = runs[config, "lora_qwen" if family else "lora"]
    model, _, groups = tiny(family and tiny_vlms[family])
    layers = adapted_layers(model, lora_config(model, groups, "projector,language_model", LoraArgs(lora_r=4)))
    base, processor, groups = tiny(family and tiny_vlms[family])
    before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    adapted = PeftModel.from_pretrained(base, output_dir / "adapter").eval()
    merged = AutoModelForImageTextToText.from_pretrained(output_dir).eval()
    assert type(merged) is type(base)
    image = image_row()["images"][0]
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    inputs = processor(text=processor.apply_chat_template(chat, add_generation_prompt=True), images=[[image]],
                       return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(adapted(**inputs).logits, merged(**inputs).logits, rtol=1e-5, atol=1e-5)
    changed = {name for name, tensor in merged.state_dict().items() if not torch.equal(tensor, before[name])}
    projector = {name for name, _ in groups.projector}
    assert changed and changed <= {f"{layer}.weight" for layer in layers} | projector
    assert changed & projector
    # Both outputs keep the input's generation config (Qwen2.5-VL stops on two tokens) and chat template.
    for directory in (output_dir, output_dir / "adapter"):
        assert settings(GenerationConfig.from_pretrained(directory)) == settings(base.generation_config)
        assert AutoProcessor.from_pretrained(directory).chat_template == processor.chat_template


@pytest.mark.parametrize("config", ["ddp.yaml", "zero3.yaml"])
def test_same_scenario_without_the_dummy_fails(scenario, config, tmp_path):
    """What most trainers do (a text-only batch skips the tower) fails on the same data: the passing
    runs above prove the dummy is what makes them work. Gloo aborts within seconds (a mismatched
    collective); on NCCL the same mistake hangs until the timeout. Under DDP launched, with a DataLoader
    worker, which must end with its crashed rank (or the launcher's output pipe stays open and this test
    hangs); under ZeRO-3 on forked ranks."""
    args = [*SCENARIO, "--data_files", scenario / "rank*.parquet", "--output_dir", tmp_path, "--ddp_timeout", 30]
    if config == "ddp.yaml":  # launched: the launcher must see the crashed rank's worker end too
        result = accelerate_launch(config, *args, "--dataloader_num_workers", 1, recipe=WITHOUT_DUMMY, timeout=300)
    else:
        result = run_engine(config, *args, recipe=WITHOUT_DUMMY, timeout=300)
    assert result.returncode != 0
    assert f"step {STEPS}/{STEPS}" not in result.log
    assert any(error in result.log for error in ("Received data size doesn't match expected size",
                                                  "Expected to have finished reduction"))


def test_divergence_guard_names_the_diverging_modules(scenario, tmp_path):
    """--debug_divergence turns the same failure into one clear error on every rank, raised before
    the engine's collective (FSDP2 would all-gather the tower's parameters on one rank only)."""
    result = accelerate_launch("fsdp2.yaml", *SCENARIO, "--data_files", scenario / "rank*.parquet", "--output_dir",
                               tmp_path, "--ddp_timeout", 30, "--debug_divergence", "true", recipe=WITHOUT_DUMMY,
                               timeout=300)
    assert result.returncode != 0
    message = ("RuntimeError: divergence guard: ranks run different modules at module call 2: rank 0 is about to "
               "run 'model.model.vision_tower', rank 1 is about to run 'model'")
    for rank in (0, 1):  # the same error on every rank, naming each rank's module
        assert f"[rank{rank}]: {message}" in result.log
    assert "Received data size doesn't match" not in result.log
