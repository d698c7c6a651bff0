"""PyTorch's own data-parallel engines, built the way shardwise builds its own: one place for both users.

``engine="torch"`` (:mod:`shardwise.strategies.torch_engine`) trains with these, and
``shardwise bench`` races them against ours, so the construction is written once, here:

* :func:`torch_ddp`: ``torch.nn.parallel.DistributedDataParallel`` on the data-parallel group;
* :func:`zero_redundancy`: ``ZeroRedundancyOptimizer`` over the groups of an optimizer built by the run's
  factory (ZeRO-1 under DDP);
* :func:`fully_shard_units`: FSDP2 ``fully_shard`` on the units our FSDP picks
  (:func:`~shardwise.parallel.fsdp_units.unit_modules`: bottom-up, the root last) over a 1-D mesh
  (:func:`dp_mesh`), or the 2-D (replicate, shard) mesh of HSDP (:func:`hsdp_mesh`).

FSDP2 keeps every parameter's name and holds it as a DTensor sharded on dim 0 in
``torch.chunk`` pieces (rank ``r`` of the shard dimension holds rows ``[r * ceil(n / W), ...)``,
the last ranks fewer or none; HSDP's replicas hold the same pieces); :func:`dim0_run` says where a
rank's piece sits in the flattened tensor, the form of :class:`~shardwise.checkpoint.held.Held`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from shardwise.comm.topology import Topology
from shardwise.dims import DP, DP_REPLICATE, DP_SHARD


def torch_ddp(model: nn.Module, topo: Topology, bucket_cap_mb: float | None = None,
              find_unused_parameters: bool = False) -> DistributedDataParallel:
    """torch's DDP over ``topo``'s data-parallel group (``bucket_cap_mb`` None: torch's default)."""
    ids = [topo.device.index] if topo.device.type == "cuda" else None
    extra = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    return DistributedDataParallel(model, device_ids=ids, process_group=topo.group(DP),
                                   find_unused_parameters=find_unused_parameters, **extra)


def dp_mesh(topo: Topology) -> DeviceMesh:
    """The 1-D mesh over ``topo``'s data-parallel ranks: a sub-mesh of the run's mesh, or a mesh of one in a
    process group of one (where the topology builds no mesh)."""
    if topo.mesh is None:
        return init_device_mesh(topo.device.type, (1,), mesh_dim_names=(DP,))
    # From the dp group itself: slicing the run's mesh at its flattened dp dim warns that torch will drop it.
    return DeviceMesh.from_group(topo.group(DP), topo.device.type, mesh_dim_names=(DP,))


def hsdp_mesh(topo: Topology) -> DeviceMesh:
    """The 2-D (replicate, shard) mesh of HSDP over ``topo``'s data-parallel ranks: the run's own mesh sliced
    (its dims already group dp into replicas of shards), or a 1 x 1 mesh in a process group of one."""
    if topo.mesh is None:
        return init_device_mesh(topo.device.type, (1, 1), mesh_dim_names=(DP_REPLICATE, DP_SHARD))
    return topo.mesh[DP_REPLICATE, DP_SHARD]


def zero_redundancy(base: torch.optim.Optimizer, topo: Topology) -> torch.optim.Optimizer:
    """``ZeroRedundancyOptimizer`` over ``topo``'s data-parallel group with ``base``'s class and parameter groups.

    ``base`` is what the run's factory built (its groups already final): every group carries all its
    hyperparameters, so each rank's local optimizer is ``type(base)(its groups)`` with no defaults to pass
    (a class's ``defaults`` can hold keys its constructor refuses, as AdamW's ``decoupled_weight_decay``).
    The local optimizer's ``state`` (this rank's partition) becomes the wrapper's, where the Trainer, the
    checkpoint and the byte accounting read optimizer states.
    """
    # Loaded here: torch.distributed.optim scripts its functional optimizers on import (about 1 s, and
    # torch.jit's deprecation warnings) for every run that never builds one.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [{**g, "params": list(g["params"])} for g in base.param_groups]
    zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(base), process_group=topo.group(DP))
    zero.state = zero.optim.state  # type: ignore[has-type]
    return zero


def fully_shard_units(units: Iterable[nn.Module], mesh: DeviceMesh, reshard_after_forward: bool = True) -> None:
    """FSDP2 on each unit in order (bottom-up, the root last: a unit owns the parameters no unit below it took)."""
    for m in units:
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward)


def dim0_run(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``(start, data)`` of what this rank holds of ``t``: for a DTensor sharded on dim 0 over one mesh dimension
    (replicated over any other), the flat offset of its rows and a 1-D view of them (live storage); any other
    tensor is whole: ``(0, t)``."""
    if not isinstance(t, DTensor):
        return 0, t
    sharded = [i for i, p in enumerate(t.placements) if not isinstance(p, Replicate)]
    if len(sharded) != 1 or t.placements[sharded[0]] != Shard(0):
        raise ValueError(f"expected a DTensor sharded on dim 0 over one mesh dimension, got placements "
                         f"{t.placements}")
    rows, world = t.shape[0], t.device_mesh.size(sharded[0])
    first = min(t.device_mesh.get_local_rank(sharded[0]) * math.ceil(rows / world), rows)
    local = t.to_local()
    return first * math.prod(t.shape[1:]), local.view(-1)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank of its mesh calls it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


__all__ = ["dim0_run", "dp_mesh", "full", "fully_shard_units", "hsdp_mesh", "torch_ddp", "zero_redundancy"]
