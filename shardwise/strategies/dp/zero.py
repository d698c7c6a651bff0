"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 5): the optimizer states (stage 1), and the gradients too (stage 2), sharded over dp.

The mechanism is :class:`~shardwise.parallel.dp.zero_module.ZeROModule` with a
:class:`~shardwise.parallel.dp.zero.ShardedOptimizer`; these are presets of
:class:`~shardwise.strategies.dp.family.DataParallel`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from shardwise.comm.topology import Topology
from shardwise.layout import RunLayout
from shardwise.parallel.dp.buckets import ZERO_BUCKET_MB
from shardwise.parallel.dp.zero import check_offload
from shardwise.parallel.parallelize import DataParallelOptions
from shardwise.strategies.dp.family import DataParallel, on_meta


@dataclass
class ZeRO1(DataParallel):
    """ZeRO stage 1: optimizer states sharded; full parameters and gradients on every rank.

    Gradients are reduce-scattered in buckets while backward runs (overlapping
    it, as DDP's all-reduce does) and every rank keeps its full local
    gradients as well. Under ``no_sync`` nothing is sent and the last
    micro-batch's backward reduces the accumulated gradients; if every
    backward ran under ``no_sync`` the reduction happens at the optimizer step
    (or at gradient clipping, which needs it first).

    Args:
        bucket_cap_mb: parameters are reduced and gathered in buckets of about this size.
        collectives: ``"native"`` (the backend's reduce-scatter and all-gather),
            ``"p2p"`` (pairwise isend/irecv exchange, same bytes) or ``"auto"``
            (p2p on gloo, whose reduce-scatter is slow; native otherwise).
        offload: ``"optimizer"`` keeps this rank's master pieces, gradient
            pieces and optimizer states on ``offload_device`` and runs the
            update there (ZeRO-Offload, Ren et al. 2021); ``"none"`` (default)
            keeps everything on the training device. ``"all"`` needs sharded
            parameters (``ZeRO3``/``FSDP``/``HSDP``) and is an error here.
        offload_device: where offloaded state lives (default ``"cpu"``).
    """

    bucket_cap_mb: float = ZERO_BUCKET_MB
    collectives: str = "auto"
    offload: str = "none"
    offload_device: str = "cpu"
    name: ClassVar[str] = "zero1"
    stage: ClassVar[int] = 1

    def __post_init__(self) -> None:
        check_offload(self.offload, self.name, self.stage)

    def layout(self, devices: int) -> RunLayout:
        return RunLayout(self.name, dp=devices, zero=self.stage, offload=self.offload)

    def data_options(self, topo: Topology) -> DataParallelOptions:
        return DataParallelOptions(zero=self.stage, bucket_cap_mb=self.bucket_cap_mb, collectives=self.collectives,
                                   offload=self.offload, offload_device=self.offload_device)

    def check_setup(self, model: nn.Module) -> None:
        if on_meta(model):
            raise ValueError(f"strategy {self.name!r} keeps full parameters on every rank, so it cannot set up a "
                             "model on the meta device; use 'zero3' or 'fsdp', which materialise it shard by shard")


@dataclass
class ZeRO2(ZeRO1):
    """ZeRO stage 2: optimizer states and gradients sharded.

    Buckets are reduce-scattered while backward runs (overlapping it) and each
    rank keeps only its piece of the gradient. Under ``no_sync`` the full
    gradients accumulate locally and the last micro-batch's backward sends
    them, so accumulation costs no extra communication (it does hold the full
    gradients during the accumulation, as FSDP2 does).
    """

    name: ClassVar[str] = "zero2"
    stage: ClassVar[int] = 2
