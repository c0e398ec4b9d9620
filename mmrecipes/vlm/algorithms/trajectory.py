"""A completion (`Trajectory`): the model's tokens after its prompt over one turn or several, the
tools' results between turns as token ids, which tokens are the model's (the only targets), the
tools' images' inputs, and a multi-turn completion as reward functions get it (TRL's messages).
`first_turns` samples every completion's first turn from its prompt (`sampling.Sampler` samples;
`tools.Tools` goes on over the tools' turns); `prompt_seed` is what a prompt's completions draw
from."""

import zlib
from dataclasses import dataclass, field

import torch

from ...images import NORMALIZED_BY
from ..rows.chat_data import TOKEN_ALIGNED
from ..rows.labels import IGNORE_INDEX


def prompt_seed(seed: int, prompt: dict) -> int:
    """A seed from `seed` (the run's seed + the step), the prompt's tokens and its pixels: the same
    prompt samples alike on any rank."""
    digest = zlib.crc32(prompt["input_ids"].numpy().tobytes(), seed & 0xFFFFFFFF)
    for key in sorted(prompt["media_inputs"]):
        value = prompt["media_inputs"][key]
        if isinstance(value, torch.Tensor):
            digest = zlib.crc32(value.contiguous().numpy().tobytes(), digest)
    return digest


def first_turns(draw, prompts, layout, seed: int) -> list:
    """A `Trajectory` per completion of this rank's pieces (`layout.pieces()`: a prompt's index and
    its completions'), its first turn sampled from its prompt's group (`draw`: the sampler's call,
    `Sampler.drawing`)."""
    pieces = [(prompts[index], indices) for index, indices in layout.pieces()]
    requests = [(prompt, prompt_seed(seed, prompt), indices, None) for prompt, indices in pieces]
    trajectories = []
    for (prompt, group_seed, indices, _), group in zip(requests, draw(requests)):
        for completion, (ids, cut) in zip(indices, group):
            trajectory = Trajectory(prompt, completion, group_seed)
            trajectory.add_turn(ids, cut)
            trajectories.append(trajectory)
    return trajectories


@dataclass
class Trajectory:
    """One completion over its turns: its tokens after the prompt (the model's and the tools'),
    which are the model's (`own`), the tools' images' inputs in order, and, multi-turn, the
    completion as reward functions get it (`messages`: `tools.Tools.read` writes them) and the calls
    of its last turn (`pending`)."""

    prompt: dict
    index: int  # its completion's index in its group (its generator's)
    seed: int  # its group's
    ids: list = field(default_factory=list)
    own: list = field(default_factory=list)
    media: list = field(default_factory=list)
    messages: list = field(default_factory=list)
    truncated: bool = False
    environment: object = None
    pending: list = field(default_factory=list)  # the calls of its last turn

    def add_turn(self, tokens: list, truncated: bool):
        """The model's tokens of a turn (the first, or one after tool results), truncated or not."""
        self.ids += tokens
        self.own += [True] * len(tokens)
        self.truncated = truncated

    def add_results(self, results: list, tokens: torch.Tensor, media: dict):
        self.ids += tokens.tolist()
        self.own += [False] * len(tokens)
        self.media.append((len(self.prompt["input_ids"]) + len(self.ids) - len(tokens), media))
        self.messages += [{"role": "tool", "name": name, "content": content} for name, content in results]
        self.pending = []

    def state(self) -> dict:
        """Where the model goes on from: the prompt with every turn so far, as a prompt."""
        tokens = torch.cat([self.prompt["input_ids"], torch.tensor(self.ids, dtype=self.prompt["input_ids"].dtype)])
        return {"input_ids": tokens, "media_inputs": self.media_inputs(len(tokens))}

    def media_inputs(self, length: int) -> dict:
        """The prompt's image inputs, then each tool turn's (per-token ones placed at their
        tokens)."""
        pieces = [(0, self.prompt["media_inputs"]), *self.media]
        merged = {}
        for key in {key for _, media in pieces for key in media}:
            values = [media[key] for _, media in pieces if key in media]
            if key in TOKEN_ALIGNED:
                row = torch.zeros(length, dtype=values[0].dtype)
                for start, media in pieces:
                    if key in media:
                        row[start:start + len(media[key])] = media[key]
                merged[key] = row
            elif key in NORMALIZED_BY.values():  # constants, the same for every image
                merged[key] = values[0]
            else:
                merged[key] = torch.cat(values)
        return merged

    def row(self, labelled: bool) -> dict:
        """The collator row to train on: the model's tokens its targets (none where not
        `labelled`)."""
        state = self.state()
        own = torch.tensor(self.own, dtype=torch.bool) & labelled
        completion = torch.tensor(self.ids, dtype=state["input_ids"].dtype)
        labels = torch.cat([torch.full_like(self.prompt["input_ids"], IGNORE_INDEX),
                            torch.where(own, completion, torch.full_like(completion, IGNORE_INDEX))])
        return {"input_ids": state["input_ids"], "labels": labels, "media_inputs": state["media_inputs"]}
