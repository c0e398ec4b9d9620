"""Preference pairs for DPO of image-text-to-text models, and the DPO loss with TRL 1.16's names.

Rows: TRL's `prompt` / `chosen` / `rejected` (strings or conversations, with `images`), or LLaVA's
`conversations` with `chosen` and `rejected` answers. Each side becomes a chat row labelled by the
checkpoint's own chat template, exactly as in SFT; a pair with a bad side is skipped and counted by
that side's reason. A micro-batch holds the chosen rows, then the rejected ones: the policy and the
reference each run one forward over both, as TRL's concatenated forward.
"""

import hashlib

import torch
import torch.nn.functional as F

from ...distributed import batches_in_step, sum_over_ranks
from ...images import to_device
from ...skips import SKIPPED, Skip, data_counts
from ...sources import DATA_FILE, PROBLEM, row_name
from ..arguments import DPOArgs
from ..model.outputs import SequenceLogps
from ..rows.chat_data import CHAT_COUNTED, BadRow, ChatPreprocessor, string_prompt
from ..rows.labels import IGNORE_INDEX
from ..rows.media import AUDIO_COLUMNS
from .reference import Reference

PREFERENCE_COLUMNS = ["prompt", "chosen", "rejected", "images", "conversations", "image", *AUDIO_COLUMNS, "id"]
# What the DPO log counts: the SFT recipe's skips, and pairs whose answers are the same or one of them empty
PREFERENCE_COUNTED = (*CHAT_COUNTED, "no_preference")


def preference_chats(row) -> tuple[dict, dict]:
    """(chosen row, rejected row) in the chat or LLaVA format `ChatPreprocessor` reads; BadRow if
    neither fits. Both carry the row's audio columns (counted as audio there)."""
    audio = {column: row.get(column) for column in AUDIO_COLUMNS}
    if row.get("conversations") is not None:
        return tuple({"conversations": list(row["conversations"]) + [_llava_answer(row.get(side))],
                      "image": row.get("image"), DATA_FILE: row.get(DATA_FILE)} | audio
                     for side in ("chosen", "rejected"))
    prompt, images = row.get("prompt"), list(row.get("images") or [])
    if isinstance(prompt, str):
        prompt = [string_prompt(prompt, images)]
    if not isinstance(prompt, list) or not prompt:
        raise BadRow("no prompt and no conversations")
    return tuple({"messages": prompt + _chat_answer(row.get(side)), "images": images, DATA_FILE: row.get(DATA_FILE)}
                 | audio for side in ("chosen", "rejected"))


def _chat_answer(answer) -> list:
    if isinstance(answer, str):
        return [{"role": "assistant", "content": answer}]
    if isinstance(answer, list) and answer:
        return answer
    raise BadRow("a chosen or rejected answer is missing")


def _llava_answer(answer) -> dict:
    if isinstance(answer, str):
        return {"from": "gpt", "value": answer}
    if isinstance(answer, dict) and isinstance(answer.get("value"), str):
        return {"from": answer.get("from", "gpt"), "value": answer["value"]}
    raise BadRow("a chosen or rejected answer is missing")


def last_answer_only(side: tuple) -> tuple:
    """(input_ids, labels, media_inputs) of a side with only its last answer labelled: a multi-turn
    prompt's earlier assistant turns are context, not the completion (TRL scores only the
    completion)."""
    input_ids, labels, media_inputs = side
    targets = (labels != IGNORE_INDEX).nonzero()[:, 0]
    breaks = (targets[1:] - targets[:-1] > 1).nonzero()[:, 0]
    start = int(targets[breaks[-1] + 1]) if len(breaks) else 0
    return input_ids, torch.where(torch.arange(len(labels)) < start, IGNORE_INDEX, labels), media_inputs


class PreferencePreprocessor(ChatPreprocessor):
    """Batched map function: preference rows in, {chosen, rejected} rows out (each a collator row),
    bad pairs dropped and counted by the first bad side's reason."""

    COLUMNS = PREFERENCE_COLUMNS

    def __call__(self, batch):
        out = {"chosen": [], "rejected": [], SKIPPED: []}
        for row in (dict(zip(batch, values)) for values in zip(*batch.values())):
            try:
                if row.get(PROBLEM):  # what `load_stream` could not read
                    raise Skip(row[PROBLEM])
                (chosen, chosen_note), (rejected, rejected_note) = map(self.example, preference_chats(row))
                chosen, rejected = last_answer_only(chosen), last_answer_only(rejected)
                self.check_preference(chosen, rejected)
            except Skip as skip:
                self.drops.drop(skip, row_name(row))
                continue
            for key, (input_ids, labels, media_inputs) in (("chosen", chosen), ("rejected", rejected)):
                out[key].append({"input_ids": input_ids, "labels": labels, "media_inputs": media_inputs})
            out[SKIPPED].append(self.drops.keep(chosen_note or rejected_note))
        return out

    def check_preference(self, chosen, rejected):
        """Skip (no_preference) a pair whose answers are the same tokens, or one of which says
        nothing (TRL trains on such pairs; they teach no preference)."""
        answers = [input_ids[labels != IGNORE_INDEX] for input_ids, labels, _ in (chosen, rejected)]
        if torch.equal(*answers):
            raise Skip("no_preference", "the chosen and rejected answers are the same")
        for side, answer in zip(("chosen", "rejected"), answers):
            if not self.labeller.tokenizer.decode(answer, skip_special_tokens=True).strip():
                raise Skip("no_preference", f"the {side} answer is empty")

    @staticmethod
    def check_columns(name, available):
        if available is not None and not ({"prompt", "chosen", "rejected"} <= set(available)
                                          or {"conversations", "chosen", "rejected"} <= set(available)):
            raise ValueError(f"{name} has columns {available}: a preference source needs 'prompt', 'chosen' and "
                             "'rejected' (+ 'images'), or LLaVA's 'conversations' with 'chosen' and 'rejected'")


# How the log line writes DPO's metrics (TRL's names)
DPO_FORMATS = {"rewards/accuracies": ".3f", "logps/chosen": ".4f", "logps/rejected": ".4f",
               **dict.fromkeys(("rewards/chosen", "rewards/rejected", "rewards/margins"), ".5f")}


class PreferenceCollator:
    """Pairs -> one `ChatCollator` batch: the chosen rows, then the rejected rows (`num_samples`
    counts pairs, the data counts the pairs' `PREFERENCE_COUNTED`); with `keys`, each pair's
    `pair_key` too (precomputed reference log-probabilities are looked up by it)."""

    def __init__(self, collator, keys: bool = False):
        self.collator, self.keys = collator, keys

    def __call__(self, pairs):
        batch = self.collator([pair["chosen"] for pair in pairs] + [pair["rejected"] for pair in pairs])
        batch["num_samples"] = len(pairs)  # what the DPO loss averages over, and samples/s counts
        batch["data_counts"] = data_counts(pairs, PREFERENCE_COUNTED)
        if self.keys:
            batch["pair_keys"] = [pair_key(pair["chosen"], pair["rejected"]) for pair in pairs]
        return batch


def answer_tokens(inputs: dict) -> torch.Tensor:
    """Each row's answer tokens (after the shift), on the device."""
    return (inputs["labels"][:, 1:] != IGNORE_INDEX).sum(1).clamp_min(1)


def dpo_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, tokens: torch.Tensor, args: DPOArgs):
    """(per-pair losses, chosen rewards, rejected rewards) of `[2 * pairs]` summed log-probabilities
    and answer `tokens`, chosen rows first: TRL 1.16's `DPOTrainer._compute_loss` for its loss types
    `sigmoid`, `ipo` (on log-ratios averaged over each answer's tokens), `robust` and `sft` (each
    chosen answer's mean token NLL; TRL averages over a micro-batch's tokens, which cannot be
    normalised exactly across ranks), summed with their weights. Rewards are beta times the summed
    log-ratios, whatever the loss (as TRL logs them)."""
    chosen, rejected = (policy_logps - reference_logps).chunk(2)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    margin, smoothing = args.beta * (chosen - rejected), args.label_smoothing
    losses = torch.zeros_like(chosen)
    for name, weight in args.losses.items():
        if name == "sigmoid":  # label_smoothing: the deprecated conservative DPO
            term = -F.logsigmoid(margin) * (1 - smoothing) - F.logsigmoid(-margin) * smoothing
        elif name == "robust":
            term = (-F.logsigmoid(margin) * (1 - smoothing) + F.logsigmoid(-margin) * smoothing) / (1 - 2 * smoothing)
        elif name == "ipo":
            term = (chosen / chosen_tokens - rejected / rejected_tokens - 1 / (2 * args.beta)) ** 2
        else:  # sft
            term = -policy_logps.chunk(2)[0] / chosen_tokens
        losses = losses + weight * term
    return losses, args.beta * chosen.detach(), args.beta * rejected.detach()


def pair_key(chosen: dict, rejected: dict) -> str:
    """A pair's identity across epochs and resumes: a digest of both sides' tokens and the images'
    inputs."""
    digest = hashlib.sha1()
    for tensor in (chosen["input_ids"], rejected["input_ids"], *chosen["media_inputs"].values()):
        digest.update(torch.as_tensor(tensor).flatten().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def evaluate_preferences(model, reference: Reference, eval_loader, filler_batch, args: DPOArgs, device) -> dict:
    """{eval_rewards/accuracies, eval_rewards/margins, eval_pairs} over every rank's held-out pairs:
    the share whose chosen reward beats the rejected one, and the mean margin. Every rank forwards
    equally often (a rank that has run out forwards `filler_batch`: `batches_in_step`)."""
    model.eval()
    totals = torch.zeros(3, device=device)  # correct pairs, summed margins, pairs
    for batch, real in batches_in_step(eval_loader, filler_batch, device):
        inputs = to_device(batch, device)
        _, chosen, rejected = dpo_loss(model(inputs, SequenceLogps()), reference(batch, inputs), answer_tokens(inputs),
                                       args)
        if real:
            margins = chosen - rejected
            totals += torch.stack([(margins > 0).sum(), margins.sum(), torch.tensor(len(margins), device=device)])
    model.train()
    correct, margins, pairs = sum_over_ranks(totals).tolist()
    if not pairs:
        return {}
    return {"eval_rewards/accuracies": correct / pairs, "eval_rewards/margins": margins / pairs,
            "eval_pairs": int(pairs)}
