"""Helpers several test modules share: rows and parquet files of chat data, a saved tiny vision tower, the tiny
Llava with its module groups, LoRA's adapted layers, the families of the conformance suite, generation settings, and a
small CLIP run's checkpointer (conftest's `saved` and `run`) with what the hostile-checkpoint tests plant in them, and
benchmark documents of another form than their task's."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import get_peft_model
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    Siglip2Config,
    Siglip2ImageProcessor,
    Siglip2Model,
    SiglipConfig,
    SiglipImageProcessor,
    SiglipModel,
    get_scheduler,
)

from mmrecipes.arguments import TrainingArgs
from mmrecipes.checkpoint_validation import file_digest
from mmrecipes.checkpointing import MARKER, Checkpointer, data_layout
from mmrecipes.contrastive.arguments import DataArgs
from mmrecipes.contrastive.data import build_dataloader
from mmrecipes.distributed import Ranks
from mmrecipes.vlm.arguments import VLMModelArgs
from mmrecipes.vlm.model.families import dummy_image_inputs
from mmrecipes.vlm.model.module_groups import module_groups
from mmrecipes.vlm.model.parts import load_vlm

FAMILIES = ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl3", "idefics2", "idefics3", "gemma3",
            "llava_onevision", "mistral3", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "gemma4", "gemma4_moe",
            "qwen2_5_omni", "qwen3_omni_moe"]
# What each family's official template ends an assistant turn with (Llava-1.5's writes nothing).
END_OF_TURN = {"llava": "", "llava_next": "</s>", "qwen2_vl": "<|im_end|>", "qwen2_5_vl": "<|im_end|>",
               "qwen3_vl": "<|im_end|>", "internvl3": "<|im_end|>", "idefics2": "<end_of_utterance>",
               "idefics3": "<end_of_utterance>", "gemma3": "<end_of_turn>", "llava_onevision": "<|im_end|>",
               "mistral3": "</s>", "qwen3_5": "<|im_end|>", "qwen3_vl_moe": "<|im_end|>", "qwen3_5_moe": "<|im_end|>",
               "gemma4": "<turn|>", "gemma4_moe": "<turn|>", "qwen2_5_omni": "<|im_end|>",
               "qwen3_omni_moe": "<|im_end|>"}
VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2, image_size=32,
              patch_size=8)
TEXT_TOWER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  max_position_embeddings=16)
MEAN, STD = [0.25, 0.5, 0.75], [0.2, 0.3, 0.4]  # not the processor's defaults: they must survive into the VLM


def save_tower(kind: str, directory) -> str:
    if kind == "clip":
        model = CLIPModel(CLIPConfig(vision_config=VISION, text_config=TEXT_TOWER))
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                       image_mean=MEAN, image_std=STD)
    elif kind == "siglip":
        model = SiglipModel(SiglipConfig(vision_config=VISION, text_config=TEXT_TOWER))
        processor = SiglipImageProcessor(size={"height": 32, "width": 32}, image_mean=MEAN, image_std=STD)
    else:  # NaFlex
        vision = {key: value for key, value in VISION.items() if key != "image_size"} | {"num_patches": 16}
        model = Siglip2Model(Siglip2Config(vision_config=vision, text_config=TEXT_TOWER))
        processor = Siglip2ImageProcessor(max_num_patches=16, patch_size=8)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return str(directory)


def write_chat_parquet(path, rows):
    """`rows` as a parquet file of the chat layout; with a `reasoning_content` column where a turn has one."""
    turn = {"role": datasets.Value("string"),
            "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}
    if any("reasoning_content" in message for row in rows for message in row["messages"]):
        turn["reasoning_content"] = datasets.Value("string")
    features = {"messages": [turn], "images": [datasets.Image()]}
    if any(row.get("audios") for row in rows):  # clips as encoded bytes, as data/vlm_shapes/audio_chat holds them
        features["audios"] = [{"bytes": datasets.Value("binary")}]
        rows = [{"audios": []} | row for row in rows]
    datasets.Dataset.from_list(rows, features=datasets.Features(features)).to_parquet(str(path))


def chat_row(question, answer, image=None, reasoning=None, audio=None):
    """A one-turn chat row; `reasoning`: the answer's `reasoning_content`; `audio`: a clip's encoded bytes, heard
    after the image."""
    content = ([{"type": "image", "text": None}] if image is not None else []) + (
        [{"type": "audio", "text": None}] if audio is not None else []) + [{"type": "text", "text": question}]
    answer_turn = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
    return {"messages": [{"role": "user", "content": content},
                         answer_turn | ({"reasoning_content": reasoning} if reasoning is not None else {})],
            "images": [image] if image is not None else []} | ({"audios": [{"bytes": audio}]} if audio else {})


def tiny(family_dir=None):
    set_seed(42)  # the recipe's seed: the tiny Llava it builds
    if family_dir is None:
        model, processor = load_vlm(VLMModelArgs())
    else:
        model = AutoModelForImageTextToText.from_pretrained(family_dir)
        processor = AutoProcessor.from_pretrained(family_dir)
    return model, processor, module_groups(model, dummy_image_inputs(model, processor))


def adapted_layers(model, config):
    peft_model = get_peft_model(model, config)
    return {name.removesuffix(".lora_A.default.weight") for name, _ in peft_model.base_model.model.named_parameters()
            if name.endswith(".lora_A.default.weight")}


def settings(generation_config):
    return {name: value for name, value in generation_config.to_dict().items() if name != "transformers_version"}


# Checkpoints of a small CLIP run, as the hostile-checkpoint tests plant things in them

class Payload:
    """What a malicious checkpoint carries: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def make_checkpointer(output_dir, model, tokenizer, image_processor, data_args=None, **changes):
    """What a recipe builds around its Checkpointer: accelerator, optimizer, schedule, the training stream."""
    data_args = data_args or DataArgs()
    args = TrainingArgs(output_dir=str(output_dir), per_device_train_batch_size=16, **changes)
    accelerator = Accelerator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_scheduler("cosine", optimizer, 2, 10)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = build_dataloader(data_args, "train", None, tokenizer, image_processor, batch_size=16, ranks=Ranks(),
                              shuffle_seed=args.seed)
    layout = data_layout(data_args, args, Ranks(), batch_size=16)
    checkpoints = Checkpointer(accelerator, args, scheduler, model, layout, Ranks())
    checkpoints.layout["dataloader_num_workers"] = loader.num_workers
    return SimpleNamespace(checkpoints=checkpoints, loader=loader, optimizer=optimizer, scheduler=scheduler)


def refit_manifest(checkpoint: Path):
    """What someone who prepares a checkpoint would do: a manifest that fits its files."""
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["files"] = {str(path.relative_to(checkpoint)): file_digest(path)
                       for path in sorted(checkpoint.rglob("*")) if path.is_file() and path.name != MARKER}
    (checkpoint / MARKER).write_text(json.dumps(marker))


BENCHMARKS = Path(__file__).resolve().parents[1] / "data" / "benchmarks"


def documents(task: str) -> list[dict]:
    docs = datasets.load_dataset("parquet", data_files=str(BENCHMARKS / task / "*.parquet"), split="train")
    for column, feature in docs.features.items():
        if isinstance(feature, datasets.Image):
            docs = docs.cast_column(column, datasets.Image(decode=False))
        if isinstance(feature, datasets.Audio):
            docs = docs.cast_column(column, datasets.Audio(decode=False))
    return docs.to_list()


def write_task(folder, task: str, rows: list[dict]):
    (folder / task).mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(folder / task / "test.parquet")


def hostile_benchmarks(folder):
    """MMMU documents that all lack their image, AI2D answers written as letters, an MMBench index that is no
    number: each raised only after every document was answered (`ZeroDivisionError`, `int('B')`, `int('q0')`), in a
    run's last benchmark, before the model was saved."""
    write_task(folder, "mmmu_val", [doc | {"image_1": None} for doc in documents("mmmu_val")])
    write_task(folder, "ai2d", [doc | {"answer": "ABCD"[int(doc["answer"])]} for doc in documents("ai2d")])
    mmbench = documents("mmbench_en_dev_static")
    write_task(folder, "mmbench_en_dev_static", [doc | {"index": "q0" if i == 0 else str(doc["index"])}
                                                 for i, doc in enumerate(mmbench)])
    return "mmmu_val,ai2d,mmbench_en_dev_static"


def ended_by_the_watchdog(lines: list[str]) -> str:
    """The stderr of a Python process that runs `lines` (tests/ on its path, the watchdog's STUCK_S 1 s) and must be
    ended by the user-code watchdog: exit code 1, within 30 s."""
    import subprocess
    import sys
    import time

    script = "\n".join(["import sys; sys.path.insert(0, 'tests')", "from mmrecipes.vlm.algorithms import user_code",
                        "user_code.STUCK_S = 1.0", *lines]) + "\n"
    started = time.monotonic()
    ended = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                           capture_output=True, text=True, timeout=60)
    assert ended.returncode == 1 and time.monotonic() - started < 30, ended.stderr
    return ended.stderr


def ranks_of_a_script(lines: list[str], world_size: int = 2, timeout: float = 120) -> list:
    """The ended processes (`subprocess.CompletedProcess`, text) of `lines` run as `world_size` ranks of one node,
    started as torchrun starts them (one parent; RANK, LOCAL_RANK, WORLD_SIZE and the rendezvous address set)."""
    import subprocess
    import sys

    from gloo import free_port

    script = "\n".join(["import sys; sys.path.insert(0, 'tests')", *lines]) + "\n"
    port = free_port()
    launched = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, **launched, "RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank in range(world_size)]
    outputs = [rank.communicate(timeout=timeout) for rank in ranks]
    return [subprocess.CompletedProcess(rank.args, rank.returncode, *output) for rank, output in zip(ranks, outputs)]
