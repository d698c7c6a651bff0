"""ZeRO-3, FSDP and HSDP: parameters, gradients and optimizer states all sharded, in units.

ZeRO stage 3 (Rajbhandari et al. 2020, section 5.3, P_os+g+p) keeps only
``1/N`` of every parameter on each rank and gathers a layer's parameters just
before they are used. PyTorch FSDP (Zhao et al. 2023, "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", VLDB) organises this in
*units* of modules:

* before a unit's forward its parameters are all-gathered (the next unit's
  gather is started at the same time: forward prefetch), and freed after it
  unless ``reshard_after_forward=False``;
* before the unit's backward they are all-gathered again (the previous unit
  in forward order is prefetched), and once every gradient of the unit has
  accumulated the gradients are reduce-scattered and the full ones freed.

Per step that is 3 x (N-1)/N x Psi bytes per rank (ZeRO paper section 7.2.2:
two all-gathers and one reduce-scatter), 2 x with ``reshard_after_forward=False``.

HSDP (the "hybrid" sharding strategy of the FSDP paper, section 3.2.2) shards
inside groups of ``shard_size`` ranks and keeps the groups as replicas: after
the reduce-scatter inside a group, each piece is all-reduced across groups.

Mechanics. The module keeps its original ``nn.Parameter`` objects (so its
code, hooks and state-dict names are untouched); each one's storage is a
padded flat buffer that is resized to zero bytes while the unit is sharded
and refilled by the all-gather (the storage trick of FSDP's first version:
autograd's saved references to the parameter see the refilled data in
backward). The sharded truth lives in one flat rank-major row per unit
(see :mod:`shardwise.parallel.dp.sharding`), and the real torch optimizer steps
views of it.

A model built on the meta device is materialised one module at a time:
each module's own parameters are allocated, initialised (``param_init_fn`` or
the module's ``reset_parameters``), copied into this rank's shard and freed
before the next module, so no rank ever holds more than one module's full
parameters plus its shards.

The wrapper :class:`~shardwise.parallel.dp.fsdp_module.FSDPModule` and the unit machinery
(:mod:`shardwise.parallel.dp.fsdp_units`) are the mechanism; this module holds the strategies.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, TypeVar

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.dims import DP, ParallelDims
from shardwise.layout import RunLayout
from shardwise.parallel.dp.fsdp_module import FSDPModule
from shardwise.parallel.dp.fsdp_units import WrapPolicy
from shardwise.parallel.dp.zero import check_offload
from shardwise.parallel.parallelize import DataParallelOptions
from shardwise.step import unwrap
from shardwise.strategies.dp.family import DataParallel

AnyFSDP = TypeVar("AnyFSDP", bound="FSDP")


@dataclass
class FSDP(DataParallel):
    """Fully sharded data parallel: ZeRO-3 in units, one per block/layer by default (``wrap="auto"``).

    Args:
        wrap: which modules are units (see :func:`unit_modules`).
        reshard_after_forward: free each unit's parameters after its forward
            (3 x Psi per step); ``False`` keeps them until its backward (2 x Psi, more memory).
        param_init_fn: initialises one module of a meta-device model in place
            (default: the module's ``reset_parameters()``).
        collectives: ``"native"`` (the backend's all-gather and reduce-scatter),
            ``"p2p"`` (pairwise isend/irecv exchange, same bytes) or ``"auto"``
            (p2p on gloo, whose reduce-scatter is slow; native otherwise).
        offload: ``"optimizer"``: each unit's optimizer row, gradient shard and
            optimizer states live on ``offload_device`` and the update runs
            there; the training device keeps a shard copy that is refreshed
            only after the row changed. ``"all"``: the training device keeps no
            shard at all, each gather copies the row over first (ZeRO-Offload,
            Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021). ``"none"``: default.
        offload_device: where offloaded state lives (default ``"cpu"``).
    """

    wrap: WrapPolicy = "auto"
    reshard_after_forward: bool = True
    param_init_fn: Callable[[nn.Module], None] | None = None
    collectives: str = "auto"
    offload: str = "none"
    offload_device: str = "cpu"
    name: ClassVar[str] = "fsdp"
    clip_label: ClassVar[str] = "fsdp_clip"
    hybrid: ClassVar[bool] = False  # HSDP's 2-D (replicate, shard) groups

    def __post_init__(self) -> None:
        check_offload(self.offload, self.name, 3)

    def layout(self, devices: int) -> RunLayout:
        return RunLayout(self.name, dp=devices, zero=3, replicate=self._replicas_of(devices), offload=self.offload,
                         wrap=self.wrap)

    def materialises_meta(self) -> bool:
        return True

    def with_param_init(self: AnyFSDP, init: Callable[[nn.Module], None]) -> AnyFSDP:
        return replace(self, param_init_fn=self.param_init_fn or init)

    def _replicas_of(self, dp: int) -> int:
        """HSDP replicas over ``dp`` ranks (1: shard over all of dp)."""
        return 1

    def data_options(self, topo: Topology) -> DataParallelOptions:
        return DataParallelOptions(zero=3, replicate=self._replicas_of(topo.size(DP)), hybrid=self.hybrid,
                                   collectives=self.collectives, offload=self.offload,
                                   offload_device=self.offload_device, wrap=self.wrap,
                                   reshard_after_forward=self.reshard_after_forward, param_init_fn=self.param_init_fn)

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        return self._gathered(model, keep=True)

    def final_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        """Rank 0's: the other ranks take part in each unit's all-gather and keep nothing of it, so no rank but
        rank 0 ever holds more than its shards and one unit gathered."""
        return self._gathered(model, keep=topo.rank == 0)

    def _gathered(self, model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
        fm: FSDPModule = model  # type: ignore[assignment]
        full = fm.gather_full(keep)
        if not keep:
            return {}
        out: dict[str, torch.Tensor] = {}
        for k, v in unwrap(model).state_dict(keep_vars=True).items():
            out[k] = full[v].clone() if v in full else v.detach().cpu().clone()
        return out


@dataclass
class ZeRO3(FSDP):
    """ZeRO stage 3: FSDP with size-based units (a module becomes a unit at ``wrap`` parameters)."""

    wrap: WrapPolicy = 100_000
    name: ClassVar[str] = "zero3"


@dataclass
class HSDP(FSDP):
    """Hybrid sharding: shard inside groups of ``shard_size`` data-parallel ranks, replicate across groups.

    The modern form of "shard inside a node, data parallel across nodes": the
    all-gathers and reduce-scatters stay inside a group (a node's fast links),
    and only one all-reduce of each ``1/shard_size`` gradient piece crosses groups.
    ``shard_size`` defaults to 2 (1 when the data-parallel size is odd).
    """

    shard_size: int | None = None
    name: ClassVar[str] = "hsdp"
    hybrid: ClassVar[bool] = True


    def _replicas_of(self, dp: int) -> int:
        shard = self.shard_size if self.shard_size is not None else (2 if dp % 2 == 0 else 1)
        return ParallelDims(dp_shard=dp).with_shards(shard).dp_replicate  # dims.py checks that shard divides dp
