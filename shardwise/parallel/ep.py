"""Expert parallelism: each rank of an ep group holds E/ep experts; tokens travel to them by all-to-all.

An experts module (ours, :class:`shardwise.moe.Experts`, or Hugging Face's
Mixtral / Qwen2-MoE / OLMoE experts: 3-D ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I)) keeps the rows of its experts ``[r*L, (r+1)*L)``
(``L = E / ep``, r this rank's ep coordinate), and its ``forward(x, index,
weights)`` is replaced on the instance by :meth:`ExpertParallel.forward`:

1. the routed slots (N tokens x k) are sorted by expert, so the rows bound for
   each rank are contiguous (rank r's experts are a contiguous block);
2. the per-expert counts are exchanged (one small all-to-all), so every rank
   knows how many rows it receives from each rank for each of its experts;
3. dispatch: the rows go to their experts' ranks (all-to-all with uneven
   split sizes, ``ep_dispatch``), are regrouped expert by expert, run through
   their expert, and go back (``ep_combine``);
4. each token's output is the weighted sum of its k experts' outputs.

Backward is the same exchanges reversed (``ep_dispatch_grad``,
``ep_combine_grad``). Nothing is dropped by default: every routed slot is
computed, which is the model's own semantics (dropless, as Megablocks and
Megatron's dropless MoE). With ``capacity_factor`` each expert takes at most
``C = ceil(capacity_factor * N * k / E)`` slots from each rank's N tokens
(GShard / Switch capacity, per source rank), the first C in token order;
the rest are dropped (they contribute nothing; the residual connection
carries those tokens) and counted in ``stats.counters["moe_dropped"]``.

The expert gradients: the rank of expert e receives the gradient of every
token of its ep group routed to e, i.e. ``ep`` ranks' worth of the loss
terms. The data-parallel wrappers sum expert gradients over ``edp`` (the
ranks holding the same experts) and divide by the full dp x cp size, as
Megatron scales expert gradients by ``1 / ep`` relative to dense ones: the
result is the single-device gradient (see :func:`is_expert`).
"""
from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from shardwise.comm import Comm, CommStats
from shardwise.comm.autograd import all_to_all_v
from shardwise.moe import expert_mlp
from shardwise.parallel.clip import sum_of_squares

EXPERT_ATTR = "_shardwise_ep"  # (ep rank, ep size) on a parameter that holds rows [rank*L, (rank+1)*L) of dim 0
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every Mixtral-shaped experts module of ``model`` (3-D ``gate_up_proj`` and ``down_proj``, ``act_fn``)."""
    for name, m in model.named_modules():
        ws = [getattr(m, w, None) for w in EXPERT_WEIGHTS]
        if all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in ws) and hasattr(m, "act_fn"):
            yield name, m


def expert_spec(p: torch.Tensor) -> tuple[int, int] | None:
    """(ep rank, ep size) of an expert-parallel parameter's rows along dim 0; None for any other tensor."""
    return getattr(p, EXPERT_ATTR, None)


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` holds only some ranks' experts: its gradient is reduced over ``edp``, not ``dp_cp``."""
    return expert_spec(p) is not None


def expert_parameter_count(model: nn.Module) -> int:
    """Elements of every experts module's weights (the part expert parallelism divides by ep)."""
    return sum(getattr(m, w).numel() for _, m in expert_modules(model) for w in EXPERT_WEIGHTS)


def capacity(capacity_factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """Slots each expert takes from one rank's ``tokens``: ``ceil(capacity_factor * tokens * top_k / n_experts)``."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def check_capacity_factor(capacity_factor: float | None) -> None:
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (None: dropless)")


class ExpertParallel:
    """The dispatch and combine of one ep group; one instance serves every experts module of a rank."""

    def __init__(self, comm: Comm | None, stats: CommStats, capacity_factor: float | None = None) -> None:
        check_capacity_factor(capacity_factor)
        self.comm = comm  # None: every expert on this rank (ep = 1), nothing travels
        self.stats = stats
        self.capacity_factor = capacity_factor
        self.rank, self.size = (comm.rank, comm.size) if comm is not None else (0, 1)

    def _exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], name: str) -> torch.Tensor:
        if self.comm is None:
            return x
        return all_to_all_v(x, self.comm, out_splits, in_splits, name, name + "_grad")

    def forward(self, m: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``m``'s output for tokens ``x`` (N, H) routed to ``index`` (N, k) with ``weights`` (N, k)."""
        n, k = index.shape
        ep, local = self.size, m.gate_up_proj.shape[0]  # type: ignore[index]
        n_experts = local * ep
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)           # slots sorted by expert, token order within one
        expert = flat[order]
        load = torch.bincount(flat, minlength=n_experts)  # type: ignore[arg-type]
        stats = self.stats
        stats.count("moe_dispatched", n * k)
        if self.capacity_factor is not None:
            c = capacity(self.capacity_factor, n, k, n_experts)  # type: ignore[arg-type]
            starts = torch.cumsum(load, 0) - load
            rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[expert]
            keep = rank_in_expert < c
            order, expert = order[keep], expert[keep]
            stats.count("moe_dropped", int((load - c).clamp(min=0).sum()))
            load = load.clamp(max=c)
        token, slot = order // k, order % k
        # How many rows go to each (rank, expert) and come from each: one small exchange of counts.
        recv_load = load.clone()
        if self.comm is not None:
            self.comm.all_to_all(recv_load, load, name="ep_counts")
        send_splits = load.view(ep, local).sum(1).tolist()  # type: ignore[arg-type]
        recv_by = recv_load.view(ep, local)  # type: ignore[arg-type]  # [source rank, my expert]
        recv_splits = recv_by.sum(1).tolist()
        rows = self._exchange(x[token], recv_splits, send_splits, "ep_dispatch")
        # Arrived grouped by source rank, then expert: regroup expert by expert for one GEMM pair each.
        src_starts = torch.cumsum(recv_by.reshape(-1), 0) - recv_by.reshape(-1)
        by_expert = [torch.arange(int(recv_by[s, e]), device=x.device) + src_starts[s * local + e]
                     for e in range(local) for s in range(ep)]
        regroup = torch.cat(by_expert) if by_expert else torch.empty(0, dtype=torch.long, device=x.device)
        sizes = recv_by.sum(0).tolist()
        # Every local expert runs, on zero rows if none came: its weights then get a zero gradient instead of
        # none, so the data-parallel reduction (DDP's buckets) sees every parameter on every rank.
        y = torch.cat([expert_mlp(m, e, chunk) for e, chunk in enumerate(rows[regroup].split(sizes))])
        back = torch.zeros_like(y).index_copy(0, regroup, y)  # back in arrival order
        returned = self._exchange(back, send_splits, recv_splits, "ep_combine")
        scaled = returned * weights[token, slot, None].to(x.dtype)
        return torch.zeros_like(x).index_add(0, token, scaled)


def apply_expert_parallel(model: nn.Module, dispatcher: ExpertParallel) -> dict[int, nn.Parameter]:
    """Keep this rank's experts of every experts module of ``model`` and route through ``dispatcher``.

    The kept rows are new parameters under the same names, marked with
    :data:`EXPERT_ATTR` so that the data-parallel wrappers, clipping, the full
    state dict and checkpoints know they are this rank's part of dim 0.
    Returns ``{id(replaced parameter): its replacement}``, for whoever kept
    references to the old ones (the pipeline's table of claimed tensors).
    """
    rank, size = dispatcher.rank, dispatcher.size
    replaced: dict[int, nn.Parameter] = {}
    for name, m in expert_modules(model):
        n_experts = m.gate_up_proj.shape[0]  # type: ignore[index]
        if n_experts % size:
            raise ValueError(f"expert parallel: '{name}' has {n_experts} experts, not divisible by ep={size}")
        local = n_experts // size
        if size > 1:
            rows = slice(rank * local, (rank + 1) * local)
            for w in EXPERT_WEIGHTS:
                full = getattr(m, w)
                part = nn.Parameter(full.detach()[rows].clone(), requires_grad=full.requires_grad)
                setattr(part, EXPERT_ATTR, (rank, size))
                setattr(m, w, part)
                replaced[id(full)] = part
        m.forward = types.MethodType(lambda self, x, index, weights, *_, **__: dispatcher.forward(
            self, x, index, weights), m)
    return replaced


def check_experts(model: nn.Module, ep: int, capacity_factor: float | None) -> None:
    """Before any process starts: ``ep`` > 1 or a capacity factor needs experts modules, and ``ep`` divides
    each one's expert count."""
    check_capacity_factor(capacity_factor)
    if ep == 1 and capacity_factor is None:
        return
    found = list(expert_modules(model))
    if not found:
        raise ValueError(f"ep={ep}{' and capacity_factor' if capacity_factor is not None else ''} need a mixture "
                         f"of experts, but {type(model).__name__} has no experts module (3-D gate_up_proj and "
                         "down_proj weights, as Mixtral's, Qwen2-MoE's and shardwise.moe.Experts have)")
    for name, m in found:
        if m.gate_up_proj.shape[0] % ep:  # type: ignore[index]
            raise ValueError(f"ep={ep} does not divide the {m.gate_up_proj.shape[0]} experts of '{name}': every "  # type: ignore[index]
                             "rank of an ep group must hold the same number of experts")


def warn_local_aux(model: nn.Module, ranks: int) -> None:
    """Warn when a Hugging Face MoE model will add a load-balancing loss computed from each rank's tokens alone
    (``config.output_router_logits``) while ``ranks`` data-parallel ranks share the batch."""
    config = getattr(model, "config", None)
    if ranks > 1 and getattr(config, "output_router_logits", False):
        warnings.warn(
            f"{type(model).__name__} computes its load-balancing loss from each rank's own tokens "
            f"(config.output_router_logits=True): with {ranks} data-parallel ranks the router's loss is the mean "
            "of per-rank losses, not the loss of the whole batch (that loss is not linear in the batch), so "
            "training differs from one device. shardwise.moe.MoE counts it over every rank; for this model, "
            "set output_router_logits=False or accept the difference.", stacklevel=3)


def experts_squares(grads: list[torch.Tensor], comm: Comm, device: torch.device) -> torch.Tensor:
    """The sum over ``comm`` (the ep group: each rank holds other experts) of ``grads``' squares, for the global
    clipping norm's ``reduced`` terms (:func:`shardwise.parallel.clip.clip_global_norm`)."""
    sq = sum_of_squares(grads, device)
    comm.all_reduce(sq, name="ep.clip")
    return sq


def set_token_group(model: nn.Module, comm: Comm) -> None:
    """Count the global auxiliary loss's expert fractions over ``comm`` in every MoE layer that has one."""
    for m in model.modules():
        if hasattr(m, "token_group") and hasattr(m, "aux_loss_coef"):
            m.token_group = comm  # type: ignore[assignment]


__all__ = ["EXPERT_ATTR", "ExpertParallel", "apply_expert_parallel", "capacity", "check_experts", "expert_modules",
           "experts_squares", "check_capacity_factor", "warn_local_aux",
           "expert_parameter_count", "expert_spec", "is_expert", "set_token_group"]
