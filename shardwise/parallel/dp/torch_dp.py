"""PyTorch's own data-parallel engines, built the way shardwise builds its own: one place for both users.

``engine="torch"`` (:mod:`shardwise.strategies.torch_engine.wrappers`) trains with these, and
``shardwise bench`` races them against ours, so the construction is written once, here:

* :func:`torch_ddp`: ``torch.nn.parallel.DistributedDataParallel`` on the data-parallel group, with
  :func:`torch_sync_batchnorm` (``nn.SyncBatchNorm``) when the run asks for it;
* :func:`zero_redundancy`: ``ZeroRedundancyOptimizer`` over the groups of an optimizer built by the run's
  factory (ZeRO-1 under DDP);
* :func:`fully_shard_units`: FSDP2 ``fully_shard`` on the units our FSDP picks
  (:func:`~shardwise.parallel.dp.fsdp_units.unit_modules`: bottom-up, the root last) over a 1-D mesh
  (:func:`dp_mesh`), the 2-D (replicate, shard) mesh of HSDP (:func:`hsdp_mesh`), or, after tp
  (:mod:`shardwise.parallel.tp.torch_tp`) or on pipeline stages, the run's ``dp_shard`` dimension or both
  (:func:`composed_mesh`).

FSDP2 keeps every parameter's name and holds it as a DTensor sharded on dim 0 in
``torch.chunk`` pieces (rank ``r`` of the shard dimension holds rows ``[r * ceil(n / W), ...)``,
the last ranks fewer or none; HSDP's replicas hold the same pieces); :func:`~shardwise.parallel.dtensor.dim0_run`
says where a rank's piece sits in the flattened tensor, the form of :class:`~shardwise.checkpoint.held.Held`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardwise.comm.topology import Topology
from shardwise.dims import DP, DP_REPLICATE, DP_SHARD


def torch_ddp(model: nn.Module, topo: Topology, bucket_cap_mb: float | None = None,
              find_unused_parameters: bool = False, dim: str = DP,
              cls: type[DistributedDataParallel] = DistributedDataParallel) -> DistributedDataParallel:
    """torch's DDP over ``topo``'s data-parallel group (``bucket_cap_mb`` None: torch's default); ``dim`` names
    another group that averages gradients (``dp_cp`` under context parallelism); ``cls`` a subclass of torch's
    DDP (a pipeline stage's)."""
    ids = [topo.device.index] if topo.device.type == "cuda" else None
    extra = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    return cls(model, device_ids=ids, process_group=topo.group(dim), find_unused_parameters=find_unused_parameters,
               **extra)  # type: ignore[arg-type]


def torch_sync_batchnorm(model: nn.Module, topo: Topology) -> nn.Module:
    """``model`` with its BatchNorm layers as torch's ``nn.SyncBatchNorm`` over ``topo``'s data-parallel group
    (CUDA inputs only; in a group of one it normalises as BatchNorm does). The root is returned: a model that
    is itself a BatchNorm is replaced, not changed."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=topo.group(DP))  # type: ignore[no-any-return]


def dp_mesh(topo: Topology) -> DeviceMesh:
    """The 1-D mesh over ``topo``'s data-parallel ranks: a sub-mesh of the run's mesh, or a mesh of one in a
    process group of one (where the topology builds no mesh)."""
    if topo.mesh is None:
        return init_device_mesh(topo.device.type, (1,), mesh_dim_names=(DP,))
    # From the dp group itself: slicing the run's mesh at its flattened dp dim warns that torch will drop it.
    return DeviceMesh.from_group(topo.group(DP), topo.device.type, mesh_dim_names=(DP,))  # type: ignore[arg-type]


def dp_shard_mesh(topo: Topology) -> DeviceMesh:
    """The run's ``dp_shard`` mesh dimension, sliced from its mesh: FSDP2 over parameters that are already
    DTensors on the run's ``tp`` dimension needs both on one root mesh."""
    return topo.mesh[DP_SHARD]  # type: ignore[index]  # dp > 1: the run has a mesh


def hsdp_mesh(topo: Topology) -> DeviceMesh:
    """The 2-D (replicate, shard) mesh of HSDP over ``topo``'s data-parallel ranks: the run's own mesh sliced
    (its dims already group dp into replicas of shards), or a 1 x 1 mesh in a process group of one."""
    if topo.mesh is None:
        return init_device_mesh(topo.device.type, (1, 1), mesh_dim_names=(DP_REPLICATE, DP_SHARD))
    return topo.mesh[DP_REPLICATE, DP_SHARD]


def composed_mesh(topo: Topology, replicate: int) -> DeviceMesh:
    """The mesh FSDP2 shards over in a composition (after tp, or on pipeline stages): the run's ``dp_shard``
    dimension, or with replicas HSDP's ``(dp_replicate, dp_shard)``, sliced from the run's mesh, the root that
    tp's DTensors live on too."""
    return hsdp_mesh(topo) if replicate > 1 else dp_shard_mesh(topo)


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
    zero.state = zero.optim.state
    return zero


def fully_shard_units(units: Iterable[nn.Module], mesh: DeviceMesh, reshard_after_forward: bool = True,
                      offload_policy: OffloadPolicy | None = None) -> None:
    """FSDP2 on each unit in order (bottom-up, the root last: a unit owns the parameters no unit below it took);
    ``offload_policy``: FSDP2's, the same for every unit (None: nothing offloaded)."""
    for m in units:
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload_policy or OffloadPolicy())


__all__ = ["composed_mesh", "dp_mesh", "dp_shard_mesh", "fully_shard_units", "hsdp_mesh", "torch_ddp",
           "torch_sync_batchnorm", "zero_redundancy"]
