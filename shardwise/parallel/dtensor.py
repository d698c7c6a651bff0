"""DTensor helpers both engines read: a rank's part of a tensor, the whole of it, and where a piece sits.

torch's engines (FSDP2, torch's tp, its pipelining) hold parameters as DTensors; our pipeline and our
checkpoints meet the same tensors when ``engine="torch"`` built them. Each helper takes any tensor: a plain
one is whole and local, so a caller need not ask which engine made it.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.dims import TP


def dim0_run(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``(start, data)`` of what this rank holds of ``t``: for a DTensor sharded on dim 0 over one data-parallel
    mesh dimension (replicated over any other, or sliced over a ``tp`` one first), the flat offset of its rows
    in its tp slice and a 1-D view of them (live storage; the local tensor itself where that dimension has one
    rank); any other tensor is whole: ``(0, t)``.

    FSDP2 over tp shards each rank's tp slice (``_StridedShard``: the dp pieces are ``torch.chunk`` pieces of
    the tp-local tensor), so the rows counted here are the slice's."""
    if not isinstance(t, DTensor):
        return 0, t
    names, shape, sharded = t.device_mesh.mesh_dim_names or (), list(t.shape), []
    for i, p in enumerate(t.placements):
        if i < len(names) and names[i] == TP:
            if isinstance(p, Shard):
                shape[p.dim] //= t.device_mesh.size(i)  # the plans' checks make every tp split even
        elif not isinstance(p, Replicate):
            sharded.append(i)
    dp = t.placements[sharded[0]] if len(sharded) == 1 else None
    # Shard(0), or FSDP2-over-tp's _StridedShard(0) (not a Shard subclass): both hold rows of dim 0.
    if dp is None or dp.is_partial() or getattr(dp, "dim", None) != 0:
        raise ValueError(f"expected a DTensor sharded on dim 0 over one data-parallel mesh dimension, got placements "
                         f"{t.placements} on mesh dimensions {names}")
    rows, world = shape[0], t.device_mesh.size(sharded[0])
    first = min(t.device_mesh.get_local_rank(sharded[0]) * math.ceil(rows / world), rows)
    local = t.to_local()
    return first * math.prod(shape[1:]), local if world == 1 else local.view(-1)  # one piece: the whole slice


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard, a view; any other tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank of its mesh calls it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


__all__ = ["dim0_run", "full", "local"]
