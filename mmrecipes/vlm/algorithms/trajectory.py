"""A multi-turn completion (`Trajectory`): the model's tokens and the tools' results as token ids after its prompt,
which tokens are the model's (the only targets), the tools' images' inputs, and the completion as reward functions
get it (TRL's messages). Built by the sampler (`sampling.Sampler.tool_turns`) with `tools.Tools`."""

from dataclasses import dataclass, field

import torch

from ...images import NORMALIZED_BY
from ..rows.chat_data import TOKEN_ALIGNED
from ..rows.labels import IGNORE_INDEX
from .tools import ToolFormat


@dataclass
class Trajectory:
    """One completion over its turns: its tokens after the prompt (the model's and the tools'), which are the
    model's (`own`), the tools' images' inputs in order, and the completion as reward functions get it (`messages`)."""

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

    def add_turn(self, tokens: list, truncated: bool, tool_format: ToolFormat, tokenizer):
        self.ids += tokens
        self.own += [True] * len(tokens)
        self.truncated = truncated
        text = tokenizer.decode([token for token in tokens if token not in tool_format.stop_ids])
        content, calls = tool_format.parse(text)
        self.pending = [] if truncated else calls
        message = {"role": "assistant", "content": content if calls else text.strip()}
        self.messages.append(message | ({"tool_calls": [{"type": "function", "function": {
            "name": name, "arguments": arguments}} for name, arguments in calls if name]} if calls else {}))

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
        """The prompt's image inputs, then each tool turn's (per-token ones placed at their tokens)."""
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
        """The collator row to train on: the model's tokens its targets (none where not `labelled`)."""
        state = self.state()
        own = torch.tensor(self.own, dtype=torch.bool) & labelled
        completion = torch.tensor(self.ids, dtype=state["input_ids"].dtype)
        labels = torch.cat([torch.full_like(self.prompt["input_ids"], IGNORE_INDEX),
                            torch.where(own, completion, torch.full_like(completion, IGNORE_INDEX))])
        return {"input_ids": state["input_ids"], "labels": labels, "media_inputs": state["media_inputs"]}
