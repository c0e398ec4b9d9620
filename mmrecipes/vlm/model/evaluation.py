"""Evaluation every rank agrees on: answer exact match, teacher-forced and by greedy generation from
the processor's own prompt, and benchmark answers (`BenchmarkAnswers`), each rank forwarding as
often as every other."""

import torch

from ...audio import heard_rate
from ...benchmarks.harness import too_long
from ...benchmarks.scoring import reasoning_of, without_reasoning
from ...distributed import batches_in_step, max_over_ranks, sum_over_ranks
from ...images import to_device
from ..rows.chat_data import TOKEN_ALIGNED, prompt_row
from ..rows.collate import ChatCollator
from ..rows.held_out import HeldOut
from ..rows.labels import IGNORE_INDEX
from .outputs import Logits


@torch.no_grad()
def evaluate_answers(model, eval_loader, filler_batch, device) -> dict:
    """Exact-match accuracy of the answers (the labelled tokens, up to and including the
    end-of-turn token), summed over every rank's share of the eval set ({} if it is empty).

    Scored in one teacher-forced forward per batch: greedy decoding reproduces an answer exactly
    when the argmax at every answer position is the answer's next token, which is what this
    checks. One forward per batch keeps every rank's collectives (FSDP2, ZeRO-3) in step, where
    `generate` would stop after a different number of tokens on each rank. A rank that has run
    out forwards `filler_batch` and discards the result (`batches_in_step`).
    """
    model.eval()
    totals = torch.zeros(2, device=device)  # correct answers, answers
    for batch, real in batches_in_step(eval_loader, filler_batch, device):
        inputs = to_device(batch, device)
        predicted = model(inputs, Logits())[:, :-1].argmax(-1)
        if real:
            targets = inputs["labels"][:, 1:]
            scored = targets != IGNORE_INDEX
            correct = ((predicted == targets) | ~scored).all(dim=1) & scored.any(dim=1)
            totals += torch.stack([correct.sum(), scored.any(dim=1).sum()]).float()
    model.train()
    correct, answers = sum_over_ranks(totals).tolist()
    return {"answer_accuracy": correct / answers, "eval_answers": int(answers)} if answers else {}


@torch.no_grad()
def evaluate_generation(model, prompts, filler, collator, tokenizer, stop_token_ids, device,
                        placeholders=()) -> dict:
    """Greedy generation, exact match: the share of `prompts` (`chat_data.HeldOut`s from
    `chat_data.generation_prompts`: the processor's own generation prompt) whose generated text, up
    to the first stop token and without special tokens, is the answer, read after any reasoning (as
    lmms-eval reads a benchmark's answers: `scoring.without_reasoning`). It reads no label, so it
    catches labels that teach anything else (a missing first token, shifted spans), which the
    teacher-forced accuracy cannot. Where held-out rows reason, `generated_with_reasoning` is the
    share of answers the model gave after reasoning of its own (a thinking model asked to think).

    Decoded one row at a time with whole-sequence forwards of the prepared model and no cache, for
    the same number of tokens on every rank (the longest answer anywhere with its reasoning, and a stop), so
    the collectives of FSDP2 and ZeRO-3 stay in step; a rank with no prompt left decodes `filler` (a
    batch) and discards it. Never emits one of the `placeholders`
    (`families.placeholder_token_ids`).
    """
    model.eval()
    # room for the longest reasoned answer (its reasoning, and 4 tokens for the closing tag and the lines around it)
    longest = max((len(tokenizer(held.reasoning, add_special_tokens=False)["input_ids"]) + 4 * bool(held.reasoning)
                   + len(tokenizer(held.answer, add_special_tokens=False)["input_ids"]) for held in prompts), default=0)
    # a space, the stop
    new_tokens = int(max_over_ranks(torch.tensor(float(longest), device=device)).item()) + 2
    # exact answers, prompts, answers given after reasoning, held-out rows that reason
    totals = torch.zeros(4, device=device)
    stops = set(stop_token_ids)
    batches = ((collator([held.prompt]), held) for held in prompts)
    # A packed filler decodes unpacked: its outputs are discarded, and appending would break its segments.
    filler = {key: value for key, value in filler.items() if key not in ("sample_lengths", "media_per_sample")}
    for (batch, (_, answer, reasoning)), real in batches_in_step(batches, (filler, HeldOut(None, "", "")), device):
        generated = greedy_tokens(model, to_device(batch, device), new_tokens, placeholders)
        if real:
            ended = next((i for i, token in enumerate(generated) if token in stops), len(generated))
            text = tokenizer.decode(generated[:ended], skip_special_tokens=True)
            totals += torch.tensor([float(without_reasoning(text) == answer), 1.0, float(bool(reasoning_of(text))),
                                    float(bool(reasoning))], device=device)
    model.train()
    correct, count, reasoned, reasoning_rows = sum_over_ranks(totals).tolist()
    if not count:
        return {}
    # where the held-out rows reason (a thinking model's), the share of answers given after reasoning
    return {"generated_accuracy": correct / count, "eval_generated": int(count)} | (
        {"generated_with_reasoning": reasoned / count} if reasoning_rows else {})


def greedy_tokens(model, inputs: dict, new_tokens: int, placeholders=(), stops=None, running=True) -> list[int]:
    """The `new_tokens` tokens greedy decoding appends to a one-row batch (`VLMForTraining` inputs),
    stop tokens included: what `generate(do_sample=False)` gives, by whole-sequence forwards without
    a cache, never one of the `placeholders` (`families.placeholder_token_ids`: appended, one would
    not match the images). Given `stops`, it ends early, in step over the ranks: once every rank's
    row has given a stop token (one all-reduce a token; a rank decoding a filler passes `running`
    False)."""
    generated, never = [], torch.tensor(list(placeholders), dtype=torch.long, device=inputs["input_ids"].device)
    for _ in range(new_tokens):
        if stops is not None and not max_over_ranks(torch.tensor(float(running), device=never.device)).item():
            break
        token = model(inputs, Logits())[:, -1].index_fill(-1, never, -torch.inf).argmax(-1)
        generated.append(int(token[0]))
        inputs = with_token_appended(inputs, token)
        if stops is not None:
            running = running and generated[-1] not in stops
    return generated


class BenchmarkAnswers:
    """`answer(request, max_new_tokens)` for `mmrecipes.benchmarks.Benchmarks.run` by the prepared
    model: the request through the processor's own chat template (`chat_data.prompt_row`), greedy
    decoding in step over the ranks until every rank's answer has stopped (`greedy_tokens`; a filler
    counts as stopped), the text up to the first stop token, special tokens left out (what
    lmms-eval's Hugging Face models decode). `refusal`: a request whose prompt alone runs past the
    language model's positions is refused before any forward. `sampling_rate`: the rate a model
    that hears reads its clips at (None: it does not hear); `clip_seconds`: the longest clip it reads (None: any)."""

    def __init__(self, model, vlm, device, template_kwargs=None):
        self.model, self.vlm, self.device = model, vlm, device
        self.template_kwargs = template_kwargs  # --chat_template_kwargs
        self.sampling_rate = heard_rate(vlm.model, vlm.processor)
        self.clip_seconds = vlm.audio_window  # a longer clip is counted, never cut
        self.collator = ChatCollator(vlm.processor.tokenizer.pad_token_id, vlm.dummy_inputs)
        # the last request and its row: refusal renders what answering reads next
        self.rendered = (None, None)

    def row(self, request) -> dict:
        if self.rendered[0] is not request:
            row = prompt_row(self.vlm.processor, request.messages, request.images,
                             template_kwargs=self.template_kwargs, audios=request.clips)
            self.rendered = request, row
        return self.rendered[1]

    def refusal(self, request) -> str | None:
        return too_long(len(self.row(request)["input_ids"]), self.vlm.model.config)

    @torch.no_grad()
    def __call__(self, request, max_new_tokens: int) -> str:
        inputs = to_device(self.collator([self.row(request)]), self.device)
        self.model.eval()
        stops = set(self.vlm.stops)
        generated = greedy_tokens(self.model, inputs, max_new_tokens, self.vlm.placeholders, stops, not request.filler)
        self.model.train()
        ended = next((index for index, token in enumerate(generated) if token in stops), len(generated))
        return self.vlm.processor.tokenizer.decode(generated[:ended], skip_special_tokens=True)


def with_token_appended(inputs: dict, token: torch.Tensor) -> dict:
    """The model inputs with `token` appended to every row: a text token (no image, not a
    target)."""
    extended = dict(inputs)
    column = token[:, None]
    extended["input_ids"] = torch.cat([inputs["input_ids"], column], dim=1)
    extended["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(column)], dim=1)
    extended["labels"] = torch.cat([inputs["labels"], torch.full_like(column, IGNORE_INDEX)], dim=1)
    for key in TOKEN_ALIGNED[2:]:  # per-token inputs beside the ids and the mask
        if key in inputs:
            extended[key] = torch.cat([inputs[key], torch.zeros_like(column)], dim=1)
    return extended
