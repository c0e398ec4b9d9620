"""Mixture-of-experts VLMs (Qwen3-VL-MoE, Qwen3.5-MoE, Gemma 4's 26B-A4B): the load-balancing loss,
and the sparse blocks the engines must treat as one (docs/vlm.md, "Mixture-of-experts models").

The routers are the modules transformers records `router_logits` from (the model's
`_can_record_outputs`), the sparse blocks their parents: read from the model, never from a name.

The loss is Switch Transformer's, as transformers' MoE families compute it
(`load_balancing_loss_func`): over the real tokens of every MoE layer, f_e = the share of the top-k
choices that go to expert e (counts: no gradient) and P_e = the mean router probability of e; aux =
E * sum_e f_e * P_e (k when the load is even), times the checkpoint's `router_aux_loss_coef` or
--router_aux_loss_coef. Its two scopes:
- `micro_batch`, the model's own: each micro-batch's aux, as `forward(...,
  output_router_logits=True)` gives it (but over real tokens only: a packed batch passes the model
  no mask), averaged over the window's micro-batches and ranks: no world-size factor, no sum over
  micro-batches;
- `global_batch` (Qwen's global-batch load balancing, 2025): f_e and P_e over every real token of
  the optimizer step on every rank, so W ranks x k micro-batches give one process's loss and
  gradients. f must be known before the first backward: with k > 1 micro-batches the window is first
  run without gradients to count the choices (one forward more each), then one all-reduce of the
  counts; with k = 1 the counts of the micro-batch itself are all-reduced.
Split over a sequence-parallel group, each rank routes its shard's tokens and the parts are summed
over the group (the probabilities by the differentiable all-reduce the loss uses), so each rank
holds its micro-batch's whole routing, as an unsplit rank does; the rows a group read count once in
the global scope's sums.
"""

import torch

from ...distributed import Ranks
from ...images import to_device
from ...reporting import ratio
from ..arguments import MoEArgs
from .outputs import StepOutput


def router_class(model):
    """The module class whose output transformers records as `router_logits` (the model's, or its
    language model's, `_can_record_outputs`), if the model holds one of them."""
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        if target is not None and any(isinstance(m, target) for m in model.modules()):
            return target
    return None


def sparse_block_classes(model) -> set[type]:
    """The classes of the modules that hold a router and the experts it picks from (Qwen's
    SparseMoeBlock; Gemma 4's decoder layer): an engine must gather each as one (ZeRO-3's leaf
    modules), as ranks route to different experts."""
    router = router_class(model)
    if router is None:
        return set()
    return {type(parent) for parent in model.modules() for child in parent.children() if isinstance(child, router)}


def inactive_expert_params(model) -> float:
    """The expert weights a token does not run (FLOPs): (1 - k / E) of the sparse blocks' fused
    expert parameters."""
    blocks = tuple(sparse_block_classes(model))
    config = model.config.get_text_config()
    experts = getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k_experts", None)
    if not blocks or not experts or not top_k:
        return 0.0
    fused = sum(param.numel() for module in model.modules() if isinstance(module, blocks)
                for param in module.parameters() if param.ndim == 3 and param.shape[0] == experts)
    return fused * (1 - top_k / experts)


def routing(router_logits, mask: torch.Tensor | None, top_k: int):
    """(choices per expert, summed router probabilities per expert, rows) over every layer's real
    tokens: the parts of the loss. `router_logits`: one `[tokens, experts]` tensor per MoE layer;
    `mask`: 1 for a real token."""
    weights = None if mask is None else mask.reshape(-1).float()
    counts = probabilities = rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        real = torch.ones(len(probs), device=probs.device) if weights is None else weights.to(probs.device)
        chosen = probs.topk(top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.zeros(probs.shape[-1], device=probs.device).index_add(
            0, chosen, real.repeat_interleave(top_k))
        probabilities = probabilities + (probs * real[:, None]).sum(dim=0)
        rows = rows + real.sum()
    return counts.detach(), probabilities, rows.detach()


def balance_loss(counts, probabilities, rows) -> torch.Tensor:
    """E * sum_e f_e * P_e from the choices and probabilities summed over `rows` (token, layer)
    pairs."""
    return len(counts) * torch.sum(counts / rows * probabilities / rows)


class Routing(StepOutput):
    """What the routers did over the batch's real tokens: (choices per expert, summed router
    probabilities per expert, rows), the parts of the load-balancing loss (`routing`); a forward of
    its own, without gradients. Split, each rank routes its shard and the parts are summed over the
    group."""

    splits = True
    trains = False
    routing = True

    def __init__(self, top_k: int):
        self.top_k = top_k

    def compute(self, forward) -> tuple:
        return routing(forward.router_logits, forward.token_mask, self.top_k)

    def reduce(self, value: tuple, shard) -> tuple:
        return tuple(shard.sum(part) for part in value)


class LoadBalance:
    """The load-balancing term of a MoE model's training loss (`of`; `on` False where there is none,
    and then every method below does nothing). It rides on the step's `outputs.LossSum`:
    `start_window(model, window, device)` before a window's micro-batches (the global scope's
    counts), then each forward's `term(routing)`: what to back-propagate beside the CE (the engine's
    averaging over the accumulation steps and ranks already cancelled), its value kept for the log
    (`window_sums`, `metrics`: `aux_loss`)."""

    FORMATS = {"aux_loss": ".6f"}  # how the log line writes `metrics`

    def __init__(self, num_experts: int = 0, top_k: int = 0, coef: float = 0.0, scope: str = "micro_batch",
                 accumulation: int = 1, ranks: Ranks | None = None, line: str = ""):
        self.num_experts, self.top_k, self.coef, self.scope = num_experts, top_k, coef, scope
        self.accumulation, self.ranks, self.line = accumulation, ranks or Ranks(), line
        self.window_counts, self.values = None, []

    @property
    def on(self) -> bool:
        return self.coef > 0

    @classmethod
    def of(cls, model, args: MoEArgs, accumulation: int, ranks) -> "LoadBalance":
        """The term over `ranks`' data-parallel ranks (`distributed.Ranks`), off where the model has
        no routers or --router_aux_loss_coef is 0, with the log line that says which (`line`). A
        model without routers, or whose config defines no load-balancing loss, refuses a
        coefficient."""
        coef, scope = args.router_aux_loss_coef, args.router_aux_loss_scope
        config = model.config.get_text_config()
        own = getattr(config, "router_aux_loss_coef", None)
        if router_class(model) is None:
            if coef:
                raise ValueError(f"--router_aux_loss_coef {coef}: {type(model).__name__} has no experts to balance; "
                                 "leave it at 0")
            return cls()
        experts = getattr(config, "num_experts", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        if own is None or experts is None or top_k is None:
            if coef:
                raise ValueError(f"--router_aux_loss_coef {coef}: {type(model).__name__}'s config defines no "
                                 "load-balancing loss (no router_aux_loss_coef, num_experts, num_experts_per_tok); "
                                 "leave it at 0")
            return cls(line=f"mixture of experts: {type(model).__name__} defines no load-balancing loss; none is added")
        line = f"mixture of experts: {experts} experts, {top_k} per token; load-balancing loss "
        if not coef:
            return cls(experts, top_k, line=line + (f"off (--router_aux_loss_coef 0; the checkpoint's config gives "
                                                    f"{own}: --router_aux_loss_coef {own} turns it on)"))
        line += f"x {coef} ({scope.replace('_', '-')}; the checkpoint's config gives {own}), logged as aux_loss"
        return cls(num_experts=experts, top_k=top_k, coef=coef, scope=scope, accumulation=accumulation,
                   ranks=ranks, line=line)

    @torch.no_grad()
    def start_window(self, model, window: list[dict], device):
        """Before a window's micro-batches: the global scope's (choices per expert, rows) over the
        window on all ranks, from a forward without gradients per micro-batch (k > 1; with k = 1 the
        counts come with the micro-batch's own forward, and the micro-batch scope needs none)."""
        self.window_counts = None
        if not self.on or self.scope != "global_batch" or len(window) == 1:
            return
        counts = rows = 0
        for batch in window:
            batch_counts, _, batch_rows = model(to_device(batch, device), Routing(self.top_k))
            counts, rows = counts + batch_counts, rows + batch_rows
        self.window_counts = self._over_ranks(counts, rows)

    def term_of(self, forward) -> torch.Tensor:
        """`term` of a forward of the step that recorded its routers' logits (`outputs.LossSum`):
        over the real tokens (a packed batch passes the model no mask); a shard's summed over its
        group."""
        output = Routing(self.top_k)
        parts = output.compute(forward)
        return self.term(output.reduce(parts, forward.shard) if forward.shard is not None else parts)

    def term(self, routing) -> torch.Tensor:
        """What to back-propagate beside the CE for a micro-batch whose routers did `routing`
        (`moe.routing`); its value is kept for the log (summed over the window's micro-batches and
        the ranks it is the step's aux_loss, see `logged_batches`)."""
        counts, probabilities, rows = routing
        # accelerate divides by the accumulation steps and DDP averages: the mean
        if self.scope == "micro_batch":
            aux = balance_loss(counts, probabilities, rows)
            self.values.append(aux.detach())
            return self.coef * aux
        total_counts, total_rows = self.window_counts or self._over_ranks(counts, rows)
        # this micro-batch's share of the step's loss
        part = balance_loss(total_counts, probabilities, total_rows)
        self.values.append(part.detach())
        return self.coef * part * self.accumulation * self.ranks.data_world

    def logged_batches(self) -> float:
        """What one micro-batch adds to the count the logged aux sums are divided by: the
        micro-batch scope logs the mean over micro-batches and ranks; the global scope's parts add
        up to the step's loss."""
        return 1.0 if self.scope == "micro_batch" else 1.0 / (self.accumulation * self.ranks.data_world)

    def window_sums(self) -> dict:
        """The window's `term` values as the report sums them over ranks (`metrics` reads them);
        none where off."""
        values, self.values = self.values, []
        return {"aux": sum(values), "aux_batches": len(values) * self.logged_batches()} if self.on else {}

    def metrics(self, sums: dict) -> dict:
        """The logged aux_loss of a logging window's sums over ranks and steps; none where off."""
        return {"aux_loss": ratio(sums["aux"], sums["aux_batches"])} if self.on else {}

    def _over_ranks(self, counts, rows):
        summed = self.ranks.sum_over_data(torch.cat([counts, rows.reshape(1)]))
        return summed[:-1], summed[-1]
