"""TODO docstring."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.layout import RunLayout
from shardwise.parallel.zero import ShardedOptimizer, check_offload, zero_clip_grad_norm
from shardwise.parallel.zero_module import ZeROModule
from shardwise.step import OptimizerFactory
from shardwise.strategies.base import Strategy


def _check_not_meta(model: nn.Module, name: str) -> None:
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(f"strategy {name!r} keeps full parameters on every rank, so it cannot set up a model "
                         "on the meta device; use 'zero3' or 'fsdp', which materialise it shard by shard")


@dataclass
class ZeRO1(Strategy):
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

    bucket_cap_mb: float = 4.0
    collectives: str = "auto"
    offload: str = "none"
    offload_device: str = "cpu"
    name: ClassVar[str] = "zero1"
    stage: ClassVar[int] = 1

    def __post_init__(self) -> None:
        check_offload(self.offload, self.name, self.stage)

    def describe(self, devices: int) -> RunLayout:
        return replace(super().describe(devices), zero=self.stage, offload=self.offload)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        from shardwise.parallel.parallelize import DataParallelOptions, wrap_module

        _check_not_meta(model, self.name)
        opts = DataParallelOptions(zero=self.stage, bucket_cap_mb=self.bucket_cap_mb, collectives=self.collectives,
                                   offload=self.offload, offload_device=self.offload_device)
        wrapped = wrap_module(model.to(topo.device), topo, opts)
        return wrapped, ShardedOptimizer(optimizer_fn(wrapped.shard_params), wrapped)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        zm: ZeROModule = model  # type: ignore[assignment]
        zm.before_step()
        return zero_clip_grad_norm(zm.shard_grads(), max_norm, zm.comm, "zero_clip", device=topo.device)


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
