"""TODO docstring."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.step import OptimizerFactory
from shardwise.strategies.base import Strategy

if TYPE_CHECKING:
    pass


@dataclass
class DDP(Strategy):
    """Our distributed data parallel (see :mod:`shardwise.parallel.ddp`)."""

    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    allreduce: str = "native"
    reduce_dtype: str | None = None  # e.g. "bfloat16": gradients travel in this dtype
    name: ClassVar[str] = "ddp"

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        from shardwise.parallel.parallelize import DataParallelOptions, wrap_module

        model = model.to(topo.device)
        opts = DataParallelOptions(zero=0, bucket_cap_mb=self.bucket_cap_mb,
                                   find_unused_parameters=self.find_unused_parameters,
                                   allreduce=allreduce_fn(self.allreduce),
                                   reduce_dtype=getattr(torch, self.reduce_dtype) if self.reduce_dtype else None)
        return wrap_module(model, topo, opts), optimizer_fn(model.parameters())


def allreduce_fn(name: str) -> Callable[..., Any]:
    """DDP's all-reduce algorithm by name: ``"native"`` (the backend's), ``"naive"`` or ``"ring"``."""
    from shardwise.comm.algorithms import ALGORITHMS
    from shardwise.parallel.ddp import native_allreduce

    table = {"native": native_allreduce, **ALGORITHMS}
    if name not in table:
        raise ValueError(f"unknown all-reduce algorithm {name!r}; valid: {sorted(table)}")
    return table[name]
