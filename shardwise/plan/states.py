"""Exact model-state bytes of a real module under a :class:`~shardwise.layout.RunLayout`, rank by rank.

The formulas of :mod:`shardwise.plan.memory` are for models known by a
count or a shape. For a real module this module repeats the construction
instead, on a copy of the model that holds no data (every tensor on the meta
device), so the prediction cannot drift from what the strategies build:

1. the pipeline split of :func:`shardwise.parallel.parallelize.parallelize`: the same
   pipeline layers (:func:`~shardwise.parallel.pp.build.pipeline_layers`), the
   same stage boundaries (:func:`~shardwise.parallel.pp.build.stage_starts`,
   balanced by parameter count before any split), chunk ``r + c * pp`` on
   pipeline rank ``r``;
2. the tensor-parallel split of that rank's modules with the model's plan
   (:func:`shardwise.parallel.tp.apply.apply_tp` on a stand-in tp group), which
   gives every local parameter its shape and the size of the storage behind it;
3. the byte conventions of the data-parallel family over dp (one ZeRO-1
   wrapper over all chunks, one ZeRO-2/FSDP/DDP wrapper per chunk), whose
   sharding group under context parallelism is dp_shard x cp (the cp ranks of
   a replica hold the same parameters): each
   sharded parameter is padded on its own to ``N * ceil(numel / N)``
   (:mod:`shardwise.parallel.dp.sharding`), FSDP keeps one row of
   ``ceil(numel / N)`` elements per parameter for weights, gradients and each
   optimizer state, frozen parameters stay whole on every rank;
4. expert parallelism (``layout.ep`` > 1): every experts module keeps E / ep
   rows of its 3-D weights (:func:`shardwise.parallel.ep.apply_expert_parallel`,
   every ep rank's shapes are equal), and the data-parallel family treats those
   rows as their own group: replicated (DDP) or sharded (ZeRO/FSDP) over the
   ``edp = dp x cp / ep`` ranks holding the same experts, a rank's place there
   being its dp x cp index divided by ep (:func:`shardwise.comm.topology`'s
   expert groups: blocks of ep neighbours), the dense parameters over dp x cp
   as before.

The result is what the trainer counts (``FitResult.stats``: ``params_bytes``,
``grads_bytes``, ``optimizer_bytes`` and their ``host_`` forms) after the last
optimizer step, assuming every trainable parameter received a gradient.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardwise.dims import DP, PP, TP
from shardwise.layout import RunLayout
from shardwise.parallel.ep import EXPERT_WEIGHTS, expert_modules
from shardwise.parallel.pp.build import stage_starts
from shardwise.parallel.pp.layers import stage_layers
from shardwise.parallel.tp.apply import apply_tp
from shardwise.plan.trace import meta_copy as copy_to_meta
from shardwise.precision import TRUE_DTYPES

# Strategies whose state this module can lay out, by how the whole model is wrapped.
_WHOLE_MODEL = {"single": 0, DP: 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}
_PIPELINE = ("parallel", PP)
MODELLED = tuple(_WHOLE_MODEL) + _PIPELINE + (TP, "ps")


class NotModelled(ValueError):
    """The planner cannot lay out this run (an unknown strategy, or a model it cannot split)."""


@dataclass(frozen=True)
class Param:
    """What the byte count needs to know of one parameter as a rank holds it."""

    numel: int
    element_size: int
    storage_bytes: int  # the storage behind it: a slice may keep its whole base alive
    trainable: bool
    expert: bool = False  # this rank's rows of an experts module's weight: its own data-parallel group (edp)
    rows: int = 1  # the size of dim 0 (FSDP2 shards each parameter by rows; a 0-d parameter is one row)


@dataclass(frozen=True)
class RankStates:
    """Model-state bytes of one rank, by kind, as ``FitResult.stats`` names them."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    host_params: int = 0
    host_grads: int = 0
    host_optimizer: int = 0

    @property
    def device(self) -> int:
        """Bytes on the training device (what must fit in its memory)."""
        return self.params + self.grads + self.optimizer

    @property
    def host(self) -> int:
        return self.host_params + self.host_grads + self.host_optimizer

    @property
    def total(self) -> int:
        """Device and host together: the stats' ``model_state_bytes``."""
        return self.device + self.host

    def as_stats(self) -> dict[str, int]:
        """The ``*_bytes`` entries of one rank's stats (host kinds only when something is offloaded)."""
        out = {"model_state_bytes": self.total, "params_bytes": self.params, "grads_bytes": self.grads,
               "optimizer_bytes": self.optimizer}
        if self.host:
            out.update(host_params_bytes=self.host_params, host_grads_bytes=self.host_grads,
                       host_optimizer_bytes=self.host_optimizer)
        return out

    def __add__(self, other: RankStates) -> RankStates:
        return RankStates(*(a + b for a, b in zip(self._values(), other._values())))

    def _values(self) -> tuple[int, ...]:
        return (self.params, self.grads, self.optimizer, self.host_params, self.host_grads, self.host_optimizer)


def stepped_probe(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """A copy of the probe optimizer (and its parameters) after one step on zero gradients: the states it holds
    are what the optimizer really allocates. The caller's optimizer is left as it was. Raises NotModelled for an
    optimizer that cannot be stepped so (say so rather than guess)."""
    try:
        opt = copy.deepcopy(optimizer)  # its own parameters
        params = [p for g in opt.param_groups for p in g["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    except Exception as e:
        raise NotModelled(f"cannot count the states of {type(optimizer).__name__}: {e}") from e
    return opt, params


def optimizer_states(optimizer: torch.optim.Optimizer | str) -> int:
    """Tensors of the parameter's size the optimizer keeps per parameter (AdamW 2, SGD with momentum 1).

    Given an optimizer (the trainer's probe, built on a one-element
    parameter), a copy of it takes one step on a zero gradient and its states
    are counted: whatever the optimizer, the answer is what it really
    allocates (scalar step counters excluded, as the trainer's count excludes them).
    """
    if isinstance(optimizer, str):
        return {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]
    opt, params = stepped_probe(optimizer)
    numel = sum(p.numel() for p in params) or 1
    states = sum(t.numel() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
    return states // numel


# ---- the model as each pipeline rank holds it --------------------------------
@dataclass(frozen=True)
class _StandIn:
    """The tp group as the tensor-parallel split sees it at construction: a size and a rank."""

    size: int
    rank: int


def meta_copy(model: nn.Module) -> nn.Module:
    """:func:`shardwise.plan.trace.meta_copy`, a copy failure reported as :class:`NotModelled`."""
    try:
        return copy_to_meta(model)
    except Exception as e:  # e.g. a module holding a lock or a process group
        raise NotModelled(f"cannot copy {type(model).__name__} to lay it out: {e}") from e


def _params(modules: Iterable[nn.Module], experts: set[int] | None = None) -> list[Param]:
    experts = experts or set()
    holder = nn.ModuleList(modules)  # parameters() of one container: each tied parameter once
    return [Param(p.numel(), p.element_size(), p.untyped_storage().nbytes(), p.requires_grad, id(p) in experts,
                  p.shape[0] if p.dim() else 1) for p in holder.parameters()]


def _split_experts(model: nn.Module, ep: int) -> set[int]:
    """Keep rank 0's E / ep rows of every experts module's weights, as apply_expert_parallel does (every ep rank
    holds as many); returns the ids of the expert parameters (split or, with ep = 1, whole)."""
    out: set[int] = set()
    for name, m in expert_modules(model):
        n = m.gate_up_proj.shape[0]  # type: ignore[index]
        if n % ep:
            # The run itself refuses this (shardwise.parallel.ep.check_experts), with this reason.
            raise ValueError(f"ep={ep} does not divide the {n} experts of '{name}'")
        for w in EXPERT_WEIGHTS:
            full = getattr(m, w)
            if ep > 1:
                # A new parameter of its own storage (a clone of the rows), as the strategy builds it.
                full = nn.Parameter(full.detach()[:n // ep].clone(), requires_grad=full.requires_grad)
                setattr(m, w, full)
            out.add(id(full))
    return out


def local_chunks(model: nn.Module, layout: RunLayout, tp_plan: Any = None,
                 split_points: Sequence[str] | None = None) -> list[list[list[Param]]]:
    """Per pipeline rank, per model chunk, the parameters a rank of that stage holds (after the tp and ep splits)."""
    tp, ep = layout.tp, layout.ep
    if layout.strategy not in _PIPELINE:
        if layout.pp > 1:
            raise NotModelled(f"strategy {layout.strategy!r} with pp={layout.pp}")
        m = meta_copy(model)
        if tp > 1:
            _split(apply_tp, m, tp_plan, tp, None)
        return [[_params([m], _split_experts(m, ep))]]
    p, v = layout.pp, layout.chunks
    try:
        starts = stage_starts(stage_layers(model, p * v), p * v, split_points)
    except ValueError as e:
        raise NotModelled(str(e)) from e
    out: list[list[list[Param]]] = []
    for r in range(p):
        m = meta_copy(model)
        layers = stage_layers(m, p * v)
        bounds = starts + [len(layers)]
        mine = [r + c * p for c in range(v)]
        if tp > 1:
            # As build_pipeline does: only this rank's modules are split (every tp rank's shapes are equal).
            keep = {id(x) for k in mine for _, layer in layers[bounds[k]:bounds[k + 1]] for x in layer.modules()}
            _split(apply_tp, m, tp_plan, tp, _member(m, keep))
            layers = stage_layers(m, p * v)
        experts = _split_experts(m, ep)  # after tp, as parallelize orders them (our tp plans leave experts whole)
        out.append([_params((layer for _, layer in layers[bounds[k]:bounds[k + 1]]), experts) for k in mine])
    return out


def _member(model: nn.Module, ids: set[int]) -> Callable[[str], bool]:
    return lambda name: id(model.get_submodule(name)) in ids


def _split(tensor_parallel: Callable[..., nn.Module], model: nn.Module, plan: Any, tp: int,
           keep: Callable[[str], bool] | None) -> None:
    """The tensor-parallel split on a stand-in group of ``tp`` (rank 0: every rank's shapes are equal)."""
    try:
        tensor_parallel(model, plan, _StandIn(tp, 0), keep)
    except (ValueError, TypeError):
        raise  # the model or plan cannot be split: the run itself would stop with this very error
    except Exception as e:  # anything else is the planner's limit, not the run's
        raise NotModelled(f"cannot apply the tensor-parallel plan to a copy of the model: {e!r}") from e


# ---- the data-parallel family's bytes -------------------------------------------
def _ceil(n: int, k: int) -> int:
    return -(-n // k)


def held_elements(numel: int, n: int, place: int) -> int:
    """Real elements of rank ``place``'s piece of ``numel`` split into ``n`` pieces of ``ceil(numel / n)`` (the
    last ones end short, or hold none)."""
    c = _ceil(numel, n)
    return max(0, min(c, numel - place * c))


def _frozen(params: Sequence[Param]) -> int:
    return sum(p.storage_bytes for p in params if not p.trainable)


def replicated(params: Sequence[Param], k: int) -> RankStates:
    """DDP (or no wrapper): whole parameters, whole gradients of the trainable ones, whole optimizer states."""
    train = sum(p.numel * p.element_size for p in params if p.trainable)
    return RankStates(sum(p.storage_bytes for p in params), train, k * train)


def zero(params: Sequence[Param], k: int, stage: int, n: int, rank: int, offload: str) -> RankStates:
    """ZeRO-1/2 on dp rank ``rank`` of ``n``: whole parameters, the optimizer on padded pieces.

    A piece cut short by its parameter's end is a padded copy (parameter
    memory); offloaded, the pieces live in a host row instead. Stage 1 keeps
    the whole gradients (its reduced pieces live only for the step), stage 2
    keeps only the reduced pieces.
    """
    train = [q for q in params if q.trainable]
    pieces = sum(_ceil(q.numel, n) * q.element_size for q in train)
    whole = sum(q.numel * q.element_size for q in train)
    copies = sum(_ceil(q.numel, n) * q.element_size for q in train
                 if held_elements(q.numel, n, rank) < _ceil(q.numel, n))
    weights = sum(q.storage_bytes for q in params)
    grads = whole if stage == 1 else pieces
    if offload == "none":
        return RankStates(weights + copies, grads, k * pieces)
    return RankStates(weights, grads if stage == 1 else 0, 0, pieces, 0 if stage == 1 else pieces, k * pieces)


def fsdp(params: Sequence[Param], k: int, n: int, offload: str) -> RankStates:
    """FSDP/ZeRO-3 over a shard group of ``n``: one padded row element per ``ceil(numel/n)``, frozen ones whole.

    Gathered parameters are freed after use, so outside forward and backward
    they hold no memory. Offloaded, the row's master copy, gradient and states
    live on the host; ``"all"`` keeps no row on the device either.
    """
    row = sum(_ceil(q.numel, n) * q.element_size for q in params if q.trainable)
    frozen = _frozen(params)
    if offload == "none":
        return RankStates(row + frozen, row, k * row)
    return RankStates(frozen + (row if offload == "optimizer" else 0), 0, 0, row, row, k * row)


# ---- the same family under torch's engines (engine="torch") ----------------------
def zero_redundancy(params: Sequence[Param], k: int, n: int, rank: int) -> RankStates:
    """torch's ZeRO-1 (``ZeroRedundancyOptimizer`` under DDP) on dp rank ``rank`` of ``n``: whole parameters and
    gradients; the optimizer states of the whole tensors its partition owns. torch partitions greedily: the
    tensors largest first (in order among equals), each to the rank owning the fewest elements so far (the
    lowest such rank). One parameter group; with several, torch partitions group by group."""
    owned = [0] * n
    mine = 0
    for q in sorted(params, key=lambda q: -q.numel):
        r = owned.index(min(owned))
        owned[r] += q.numel
        if r == rank and q.trainable:
            mine += q.numel * q.element_size
    return replace(replicated(params, k), optimizer=k * mine)


def fully_sharded(params: Sequence[Param], k: int, n: int, rank: int, offload: str) -> RankStates:
    """FSDP2 (torch's zero2, zero3, fsdp and hsdp) on shard rank ``rank`` of ``n``: every parameter, frozen ones
    too, cut by rows into ``ceil(rows / n)``-row pieces; weights and gradients live in storage padded to a whole
    piece on every rank, the optimizer's states are the size of this rank's rows (the last ranks may hold fewer,
    or none). Offloaded (``"all"``: FSDP2's ``CPUOffloadPolicy``), all of it lives in host memory."""
    if offload not in ("none", "all"):
        raise NotModelled(f"offload={offload!r} under engine='torch'")  # refused before start: not run either

    def piece(q: Param) -> int:
        return _ceil(q.rows, n) * (q.numel // max(q.rows, 1)) * q.element_size

    def own(q: Param) -> int:
        return held_elements(q.rows, n, rank) * (q.numel // max(q.rows, 1)) * q.element_size

    train = [q for q in params if q.trainable]
    held = (sum(map(piece, params)), sum(map(piece, train)), k * sum(map(own, train)))
    return RankStates(*held) if offload == "none" else RankStates(0, 0, 0, *held)


def rank_states(model: nn.Module, layout: RunLayout, optimizer: torch.optim.Optimizer | str = "adamw", *,
                tp_plan: Any = None, split_points: Sequence[str] | None = None) -> list[RankStates]:
    """Model-state bytes of every rank, in rank order of the mesh ``(pp, dp, cp, tp)`` (tp innermost).

    Raises :class:`NotModelled` for a strategy or model this module cannot lay out.
    """
    check_modelled(layout)
    if layout.precision in TRUE_DTYPES:  # the run casts the weights themselves: every state is in that dtype
        model = meta_copy(model).to(TRUE_DTYPES[layout.precision])
    return states_of(local_chunks(model, layout, tp_plan, split_points), layout, optimizer_states(optimizer))


def check_modelled(layout: RunLayout) -> None:
    if layout.strategy not in MODELLED:
        raise NotModelled(f"strategy {layout.strategy!r} is not one the planner lays out "
                          f"({', '.join(MODELLED)})")


def zero_stage(layout: RunLayout) -> int:
    """The data-parallel form a layout's strategy builds (named presets carry theirs in the name)."""
    return _WHOLE_MODEL.get(layout.strategy, layout.zero)


def states_of(chunks: list[list[list[Param]]], layout: RunLayout, k: int) -> list[RankStates]:
    """Every rank's bytes from :func:`local_chunks` and ``k`` optimizer states per parameter element.

    ZeRO and FSDP shard over dp_shard x cp: ``N = shard_size * cp`` ranks, and a rank's place in that group
    (which decides ZeRO-1/2's padded copies) is ``shard * cp + cp coordinate``, the order of the flattened
    ``dp_shard_cp`` group. HSDP's replicas (dp_replicate, outermost of dp) hold the same shards. Expert rows
    (``Param.expert``) are sharded the same way over their own group, edp: ``N / ep`` ranks, a rank's place
    being its dp x cp index divided by ep.
    """
    if layout.strategy == "ps":
        return _ps(chunks[0][0], k, layout)
    stage, offload = zero_stage(layout), layout.offload

    def group(cs: list[list[Param]], n: int, d: int) -> RankStates:
        if layout.engine == "torch" and stage:  # DDP (stage 0) holds what ours does
            return torch_group(cs, n, d)
        if stage == 0:
            return _sum(replicated(c, k) for c in cs)
        if stage == 1:  # one ZeRO-1 wrapper over every chunk of the rank
            return zero([q for c in cs for q in c], k, 1, n, d, offload)
        if stage == 2:  # one wrapper per chunk
            return _sum(zero(c, k, 2, n, d, offload) for c in cs)
        return _sum(fsdp(c, k, n, offload) for c in cs)

    def torch_group(cs: list[list[Param]], n: int, d: int) -> RankStates:
        if stage == 1:
            if offload != "none":
                raise NotModelled("offload under engine='torch'")
            return zero_redundancy([q for c in cs for q in c], k, n, d)
        return _sum(fully_sharded(c, k, n, d, offload) for c in cs)  # zero2 runs as FSDP2 too

    return per_rank(chunks, layout, group)


Group = Callable[[list[list[Param]], int, int], Any]


def per_rank(chunks: list[list[list[Param]]], layout: RunLayout, group: Group) -> list[Any]:
    """``group(chunks, n, place)`` of every rank, in rank order: its chunks' parameters, sharded over ``n`` ranks
    of which it is number ``place`` (dense and expert parameters each over their own group, added)."""
    stage, cp, ep = zero_stage(layout), layout.cp, layout.ep
    n = layout.shard_size * cp if stage else 1
    shards = layout.shard_size if stage else layout.dp

    def per(cs: list[list[Param]], d: int) -> Any:
        if not any(q.expert for c in cs for q in c):
            return group(cs, n, d)
        dense = [[q for q in c if not q.expert] for c in cs]
        experts = [[q for q in c if q.expert] for c in cs]
        # ep = 1: the experts' group is the dense one (shardwise.dims.ParallelDims.same_group), one wrapper's
        # buckets all the same; the byte count is additive over parameters either way.
        return group(dense, n, d) + group(experts, max(1, n // ep), d // ep)

    return [per(chunks[r], (d % shards) * cp + c) for r in range(layout.pp) for d in range(layout.dp)
            for c in range(cp) for _ in range(layout.tp)]


def params_of(chunks: list[list[list[Param]]], layout: RunLayout) -> list[int]:
    """The parameter elements every rank holds, in rank order: whole parameters (after the tp, pp and ep splits)
    under DDP and ZeRO-1/2, its ``ceil(numel / N)`` piece of each trainable one under ZeRO-3/FSDP."""
    stage = zero_stage(layout)

    def group(cs: list[list[Param]], n: int, d: int) -> int:
        return sum(held_elements(q.numel, n, d) if stage >= 3 and q.trainable else q.numel for c in cs for q in c)

    if layout.strategy == "ps":  # every rank holds the whole model (the servers their range of it, as a flat copy)
        return [sum(q.numel for q in chunks[0][0])] * layout.dp
    return per_rank(chunks, layout, group)


def full_grad_bytes(chunks: list[list[list[Param]]]) -> int:
    """The whole gradients of the busiest pipeline rank's trainable parameters (held while micro-batches
    accumulate unreduced under ``no_sync``)."""
    return max(sum(q.numel * q.element_size for c in cs for q in c if q.trainable) for cs in chunks)


def _sum(states: Iterable[RankStates]) -> RankStates:
    out = RankStates()
    for s in states:
        out = out + s
    return out


def _ps(params: list[Param], k: int, layout: RunLayout) -> list[RankStates]:
    """Parameter server: servers hold an even range of the trainable parameters (weights, gradient, optimizer);
    workers their trainable parameters and gradients, and no optimizer."""
    train = [q for q in params if q.trainable]
    if not train:
        raise NotModelled("the parameter server needs trainable parameters")
    es = train[0].element_size
    total = sum(q.numel for q in train)
    base, extra = divmod(total, layout.servers)
    shards = [(base + (1 if s < extra else 0)) * es for s in range(layout.servers)]
    servers = [RankStates(b, b, k * b) for b in shards]
    return servers + [RankStates(total * es, total * es, 0)] * (layout.dp - layout.servers)


def busiest(states: Sequence[RankStates]) -> RankStates:
    """The rank with the most bytes on its device (ties: the most in total)."""
    return max(states, key=lambda s: (s.device, s.total))


__all__ = ["MODELLED", "NotModelled", "Param", "RankStates", "busiest", "check_modelled", "fsdp", "full_grad_bytes",
           "fully_sharded", "held_elements", "local_chunks", "meta_copy", "optimizer_states", "params_of", "per_rank",
           "rank_states", "replicated", "states_of", "stepped_probe", "zero", "zero_redundancy", "zero_stage"]
