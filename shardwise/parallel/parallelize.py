"""The one place that fixes the order a model is parallelized in.

Every layout is built by :func:`parallelize`, in this order (torchtitan's
``parallelize_llama`` and Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", section 3):

1. **pipeline split** (pp > 1, or interleaved chunks): each pipeline rank keeps
   its stage's layers (:func:`shardwise.parallel.pp.build.build_pipeline`).
   First, because everything after it should only touch this rank's layers.
2. **tensor parallel** (tp > 1) on the modules of that stage only
   (:func:`shardwise.parallel.tp.apply.parallelize` on the tp group). Before data
   parallelism, because the data-parallel wrappers shard, bucket and reduce
   the parameters as they are *after* the tp split (a rank's tp slice).
3. **context parallel** (cp > 1): each chunk's attention switched to
   attention across the cp group, and its tokens given their real positions
   (:func:`shardwise.parallel.cp.apply.apply_context_parallel`). After tp, because
   tp splits attention by heads and cp by tokens (the cp exchange carries
   only this rank's heads); before the data-parallel wrappers, which must see
   the final modules. It adds and splits no parameter.
4. **expert parallel** (ep > 1, or a capacity factor): each experts module
   keeps its ep rank's experts and routes tokens to the others by all-to-all
   (:func:`shardwise.parallel.ep.apply_expert_parallel`). After tp (experts
   are not tp-split: every tp rank runs its experts on the same tokens), and
   before the data-parallel family, which reduces and shards the expert
   parameters over ``edp`` (the ranks holding the same experts) and the
   rest over dp x cp. (:func:`wrap_module` also has MoE layers count their
   load-balancing loss's expert fractions over dp x cp,
   :func:`~shardwise.parallel.ep.set_token_group`, for every data-parallel
   strategy.)
5. **the data-parallel family** over the ranks that hold the same parameters,
   one wrapper per model chunk (:func:`data_parallel`): DDP (``zero=0``),
   ZeRO-1/2 (``zero=1|2``), FSDP/ZeRO-3 (``zero=3``) or HSDP (``zero=3,
   replicate=R``). Gradients are averaged over dp x cp (``dp_cp``) and states
   sharded over dp_shard x cp (``dp_shard_cp``): the cp ranks of a replica see
   other tokens of the same samples. Last, because it must see the final
   parameters and wraps each chunk's forward and backward (FSDP's gathers
   run inside the stage's schedule).

Activation checkpointing is applied by the trainer before step 1, on the
unsplit model (it only wraps blocks' forwards, so it survives every split).

Data is sharded over dp only: every rank of a (pp, cp, tp) slice of one replica
reads the same batch (inputs are used by the first stage, targets by the last;
each cp rank then keeps its own tokens of both).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.comm import Comm
from shardwise.comm.topology import Topology
from shardwise.dims import CP, DP, DP_CP, DP_REPLICATE, DP_SHARD_CP, EDP, EP, TP
from shardwise.layout import check_data_parallel
from shardwise.parallel.cp.apply import ContextParallel, apply_context_parallel
from shardwise.parallel.cp.attention import RING
from shardwise.parallel.dp.buckets import DDP_BUCKET_MB, ZERO_BUCKET_MB
from shardwise.parallel.dp.ddp import DDPModule, native_allreduce
from shardwise.parallel.dp.fsdp_module import FSDPModule
from shardwise.parallel.dp.zero import ShardedOptimizer
from shardwise.parallel.dp.zero_module import ZeROModule
from shardwise.parallel.ep import ExpertParallel, apply_expert_parallel, set_token_group
from shardwise.parallel.pp.build import build_pipeline
from shardwise.parallel.tp.apply import apply_tp
from shardwise.step import OptimizerFactory, on_device


@dataclass(frozen=True)
class DataParallelOptions:
    """The data-parallel family over dp, with each member's options.

    ``zero``: 0 DDP, 1/2 ZeRO stage 1/2, 3 FSDP (ZeRO-3 in units). ``replicate``
    (with zero=3): HSDP, ``replicate`` replicas of ``dp // replicate`` shards.
    """

    zero: int = 0
    replicate: int = 1
    bucket_cap_mb: float | None = None   # None: each wrapper's default (parallel/dp/buckets.py)
    collectives: str = "auto"            # ZeRO/FSDP: "native", "p2p" or "auto"
    offload: str = "none"
    offload_device: str = "cpu"
    wrap: Any = "auto"                   # FSDP unit policy
    reshard_after_forward: bool = True
    param_init_fn: Callable[[nn.Module], None] | None = None
    allreduce: Callable[..., Any] | None = None  # DDP's all-reduce algorithm (None: the backend's)
    reduce_dtype: torch.dtype | None = None
    find_unused_parameters: bool = False
    hybrid: bool = False                 # HSDP's 2-D dp groups even with replicate=1 (see fsdp_groups)

    def __post_init__(self) -> None:
        check_data_parallel(self.zero, self.replicate)


class Owners:
    """Several data-parallel wrappers (one per model chunk) driven as one by a ShardedOptimizer."""

    def __init__(self, wrappers: Sequence[Any]) -> None:
        self.wrappers = list(wrappers)

    def before_step(self) -> None:
        for w in self.wrappers:
            w.before_step()

    def after_step(self) -> None:
        for w in self.wrappers:
            w.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for w in self.wrappers:
            w.zero_grad(set_to_none)

    def shard_grads(self) -> list[torch.Tensor]:
        return [g for w in self.wrappers for g in w.shard_grads()]

    def grad_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [gp for w in self.wrappers for gp in w.grad_pieces()]

    @property
    def shard_comm(self) -> Comm:
        """The group the reduced pieces are disjoint over (all of dp; HSDP: the shard group)."""
        return self.wrappers[0].comm  # type: ignore[no-any-return]


def fsdp_groups(topo: Topology, replicate: int, hybrid: bool = False) -> tuple[Comm, Comm | None]:
    """(shard comm, replicate comm or None) for FSDP/HSDP over dp (and cp: shards over dp_shard x cp).

    ``hybrid`` (the ``hsdp`` strategy) uses the 2-D (replicate, shard) split of
    dp even with one replica, so its groups look alike at every size.
    """
    if topo.size(CP) > 1:
        # The cp ranks of a replica hold the same parameters: they shard them too (torchtitan's dp_shard_cp).
        if topo.dims.with_replicas(replicate) != topo.dims:
            raise ValueError(f"context parallel with HSDP needs the run's dims built with replicate={replicate} "
                             f"(sw.Parallel(zero=3, replicate={replicate}, cp=...) does)")
        return topo.comm(DP_SHARD_CP), (topo.comm(DP_REPLICATE) if replicate > 1 else None)
    if replicate == 1 and not hybrid:
        return topo.comm(DP), None
    groups = topo.replicas_and_shards(replicate)
    if groups is None:
        return topo.comm(DP), None
    return groups


def wrap_module(module: nn.Module, topo: Topology, opts: DataParallelOptions) -> nn.Module:
    """One module (a whole model, or one pipeline chunk) wrapped by the data-parallel family member."""
    # Gradients are averaged over every rank that holds this replica's parameters: dp, and cp's token shards.
    # Expert-parallel parameters (ep > 1) are reduced and sharded over their own group, edp (parallel/ep.py).
    experts = topo.comm(EDP) if topo.size(EP) > 1 else None
    # MoE layers count their load-balancing loss's expert fractions over every rank the gradients average over.
    set_token_group(module, topo.comm(DP_CP))
    if opts.zero == 0:
        return DDPModule(module, topo.comm(DP_CP), bucket_cap_mb=opts.bucket_cap_mb or DDP_BUCKET_MB,
                         find_unused_parameters=opts.find_unused_parameters,
                         allreduce=opts.allreduce or native_allreduce, reduce_dtype=opts.reduce_dtype,
                         expert_comm=experts)
    if opts.zero in (1, 2):
        return ZeROModule(module, topo.comm(DP_CP), stage=opts.zero, bucket_cap_mb=opts.bucket_cap_mb or ZERO_BUCKET_MB,
                          collectives=opts.collectives,
                          offload_device=opts.offload_device if opts.offload == "optimizer" else None,
                          expert_comm=experts)

    shard, rep = fsdp_groups(topo, opts.replicate, opts.hybrid)
    return FSDPModule(module, shard, wrap=opts.wrap, reshard_after_forward=opts.reshard_after_forward,
                      replicate=rep, param_init_fn=opts.param_init_fn, device=topo.device,
                      dp_comm=topo.comm(DP_CP), collectives=opts.collectives, offload=opts.offload,
                      offload_device=opts.offload_device, expert_comm=experts)


def data_parallel(chunks: nn.ModuleList, optimizer_fn: OptimizerFactory, topo: Topology,
                  opts: DataParallelOptions) -> tuple[Owners | None, torch.optim.Optimizer]:
    """Wrap each chunk in place (``chunks[c]`` becomes its wrapper); returns (owner, optimizer).

    The owner is None for DDP (the optimizer steps the chunks' own parameters),
    else the :class:`Owners` a :class:`~shardwise.parallel.dp.zero.ShardedOptimizer` drives.
    ZeRO-1 reduces at the optimizer step, so one wrapper owns every chunk;
    ZeRO-2 and FSDP reduce inside each chunk's backward, so each chunk gets its own.
    """
    if opts.zero == 0:
        if topo.size(DP_CP) > 1:
            # One DDP per chunk: a chunk's final backward is where its buckets reduce.
            for c in range(len(chunks)):
                chunks[c] = wrap_module(chunks[c], topo, opts)
        return None, optimizer_fn([p for c in chunks for p in c.parameters()])
    if opts.zero == 1:
        # One wrapper over every chunk, not one of the chunks: its parameters are the
        # chunks' own, and it reduces at the optimizer step (or the clip).
        owner = Owners([wrap_module(nn.ModuleList(list(chunks)), topo, opts)])
    else:
        for c in range(len(chunks)):
            chunks[c] = wrap_module(chunks[c], topo, opts)
        owner = Owners(list(chunks))
    params = [s for w in owner.wrappers for s in w.shard_params]
    return owner, ShardedOptimizer(optimizer_fn(params), owner)


def parallelize(model: nn.Module, optimizer_fn: OptimizerFactory, topo: Topology, *,
                tp_plan: Any = None, split_points: Sequence[str] | None = None, chunks: int = 1, tied: str = "sync",
                data: DataParallelOptions = DataParallelOptions(),
                sequence_parallel: bool = False, cp_mode: str = RING,
                capacity_factor: float | None = None, shape: str = "loop") -> tuple[Any, torch.optim.Optimizer]:
    """``model`` split, tensor-parallelized and data-parallel-wrapped for ``topo``, in the order of the module
    docstring; returns (this rank's :class:`~shardwise.parallel.pp.build.PipelineModel`, its optimizer).

    Every size-1 dimension is a no-op, so the same function builds pp-only,
    tp x pp, dp x pp, dp x tp and dp x tp x pp layouts.
    """
    if data.zero == 3 and any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("a meta-device model is supported by the fsdp/zero3/hsdp strategies, not yet when "
                         "composed with tensor or pipeline parallelism (it needs real weights to split)")
    tp = topo.comm(TP)

    def split_tp(m: nn.Module, keep: Callable[[str], bool]) -> nn.Module:
        return apply_tp(m, tp_plan, tp, keep, sequence_parallel=sequence_parallel)

    pm = build_pipeline(on_device(model, topo.device), topo, split_points, chunks, tied,
                        split_tp if topo.size(TP) > 1 else None, shape)  # shape: the schedule's placement
    if topo.size(CP) > 1:
        pm.context = ContextParallel(topo.comm(CP), cp_mode)
        for chunk in pm.chunks:
            apply_context_parallel(chunk, pm.context)
    if topo.size(EP) > 1 or capacity_factor is not None:
        dispatcher = ExpertParallel(topo.comm(EP) if topo.size(EP) > 1 else None, topo.stats, capacity_factor)
        replaced: dict[int, nn.Parameter] = {}
        for chunk in pm.chunks:
            replaced.update(apply_expert_parallel(chunk, dispatcher))
        pm.claimed = {k: replaced.get(id(t), t) for k, t in pm.claimed.items()}
    owner, optimizer = data_parallel(pm.chunks, optimizer_fn, topo, data)
    pm.data = owner
    return pm, optimizer


__all__ = ["DataParallelOptions", "Owners", "data_parallel", "fsdp_groups", "parallelize", "wrap_module"]
