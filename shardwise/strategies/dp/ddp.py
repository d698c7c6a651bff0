"""Distributed data parallel (``strategy="ddp"``): a full replica per rank, gradients averaged in buckets.

The mechanism is :class:`~shardwise.parallel.dp.ddp.DDPModule`; this preset of
:class:`~shardwise.strategies.dp.family.DataParallel` picks its options,
including the all-reduce algorithm by name (the backend's, or our naive and ring ones).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from shardwise.comm.algorithms import ALGORITHMS
from shardwise.comm.topology import Topology
from shardwise.parallel.dp.buckets import DDP_BUCKET_MB
from shardwise.parallel.dp.ddp import native_allreduce
from shardwise.parallel.parallelize import DataParallelOptions
from shardwise.strategies.dp.family import DataParallel


@dataclass
class DDP(DataParallel):
    """Our distributed data parallel (see :mod:`shardwise.parallel.dp.ddp`)."""

    bucket_cap_mb: float = DDP_BUCKET_MB
    find_unused_parameters: bool = False
    allreduce: str = "native"
    reduce_dtype: str | None = None  # e.g. "bfloat16": gradients travel in this dtype
    name: ClassVar[str] = "ddp"

    def data_options(self, topo: Topology) -> DataParallelOptions:
        return DataParallelOptions(zero=0, bucket_cap_mb=self.bucket_cap_mb,
                                   find_unused_parameters=self.find_unused_parameters,
                                   allreduce=allreduce_fn(self.allreduce),
                                   reduce_dtype=getattr(torch, self.reduce_dtype) if self.reduce_dtype else None)


def allreduce_fn(name: str) -> Callable[..., Any]:
    """DDP's all-reduce algorithm by name: ``"native"`` (the backend's), ``"naive"`` or ``"ring"``."""
    table = {"native": native_allreduce, **ALGORITHMS}
    if name not in table:
        raise ValueError(f"unknown all-reduce algorithm {name!r}; valid: {sorted(table)}")
    return table[name]
