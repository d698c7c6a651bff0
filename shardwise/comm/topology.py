"""The explicit, validated layout of a run: parallel sizes -> device mesh -> groups.

A :class:`Topology` is created once per process and handed to every strategy
as an argument; nothing in the library reads process groups from globals.
Mesh dimensions follow torchtitan's order, outermost first: ``pp``, ``dp``,
``tp`` (``tp`` innermost, so a tensor-parallel group is made of neighbouring
ranks, the ones on the same node).
"""
from __future__ import annotations

import datetime as _dt
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardwise.comm import Comm, CommStats, Diagnostics
from shardwise.comm.diagnostics import default_store

DIMS = ("pp", "dp", "tp")


def pick_device(accelerator: str, local_rank: int) -> torch.device:
    """``auto`` takes CUDA when present, else CPU."""
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("accelerator='cuda' was asked for but torch.cuda.is_available() is False")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if accelerator == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown accelerator {accelerator!r}; valid: 'auto', 'cpu', 'cuda'")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class Topology:
    """Parallel sizes of a run and the groups that realise them.

    Build with :meth:`create` inside an initialised process group (or with
    world size 1 without one).
    """

    sizes: dict[str, int]
    device: torch.device
    rank: int = 0
    world_size: int = 1
    stats: CommStats = field(default_factory=CommStats)
    timeout: _dt.timedelta = _dt.timedelta(minutes=5)
    mesh: object | None = None  # torch DeviceMesh when distributed
    diag: Diagnostics | None = None
    _groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    _dp_splits: dict[int, object] = field(default_factory=dict)

    @staticmethod
    def validate(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1) -> dict[str, int]:
        """Check that the sizes multiply to the world size; ``dp=-1`` means 'the rest'."""
        for name, v in (("tp", tp), ("pp", pp)):
            if v < 1:
                raise ValueError(f"{name}={v}: parallel sizes must be >= 1")
        if dp == -1:
            if world_size % (tp * pp):
                raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
            dp = world_size // (tp * pp)
        if dp < 1:
            raise ValueError(f"dp={dp}: parallel sizes must be >= 1")
        if dp * tp * pp != world_size:
            raise ValueError(
                f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} does not equal the world size {world_size}; "
                f"choose sizes whose product is {world_size} (or pass devices={dp * tp * pp})")
        return {"pp": pp, "dp": dp, "tp": tp}

    @classmethod
    def create(cls, device: torch.device, dp: int = -1, tp: int = 1, pp: int = 1,
               timeout: _dt.timedelta = _dt.timedelta(minutes=5), debug: bool = False) -> "Topology":
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        sizes = cls.validate(world, dp, tp, pp)
        topo = cls(sizes=sizes, device=device, rank=rank, world_size=world, timeout=timeout)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            # DeviceMesh builds one group per dimension for us; size-1 dims keep
            # every strategy's code path identical whatever the layout.
            topo.mesh = init_device_mesh(device.type, tuple(sizes[d] for d in DIMS), mesh_dim_names=DIMS)
            for d in DIMS:
                topo._groups[d] = topo.mesh.get_group(d)  # type: ignore[attr-defined]
            topo._groups["world"] = None
            topo.diag = Diagnostics(rank, default_store(), debug=debug)
        return topo

    def size(self, dim: str) -> int:
        return math.prod(self.sizes.values()) if dim == "world" else self.sizes[dim]

    def coord(self, dim: str) -> int:
        """This rank's index along ``dim``."""
        if self.world_size == 1:
            return 0
        if dim == "world":
            return self.rank
        return dist.get_rank(self._groups[dim])

    def comm(self, dim: str = "world") -> Comm:
        """A communicator on the group of ``dim`` ("pp", "dp", "tp" or "world")."""
        if self.world_size == 1:
            return Comm(None, self.stats, self.timeout)
        return Comm(self._groups[dim], self.stats, self.timeout, self.diag, label=dim)

    def close(self) -> None:
        """Stop the diagnostics thread (the process group itself is torn down by :func:`teardown`)."""
        if self.diag is not None:
            self.diag.close()

    def group(self, dim: str) -> dist.ProcessGroup | None:
        return self._groups.get(dim)

    def dp_split(self, shard: int) -> object:
        """The data-parallel ranks as a 2-D ``("dp_replicate", "dp_shard")`` DeviceMesh (for HSDP).

        ``shard`` consecutive dp ranks form a sharding group; the groups are
        replicas of each other. Built from the world mesh ``(pp, dp/shard,
        shard, tp)``, so it composes with the other dimensions. A collective
        (creates groups on first use, cached per ``shard``); ``None`` with one process.
        """
        dp = self.sizes["dp"]
        if shard < 1 or dp % shard:
            raise ValueError(f"HSDP shard size {shard} must be a positive divisor of the data-parallel size {dp}")
        if self.world_size == 1:
            return None
        if shard not in self._dp_splits:
            from torch.distributed.device_mesh import init_device_mesh

            names = ("pp", "dp_replicate", "dp_shard", "tp")
            mesh = init_device_mesh(self.device.type, (self.sizes["pp"], dp // shard, shard, self.sizes["tp"]),
                                    mesh_dim_names=names)
            self._dp_splits[shard] = mesh["dp_replicate", "dp_shard"]
        return self._dp_splits[shard]


def teardown() -> None:
    """Barrier, then destroy: without the barrier a rank can abort at exit."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def threads_per_rank(local_world_size: int) -> int:
    """Cores divided among the ranks on this host, so they do not oversubscribe."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))
