"""Score a saved image-text-to-text model on the built-in benchmarks, as lmms-eval scores them.

    python -m mmrecipes.benchmarks --model outputs/vlm_finetune --benchmarks mmstar,chartqa
    python -m mmrecipes.benchmarks --model outputs/vlm_finetune --benchmarks mmstar \
        --benchmark_data_dir embedded:benchmarks --benchmark_max_new_tokens 8
    torchrun --nproc_per_node 8 -m mmrecipes.benchmarks --model Qwen/Qwen2.5-VL-3B-Instruct --benchmarks docvqa_val

The model and its processor load with the Auto classes (its own chat template renders each prompt:
one user turn of the media, then the task's prompt) and answer greedily with `generate`. Launched
on several processes, each holds the whole model and answers its stride of the documents; the scores
are gathered once. Prints one line per task and writes them as JSON (`--output`).
"""

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText, AutoProcessor

from ..audio import audio_kwargs, heard_rate, window_seconds
from ..audio_windows import WINDOWS, windowed_audio
from ..config import CheckedArgs, parse_args
from ..paths import resolve_name
from ..saved_models import model_config, pretrained, trained_class
from ..template_kwargs import check_template_kwargs, parse_template_kwargs
from .arguments import BenchmarkArgs
from .harness import Benchmarks, too_long


@dataclass
class ModelArgs(CheckedArgs):
    model: str = ""  # a saved model directory or a hub id (embedded:tiny_sft_vlm: the embedded one)
    output: str = ""  # a JSON file of the scores ("": printed only)
    device: str = ""  # "": cuda:<local rank> where there is a GPU, else cpu
    # variables its chat template gets (a JSON object: '{"enable_thinking": false}'), as the run that trained it
    chat_template_kwargs: dict | str | None = None

    def __post_init__(self):
        super().__post_init__()
        if not self.model:
            raise ValueError("--model: give a saved model directory or a hub id")
        self.model = resolve_name(self.model)
        self.chat_template_kwargs = parse_template_kwargs(self.chat_template_kwargs)


class GeneratedAnswers:
    """`answer(request, max_new_tokens)` by `generate`, greedy: the new tokens' text, special tokens
    left out; `refusal`: a prompt longer than the model's positions; `sampling_rate`: its clips'
    rate (None: the model does not hear); `clip_seconds`: the longest clip it reads (None: any)."""

    def __init__(self, model, processor, device, template_kwargs=None):
        # a processor whose call takes no audio (Voxtral's) given one
        self.model, self.processor, self.device = model, windowed_audio(model, processor), device
        self.template_kwargs = template_kwargs or {}
        self.sampling_rate = heard_rate(model, self.processor)
        # the longest clip its forward reads (None: any): a longer one is counted, never cut
        self.clip_seconds = window_seconds(lambda made: model(**made.to(device)),
                                           self.processor) if self.sampling_rate else None
        self.rendered = (None, None)

    def inputs(self, request):
        if self.rendered[0] is not request:
            text = self.processor.apply_chat_template(request.messages, add_generation_prompt=True,
                                                      **self.template_kwargs)
            clips = list(request.clips)
            heard = dict(audio=clips, audio_kwargs=audio_kwargs(self.processor, clips)) if clips else {}
            inputs = self.processor(text=[text], images=[request.images] if request.images else None,
                                    return_tensors="pt", **heard)
            inputs.pop(WINDOWS, None)  # each clip's windows (`WindowedAudio`): no model input
            self.rendered = request, inputs
        return self.rendered[1]

    def refusal(self, request) -> str | None:
        return too_long(self.inputs(request)["input_ids"].shape[1], self.model.config)

    @torch.no_grad()
    def __call__(self, request, max_new_tokens):
        if request.filler:  # no collective to stay in step with: nothing to do
            return None
        inputs = self.inputs(request).to(self.device)
        output = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return self.processor.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]


def main(argv=None):
    model_args, bench_args = parse_args((ModelArgs, BenchmarkArgs), argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = model_args.device or (f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    benchmarks = Benchmarks(bench_args, rank, world)
    if not benchmarks:
        raise SystemExit("--benchmarks: name at least one task")
    # a checkpoint-N, a folder without a model: named before loading
    config = model_config(model_args.model, "--model")
    # AutoModelForMultimodalLM's class for a model that only hears
    model_class = trained_class(config) or AutoModelForImageTextToText
    model = pretrained(model_class, model_args.model, "--model").to(device).eval()
    answer = GeneratedAnswers(model, AutoProcessor.from_pretrained(model_args.model), device,
                              model_args.chat_template_kwargs)
    # the template the answers are rendered with (Voxtral's lives on its tokenizer: `WindowedAudio`)
    check_template_kwargs(model_args.chat_template_kwargs, answer.processor.chat_template,
                          answer.processor.tokenizer.special_tokens_map)
    benchmarks.check_answerer(answer)
    benchmarks.rendered_with(answer)
    if rank == 0:
        print(benchmarks.describe())
    scores = benchmarks.run(answer)
    if rank == 0:
        for line in benchmarks.card_lines():
            print(line)
        if model_args.output:
            with open(model_args.output, "w") as output:
                json.dump(scores, output, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return scores


if __name__ == "__main__":
    main()
