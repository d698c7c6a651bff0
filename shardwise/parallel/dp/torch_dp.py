"""PyTorch's own data-parallel engines, built the way shardwise builds its own: one place for both users.

``engine="torch"`` (:mod:`shardwise.strategies.torch_engine.wrappers`) trains with these, and
``shardwise bench`` races them against ours, so the construction is written once, here:

* :func:`torch_ddp`: ``torch.nn.parallel.DistributedDataParallel`` on the data-parallel group, with
  :func:`torch_sync_batchnorm` (``nn.SyncBatchNorm``) when the run asks for it, and our ``reduce_dtype`` as
  torch's compress hook of that dtype (:func:`compress_gradients`);
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

What these engines cannot run of a strategy's options is refused beside them, before any process starts
(:func:`option_refusal`, :func:`refuse_reduce_dtype`), as is what torch runs on CUDA only
(:data:`DATA_PARALLEL_CUDA_ONLY`, :data:`SYNC_BATCHNORM_CUDA_ONLY`).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardwise.comm.topology import Topology
from shardwise.dims import DP, DP_REPLICATE, DP_SHARD

# DDP(reduce_dtype=...) -> torch's DDP communication hook (torch.distributed.algorithms.ddp_comm_hooks
# .default_hooks) that sends gradients in that dtype: the bucket cast, divided by the world size, summed, widened
# back. Ours divides before the cast: the same numbers wherever the division is exact (a power-of-two world,
# outside float16's subnormals).
COMPRESS_HOOKS = {"float16": "fp16_compress_hook", "bfloat16": "bf16_compress_hook"}
# Why torch runs these on CUDA only, not on CPU (torch 2.13; refused on CPU before any process starts).
DATA_PARALLEL_CUDA_ONLY = ("torch.nn.DataParallel splits the batch over CUDA devices only (on CPU it runs the module "
                           "unsplit, on one replica)")
SYNC_BATCHNORM_CUDA_ONLY = ("torch's nn.SyncBatchNorm takes CUDA inputs only (on CPU its forward raises 'SyncBatchNorm "
                            "expected input tensor to be on GPU', and its statistics kernel, batch_norm_stats, has no "
                            "CPU implementation)")


def option_refusal(*, offload: str, offload_device: str, allreduce: str, reduce_dtype: str | None,
                   fsdp_alone: bool) -> str | None:
    """Why torch's data-parallel engines cannot run these options of a strategy (None: they run them all): the
    end of the sentence "engine='torch' cannot run strategy X with ...". ``fsdp_alone``: the engine is FSDP2 on
    the whole model (fsdp, zero3, hsdp), the one that runs an offload."""
    if offload == "optimizer":
        return ("offload='optimizer': torch's one offload is FSDP2's CPUOffloadPolicy, which keeps the parameter "
                "shards on the CPU too and copies them over at each gather (our offload='all'); no torch engine "
                "keeps a shard on the device and offloads only the optimizer")
    if offload == "all" and not fsdp_alone:  # sw.Parallel(zero=3) runs as tp, then FSDP2
        return "offload='all' after tp: FSDP2's CPUOffloadPolicy is run here for fsdp, zero3 and hsdp alone"
    if offload != "none" and offload_device != "cpu":
        return f"offload_device={offload_device!r}: FSDP2's CPUOffloadPolicy offloads to the CPU only"
    if allreduce != "native":
        return (f"allreduce={allreduce!r}: torch's DDP all-reduces each bucket with the process group's own "
                "all-reduce (gloo's or NCCL's algorithm), so our algorithms have no place in it; use "
                "allreduce='native'")
    if reduce_dtype is not None and reduce_dtype not in COMPRESS_HOOKS:
        return (f"reduce_dtype={reduce_dtype!r}: torch's DDP sends gradients in float16 or bfloat16 only "
                "(fp16_compress_hook, bf16_compress_hook)")
    return None


def refuse_reduce_dtype(reduce_dtype: str | None, backend: str) -> None:
    """Refuse DDP's bfloat16 gradients on ``backend`` where torch's compress hook for them does not run."""
    if reduce_dtype == "bfloat16" and backend != "nccl":
        raise ValueError(f"engine='torch' cannot run DDP(reduce_dtype='bfloat16') on {backend}: torch's "
                         "bf16_compress_hook runs only with NCCL 2.10+ on CUDA (or XCCL); use "
                         "reduce_dtype='float16', or engine='shardwise'")


def torch_ddp(model: nn.Module, topo: Topology, bucket_cap_mb: float | None = None,
              find_unused_parameters: bool = False, dim: str = DP,
              cls: type[DistributedDataParallel] = DistributedDataParallel) -> DistributedDataParallel:
    """torch's DDP over ``topo``'s data-parallel group (``bucket_cap_mb`` None: torch's default); ``dim`` names
    another group that averages gradients (``dp_cp`` under context parallelism); ``cls`` a subclass of torch's
    DDP (a pipeline stage's)."""
    ids = [topo.device.index] if topo.device.type == "cuda" else None
    extra: dict[str, Any] = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    return cls(model, device_ids=ids, process_group=topo.group(dim), find_unused_parameters=find_unused_parameters,
               **extra)


def compress_gradients(ddp: DistributedDataParallel, topo: Topology, reduce_dtype: str | None) -> None:
    """Have ``ddp`` send its gradients in ``reduce_dtype`` (:data:`COMPRESS_HOOKS`; None: in their own)."""
    hook = COMPRESS_HOOKS.get(reduce_dtype or "")
    if hook is not None:
        ddp.register_comm_hook(topo.group(DP), getattr(default_hooks, hook))


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


__all__ = ["COMPRESS_HOOKS", "DATA_PARALLEL_CUDA_ONLY", "SYNC_BATCHNORM_CUDA_ONLY", "composed_mesh",
           "compress_gradients", "dp_mesh", "dp_shard_mesh", "fully_shard_units", "hsdp_mesh", "option_refusal",
           "refuse_reduce_dtype", "torch_ddp", "torch_sync_batchnorm", "zero_redundancy"]
