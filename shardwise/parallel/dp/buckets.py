"""The default bucket sizes of the data-parallel wrappers, written once.

Gradients are reduced (and ZeRO's parameters gathered) one bucket at a time
(:func:`shardwise.parallel.dp.ddp.bucket_params`, the one bucketer). The wrappers,
the strategies (``sw.DDP()``, ``sw.ZeRO1()``..., and ``sw.Parallel()`` when its
``bucket_cap_mb`` is left unset) and the planner all read these constants, so
a run and its plan can never disagree about the default. No torch here: the
planner's torch-free command line imports it.
"""
from __future__ import annotations

# MiB per bucket under DDP: torch's DistributedDataParallel default (bucket_cap_mb=25), large enough that the
# per-collective latency is paid rarely, small enough that the first bucket's all-reduce overlaps backward.
DDP_BUCKET_MB = 25.0

# MiB per bucket under ZeRO-1/2: smaller, because ZeRO-2 keeps the full (unsharded) gradients only of the
# buckets in flight (two at a time), so the bucket size is that stage's extra memory.
ZERO_BUCKET_MB = 4.0

__all__ = ["DDP_BUCKET_MB", "ZERO_BUCKET_MB"]
