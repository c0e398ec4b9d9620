"""Sampling a prompt's completions for GRPO, alike on any number of ranks.

- Seeds (`prompt_seed`): each completion draws from its own generator, seeded from the run's seed, the step, the
  prompt's tokens and pixels and its index in the group, so one process and W ranks sample the same completions
  however the data is split, a resume samples what the straight run sampled, and a prompt met again in a later
  epoch draws afresh.
- Where the model is whole on a rank (DDP, ZeRO-1/2, one process, ZeRO-3 with `ds3_gather_for_generation`:
  `mmrecipes.distributed.model_for_sampling`), `generate_group` samples with transformers' `generate` and its KV
  cache; `RowSampler`, its last logits processor, draws each row's token and leaves greedy search only that one.
- Where every forward gathers parameters (FSDP2, ZeRO-3 without the gather), `sample_group` samples a token at a
  time by whole-sequence forwards of the prepared model without a cache (as the evaluation's greedy decoding), until
  every rank's completions have stopped: a rank whose completions end early keeps forwarding (`generate`'s
  `synced_gpus`) and a text-only prompt carries the dummy image, so the ranks' collectives never part.
- Both draw the same tokens (tests/test_grpo.py). A vLLM server would replace them (prompts in, completions out);
  none runs here, so there is none.
"""

import zlib

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..distributed import max_over_ranks
from ..images import to_device
from .arguments import GRPOArgs
from .chat_data import CHAT_COUNTED
from .evaluation import with_token_appended
from .losses import IGNORE_INDEX
from .models import logits


def prompt_seed(seed: int, prompt: dict) -> int:
    """A seed from `seed` (the run's seed + the step), the prompt's tokens and its pixels: the same prompt samples
    alike on any rank."""
    digest = zlib.crc32(prompt["input_ids"].numpy().tobytes(), seed & 0xFFFFFFFF)
    for key in sorted(prompt["media_inputs"]):
        value = prompt["media_inputs"][key]
        if isinstance(value, torch.Tensor):
            digest = zlib.crc32(value.contiguous().numpy().tobytes(), digest)
    return digest


def chat_rows(prompt: dict, completions: list[list[int]], labelled: list[bool]) -> list[dict]:
    """Collator rows (`ChatCollator`) of a prompt and its completions: the completion tokens are the targets (none
    where `labelled` is False: a masked truncated completion)."""
    rows = []
    for completion, target in zip(completions, labelled):
        tokens = torch.tensor(completion, dtype=prompt["input_ids"].dtype)
        labels = torch.cat([torch.full_like(prompt["input_ids"], IGNORE_INDEX),
                            tokens if target else torch.full_like(tokens, IGNORE_INDEX)])
        rows.append({"input_ids": torch.cat([prompt["input_ids"], tokens]), "labels": labels,
                     "media_inputs": prompt["media_inputs"]} | dict.fromkeys(CHAT_COUNTED, 0))
    return rows


@torch.no_grad()
def sample_group(model, prompt: dict, collator, args: GRPOArgs, stop_ids, seed: int, device, suppressed=(),
                 indices=None, live=True):
    """[(completion token ids, truncated)] of the completions `indices` (default: all --num_generations) of
    `prompt`'s group, each from its own generator (`seed` + its index), sampled at --temperature within --top_p
    (never a `suppressed` token: `placeholder_token_ids`), each up to its first stop token (included) or
    --max_completion_length tokens (truncated), with forwards until every rank's completions have stopped (`live`
    False: a filler whose completions count as stopped, forwarded only while another rank samples)."""
    indices = range(args.num_generations) if indices is None else indices
    inputs = to_device(collator(chat_rows(prompt, [[]] * len(indices), [False] * len(indices))), device)
    sampler = RowSampler(indices, seed, args, suppressed)
    completions, stopped = [[] for _ in indices], [not live] * len(indices)
    for _ in range(args.max_completion_length):
        if not max_over_ranks(torch.tensor(float(not all(stopped)), device=device)).item():
            break  # every rank's completions have stopped
        tokens = torch.tensor(sampler.draw(logits(model, inputs)[:, -1]))
        for index, token in enumerate(tokens.tolist()):
            if not stopped[index]:
                completions[index].append(token)
                stopped[index] = token in stop_ids
        inputs = with_token_appended(inputs, tokens.to(device))
    return [(completion, not done) for completion, done in zip(completions, stopped)]


@torch.no_grad()
def generate_group(model, prompt: dict, collator, args: GRPOArgs, stop_ids, seed: int, device, suppressed=(),
                   indices=None):
    """What `sample_group` samples, by `generate` with a KV cache, on a `VLMForTraining` whole on this rank (no
    collective in its forward: `model_for_sampling`): the prompt as the processor gave it (a text-only prompt
    without the dummy image, which only keeps sharded ranks in step), each completion's token drawn from its own
    generator (`RowSampler`, which leaves greedy search only that token)."""
    indices = range(args.num_generations) if indices is None else indices
    batch = to_device(collator(chat_rows(prompt, [[]] * len(indices), [False] * len(indices))), device)
    dummies = (model.vision_input_names if batch["dummy_image"] else set()) | (
        {"pixel_values_videos"} if batch.get("dummy_video") else set())
    inputs = {name: value for name, value in batch.items() if name in model.forward_input_names - dummies - {"labels"}}
    config = GenerationConfig(max_new_tokens=args.max_completion_length, do_sample=False, eos_token_id=list(stop_ids),
                              pad_token_id=collator.pad_token_id)
    sampler = RowSampler(indices, seed, args, suppressed)
    generated = model.model.generate(**inputs, generation_config=config, synced_gpus=False,
                                     logits_processor=LogitsProcessorList([sampler]))
    completions = []
    for row in generated[:, inputs["input_ids"].shape[1]:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stop_ids), None)
        completions.append((row[:end], False) if end else (row[:args.max_completion_length], True))
    return completions


class RowSampler(LogitsProcessor):
    """Each row's next token (`draw`), the row of completion `indices[i]` from its own generator (`seed` + that
    index), at --temperature within --top_p, never a `suppressed` token. Both samplers draw with it; as `generate`'s
    last logits processor it leaves only the drawn token a finite score, for greedy search to take."""

    def __init__(self, indices, seed: int, args: GRPOArgs, suppressed=()):
        self.generators = [torch.Generator().manual_seed(seed + index) for index in indices]
        self.args, self.suppressed = args, list(suppressed)

    def draw(self, scores: torch.Tensor) -> list[int]:
        logits = scores.float().cpu()
        logits[:, self.suppressed] = -torch.inf
        return [_sampled(row, generator, self.args.temperature, self.args.top_p)
                for row, generator in zip(logits, self.generators)]

    def __call__(self, input_ids, scores):
        tokens = self.draw(scores)
        chosen = torch.full_like(scores, -torch.inf)
        chosen[torch.arange(len(tokens), device=scores.device), torch.tensor(tokens, device=scores.device)] = 0.0
        return chosen


def _sampled(logits: torch.Tensor, generator, temperature: float, top_p: float) -> int:
    probabilities = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:  # the smallest set of most likely tokens whose probability reaches top_p
        ordered, order = probabilities.sort(descending=True)
        keep = ordered.cumsum(0) - ordered < top_p
        probabilities = torch.zeros_like(probabilities).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probabilities, 1, generator=generator))
