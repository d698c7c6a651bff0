"""The data-parallel family as presets of one door: DDP, ZeRO-1/2, ZeRO-3/FSDP and HSDP.

Each member only says which :class:`~shardwise.parallel.parallelize.DataParallelOptions`
it wants (:meth:`DataParallel.data_options`) and which layout that is
(:meth:`~shardwise.strategies.base.Strategy.layout`). Building the wrapper
(through :func:`~shardwise.parallel.parallelize.wrap_module`, the same door
``sw.Parallel`` uses for each pipeline chunk), the optimizer over what this
rank holds, and clipping by the global norm are written once, here.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.parallel.dp.zero import ShardedOptimizer, zero_clip_grad_norm
from shardwise.parallel.parallelize import DataParallelOptions, wrap_module
from shardwise.step import OptimizerFactory
from shardwise.strategies.base import Strategy


def on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


class DataParallel(Strategy):
    """Base of the data-parallel presets: one wrapper over the whole model, on the dp group."""

    # The label of the scalar all-reduce that sums the squared norm of sharded gradients.
    clip_label: ClassVar[str] = "zero_clip"

    def data_options(self, topo: Topology) -> DataParallelOptions:
        raise NotImplementedError

    def check_setup(self, model: nn.Module) -> None:
        """Refuse a model this member cannot wrap (ZeRO-1/2 keep full parameters: no meta-device model)."""

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        opts = self.data_options(topo)
        self.check_setup(model)
        if not on_meta(model):  # a meta-device model is materialised shard by shard by FSDP
            model = model.to(topo.device)
        wrapped: Any = wrap_module(model, topo, opts)
        if opts.zero == 0:  # DDP: every rank steps the full parameters
            return wrapped, optimizer_fn(model.parameters())
        return wrapped, ShardedOptimizer(optimizer_fn(wrapped.shard_params), wrapped)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        if not hasattr(model, "shard_grads"):  # DDP: the averaged gradients are equal on every rank
            return super().clip_grad_norm(model, max_norm, topo)
        model.before_step()  # type: ignore[operator]  # reduce now: the norm needs the averaged gradient
        # Each rank holds disjoint pieces over the shard group (HSDP replicas hold equal ones).
        return zero_clip_grad_norm(
            model.shard_grads(),  # type: ignore[operator]
            max_norm,
            model.comm,  # type: ignore[arg-type]
            self.clip_label,
            device=topo.device,
        )


__all__ = ["DataParallel", "on_meta"]
