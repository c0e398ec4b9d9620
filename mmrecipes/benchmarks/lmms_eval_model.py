"""lmms-eval's model interface around a live model, for its whole task suite (`pip install
"mmrecipes[benchmarks]"`).

    from lmms_eval.evaluator import simple_evaluate
    from mmrecipes.benchmarks.lmms_eval_model import LiveModel
    from mmrecipes.vlm.model.evaluation import BenchmarkAnswers

    # in a recipe, on every rank: the prepared model answers in step over the ranks
    simple_evaluate(model=LiveModel(BenchmarkAnswers(model, vlm, accelerator.device),
    accelerator=accelerator),
                    tasks=["mmstar"], limit=100, distributed_executor_backend="torchrun")
    # a saved model from lmms-eval's command line (registered by the entry point group
    lmms_eval.models) lmms-eval --model mmrecipes --model_args pretrained=outputs/vlm_finetune
    --tasks mmstar

lmms-eval strides each task's documents over the ranks and pads every rank's requests to the most
any rank has, so each rank calls the answerer equally often, as `Benchmarks` does. Each request
becomes one user turn of its clips and images, then its text (the model's own chat template renders
it); the answer is cut at the first of the request's `until` strings. A clip is lmms-eval's decoded
{"array", "sampling_rate"} (resampled to the answerer's rate) or an undecoded {"bytes", "path"};
anything else a task shows (a video, a clip for a model that does not hear) is refused with the
reason, never left out of the prompt. Only `generate_until` tasks: log-likelihood and multi-round
requests are refused with the reason.
"""

import torch.distributed as dist
from lmms_eval.api.model import lmms
from lmms_eval.models.registry_v2 import ModelManifest
from PIL import Image

from ..audio import decode_audio, resampled
from .harness import MAX_CLIP_SECONDS, Request


def manifest() -> ModelManifest:
    """The entry point lmms-eval reads (pyproject.toml: `lmms_eval.models`): `--model mmrecipes`."""
    return ModelManifest(model_id="mmrecipes", simple_class_path=f"{__name__}.LiveModel")


def media_of(visuals, sampling_rate: int | None) -> tuple[list, list]:
    """The PIL images (as RGB) and clips (mono float32 at `sampling_rate`) of a `doc_to_visual`
    result, nested lists flattened; `ValueError` for anything else, or a clip that does not
    decode."""
    if isinstance(visuals, (list, tuple)):
        images, clips = [], []
        for visual in visuals:
            found = media_of(visual, sampling_rate)
            images, clips = images + found[0], clips + found[1]
        return images, clips
    if isinstance(visuals, Image.Image):
        return [visuals.convert("RGB")], []
    if isinstance(visuals, dict) and sampling_rate is not None:
        if "array" in visuals:
            return [], [resampled(visuals["array"], visuals["sampling_rate"], sampling_rate)]
        clip, problem = decode_audio(visuals, sampling_rate, MAX_CLIP_SECONDS)
        if clip is not None:
            return [], [clip]
        raise ValueError(f"a clip of the task: {problem}")
    raise ValueError(f"a {type(visuals).__name__} among the task's visuals: mmrecipes answers with "
                     "images, and with clips where the model hears")


class LiveModel(lmms):
    """lmms-eval's requests answered by `answer(request, max_new_tokens)`
    (`mmrecipes.benchmarks.harness.Request`): the recipes' `BenchmarkAnswers` on the prepared model,
    or, from lmms-eval's command line, `generate` on the saved model `pretrained`."""

    def __init__(self, answer=None, pretrained: str = "", device: str = "", accelerator=None, **unused):
        super().__init__()
        # its collectives' tensors
        self.device = device or (accelerator.device if accelerator is not None else "cpu")
        if answer is None:
            from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

            from ..saved_models import trained_class
            from .__main__ import GeneratedAnswers

            device = self.device
            model_class = trained_class(AutoConfig.from_pretrained(pretrained)) or AutoModelForImageTextToText
            model = model_class.from_pretrained(pretrained).to(device).eval()
            answer = GeneratedAnswers(model, AutoProcessor.from_pretrained(pretrained), device)
        # lmms-eval waits on its accelerator between requests
        self.answer, self.accelerator = answer, accelerator
        if dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    @property
    def rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world_size

    def generate_until(self, requests) -> list[str]:
        answers = []
        for instance in requests:
            context, settings, doc_to_visual, doc_id, task, split = instance.args
            images, clips = media_of(doc_to_visual(self.task_dict[task][split][doc_id]),
                                     getattr(self.answer, "sampling_rate", None))
            content = [{"type": "audio"}] * len(clips) + [{"type": "image"}] * len(images) + [
                {"type": "text", "text": context}]
            turn = [{"role": "user", "content": content}]
            request = Request(int(doc_id), turn, images, clips=clips)
            text = self.answer(request, int(settings.get("max_new_tokens", 1024)))
            until = settings.get("until") or []
            for stop in [until] if isinstance(until, str) else until:
                text = text.split(stop)[0]
            answers.append(text)
        return answers

    def loglikelihood(self, requests):
        raise NotImplementedError("mmrecipes answers generate_until tasks only: this task scores log-likelihoods")

    def generate_until_multi_round(self, requests):
        raise NotImplementedError("mmrecipes answers generate_until tasks only: this task is multi-round")
