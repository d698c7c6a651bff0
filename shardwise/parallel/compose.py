"""Composition: data x tensor x pipeline parallelism on one 3-D device mesh.

``sw.Parallel(dp=2, tp=2, pp=2, zero=1, schedule="1f1b", microbatches=8)``
lays the world out as the mesh ``(pp, dp, tp)`` of
:class:`~shardwise.topology.Topology` (tp innermost: a tensor-parallel group is
made of neighbouring ranks, the ones that talk most). The order in which the
parallelisms are applied is fixed here and only here, as torchtitan fixes it
(``parallelize_llama``) and as Narayanan et al. 2021 ("Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", section 3)
compose them:

1. pipeline split: each pp rank keeps its stage's layers
   (:func:`shardwise.parallel.pipeline.build_pipeline`);
2. tensor parallelism on the modules of that stage only
   (:func:`shardwise.parallel.tp.parallelize` on the tp group);
3. data parallelism over the dp group, wrapping each stage: our DDP
   (``zero=0``) or ZeRO (``zero=1``/``2``, :mod:`shardwise.parallel.zero`).

Data is sharded over dp only: every rank of a (pp, tp) slice of one replica
reads the same batch (inputs are used by the first stage, targets by the last).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.parallel.pipeline import PP, PipelineModel, build_pipeline
from shardwise.parallel.tp import Plan, Style, clip_grad_norm_, parallelize, tp_spec
from shardwise.strategy import OptimizerFactory
from shardwise.topology import Topology

DPWrap = Callable[[PipelineModel, OptimizerFactory, Topology, "Parallel"], torch.optim.Optimizer]


def _wrap_none(pm: PipelineModel, optimizer_fn: OptimizerFactory, topo: Topology,
               cfg: Parallel) -> torch.optim.Optimizer:
    return optimizer_fn(pm.parameters())


def _wrap_ddp(pm: PipelineModel, optimizer_fn: OptimizerFactory, topo: Topology,
              cfg: Parallel) -> torch.optim.Optimizer:
    from shardwise.parallel.ddp import DDPModule

    if topo.size("dp") == 1:
        return _wrap_none(pm, optimizer_fn, topo, cfg)
    # One DDP per model chunk: a chunk's final backward is where its buckets reduce.
    for c in range(len(pm.chunks)):
        pm.chunks[c] = DDPModule(pm.chunks[c], topo.comm("dp"), bucket_cap_mb=cfg.bucket_cap_mb)
    return optimizer_fn(pm.parameters())


def _wrap_zero(pm: PipelineModel, optimizer_fn: OptimizerFactory, topo: Topology,
               cfg: Parallel) -> torch.optim.Optimizer:
    from shardwise.parallel.zero import ShardedOptimizer, ZeROModule

    if cfg.zero == 1:
        # Stage 1 reduces at the optimizer step, so one wrapper can own every chunk.
        zm = ZeROModule(nn.ModuleList(list(pm.chunks)), topo.comm("dp"), stage=1)
    else:
        if len(pm.chunks) != 1:
            raise ValueError("zero=2 reduces in each chunk's backward; use zero=1 with interleaved chunks")
        zm = ZeROModule(pm.chunks[0], topo.comm("dp"), stage=2)
        pm.chunks[0] = zm
    pm.__dict__["dp_owner"] = zm  # not a submodule: its parameters are the chunks' own
    return ShardedOptimizer(optimizer_fn(zm.shard_params), zm)


DP_WRAPPERS: dict[int, DPWrap] = {0: _wrap_ddp, 1: _wrap_zero, 2: _wrap_zero}


@dataclass
class Parallel(PP):
    """dp x tp x pp with ZeRO over dp; see the module docstring for the order.

    Args:
        dp, tp, pp: mesh sizes (``dp=-1``: the devices left over).
        zero: 0 = DDP over dp, 1 = ZeRO-1, 2 = ZeRO-2 (one chunk per rank).
        tp_plan: tensor-parallel plan (None: the built-in plan for the model type).
        schedule, microbatches, split_points, chunks, tied, recorder: as in
            :class:`~shardwise.parallel.pipeline.PP`.
    """

    dp: int = -1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    tp_plan: Plan | dict[str, str | Style] | str | None = None
    bucket_cap_mb: float = 25.0
    name: ClassVar[str] = "parallel"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.zero not in DP_WRAPPERS:
            raise ValueError(f"zero={self.zero}: valid are {sorted(DP_WRAPPERS)} (0 = DDP over dp, 1/2 = ZeRO "
                             "stage 1/2); for parameter sharding use strategy 'zero3'/'fsdp' without tp/pp")

    def sizes(self, devices: int) -> dict[str, int]:
        return Topology.validate(devices, self.dp, self.tp, self.pp)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        tp_comm = topo.comm("tp")

        def apply_tp(m: nn.Module, keep: Callable[[str], bool]) -> nn.Module:
            return parallelize(m, self.tp_plan, tp_comm, keep)

        pm = build_pipeline(model.to(topo.device), topo, self.split_points, self.chunks, self.tied,
                            apply_tp if topo.size("tp") > 1 else None)
        return pm, DP_WRAPPERS[self.zero](pm, optimizer_fn, topo, self)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        pm: PipelineModel = model  # type: ignore[assignment]
        tp = topo.comm("tp") if topo.size("tp") > 1 else None
        zm = pm.__dict__.get("dp_owner")
        if zm is None:
            # DDP has averaged the gradients: they are equal over dp, so dp takes no part in the norm.
            return clip_grad_norm_(pm.parameters(), max_norm, tp=tp, pp=topo.comm("pp"),
                                   count_elsewhere=pm.elsewhere())
        return _clip_zero(pm, zm, max_norm, topo, tp)

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        pm: PipelineModel = model  # type: ignore[assignment]
        params = list(pm.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        zm = pm.__dict__.get("dp_owner")
        if zm is not None:
            grads += zm.shard_grads()
        grads += [b.buffer for c in pm.chunks for b in getattr(c, "buckets", []) if hasattr(b, "buffer")]
        states = [v for s in optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": params, "grads": grads, "optimizer": states}


def _clip_zero(pm: PipelineModel, zm: Any, max_norm: float, topo: Topology, tp: Any) -> torch.Tensor:
    """Global-norm clipping over ZeRO's reduced gradient pieces (disjoint over dp), tp shards and stages."""
    from shardwise.parallel.sharding import clip_coefficient

    zm.before_step()  # reduce-scatter now: the norm needs the averaged gradient
    elsewhere = pm.elsewhere()
    pieces = [(s.grad, p) for b in zm.buckets for p, s in zip(b.params, b.shards) if s.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=topo.device)
    for g, p in pieces:
        if id(p) not in elsewhere and (tp_spec(p) is not None or tp is None or tp.rank == 0):
            sq += g.detach().float().pow(2).sum()
    topo.comm("dp").all_reduce(sq, name="zero_clip")
    if tp is not None:
        tp.all_reduce(sq, name="tp.clip")
    topo.comm("pp").all_reduce(sq, name="pp.clip")
    total = sq.sqrt()
    coef = clip_coefficient(total, max_norm)
    for g in zm.shard_grads():
        g.detach().mul_(coef.to(g.dtype))
    return total


__all__ = ["DP_WRAPPERS", "Parallel"]
