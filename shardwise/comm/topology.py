"""The explicit, validated layout of a run: :class:`~shardwise.dims.ParallelDims` -> device mesh -> groups.

A :class:`Topology` is created once per process and handed to every strategy
as an argument; nothing in the library reads process groups from globals.
The mesh has the dimensions of :data:`shardwise.dims.MESH`, outermost first
(``tp`` innermost, so a tensor-parallel group is made of neighbouring ranks,
the ones on the same node); every group, the flattened data-parallel one
included, is looked up by its dimension's name.
"""
from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.comm import Comm, CommStats, Diagnostics
from shardwise.comm.diagnostics import default_store
from shardwise.dims import (
    CP,
    DILOCO,
    DP,
    DP_CP,
    DP_REPLICATE,
    DP_SHARD,
    DP_SHARD_CP,
    EDP,
    EP,
    MESH,
    WORLD,
    ParallelDims,
)

ACCELERATORS = ("auto", "cpu", "cuda")
# Lightning's names, to ours: Trainer(accelerator="gpu") is CUDA.
ACCELERATOR_ALIASES = {"gpu": "cuda"}


def accelerator_name(accelerator: str) -> str:
    """One of ACCELERATORS for what was typed: in any case, Lightning's ``"gpu"`` being ``"cuda"``."""
    name = accelerator.lower() if isinstance(accelerator, str) else accelerator
    name = ACCELERATOR_ALIASES.get(name, name)
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {accelerator!r}; valid: 'auto', 'cpu', 'cuda'")
    return name


def uses_cuda(accelerator: str) -> bool:
    """``"cuda"``, or ``"auto"`` where CUDA is present (as :func:`pick_device` decides)."""
    return accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())


def pick_device(accelerator: str, local_rank: int) -> torch.device:
    """``auto`` takes CUDA when present, else CPU. ``"cuda:1,3"`` (``Trainer(devices=[1, 3])``) puts local
    rank r on the r-th GPU listed; plain ``"cuda"`` puts it on GPU r (modulo the GPUs there are)."""
    kind, _, listed = accelerator.partition(":")
    accelerator = accelerator_name(kind if listed else accelerator)
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("accelerator='cuda' was asked for but torch.cuda.is_available() is False")
        if listed:
            ids = [int(i) for i in listed.split(",")]
            return torch.device("cuda", ids[local_rank % len(ids)])
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class Topology:
    """The parallel dimensions of a run and the groups that realise them.

    Build with :meth:`create` inside an initialised process group (or with
    world size 1 without one).
    """

    dims: ParallelDims
    device: torch.device
    rank: int = 0
    world_size: int = 1
    stats: CommStats = field(default_factory=CommStats)
    timeout: _dt.timedelta = _dt.timedelta(minutes=5)
    mesh: DeviceMesh | None = None  # torch DeviceMesh when distributed
    diag: Diagnostics | None = None
    _groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    _regrouped: dict[int, tuple[Comm, Comm]] = field(default_factory=dict)
    _blocks: dict[int, tuple[Topology, Comm]] = field(default_factory=dict)

    @staticmethod
    def validate(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1) -> dict[str, int]:
        """Check that the sizes multiply to the world size (``dp=-1``: 'the rest'); their ``{pp, dp, tp}`` dict."""
        return ParallelDims.for_world(world_size, dp=dp, tp=tp, pp=pp).sizes()

    @classmethod
    def create(cls, device: torch.device, dims: ParallelDims | None = None, *,
               timeout: _dt.timedelta = _dt.timedelta(minutes=5), debug: bool = False, **sizes: int) -> Topology:
        """The topology of ``dims`` (or of ``**sizes`` as :meth:`ParallelDims.for_world` takes them, ``dp=-1``
        by default) on the running process group; every rank calls it (it creates the groups)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if dims is None:
            dims = ParallelDims.for_world(world, **sizes)
        elif sizes:
            raise TypeError(f"Topology.create takes dims or sizes, not both (got dims and {sorted(sizes)})")
        elif dims.world != world:
            raise ValueError(f"the layout {dims.label() or 'of one rank'} needs {dims.world} processes but the "
                             f"process group has {world}")
        topo = cls(dims=dims, device=device, rank=rank, world_size=world, timeout=timeout)
        if world > 1:
            # DeviceMesh builds one group per dimension for us; size-1 dims keep
            # every strategy's code path identical whatever the layout.
            topo._take_groups(init_device_mesh(device.type, dims.mesh_shape(), mesh_dim_names=MESH))
            if dims.ep > 1:
                topo._groups[EP], topo._groups[EDP] = _expert_groups(topo.mesh, dims)  # type: ignore[arg-type]
            topo._groups[WORLD] = None
            topo.diag = Diagnostics(rank, default_store(), debug=debug)
        return topo

    def _take_groups(self, mesh: DeviceMesh) -> None:
        """The groups of :data:`MESH` and the flattened data-parallel ones, from ``mesh`` (whose dimensions
        include those of MESH; it may have an outer one: :meth:`blocks`)."""
        self.mesh = mesh[MESH] if mesh.mesh_dim_names != MESH else mesh
        for d in MESH:
            self._groups[d] = mesh.get_group(d)
        self._groups[DP] = mesh[DP_REPLICATE, DP_SHARD]._flatten(DP).get_group()
        if self.dims.cp > 1:
            # Gradients of a replica's parameters come from every cp rank's tokens: averaged over
            # dp x cp, sharded over dp_shard x cp (torchtitan's flattened dp_cp and dp_shard_cp).
            self._groups[DP_CP] = mesh[DP_REPLICATE, DP_SHARD, CP]._flatten(DP_CP).get_group()
            self._groups[DP_SHARD_CP] = mesh[DP_SHARD, CP]._flatten(DP_SHARD_CP).get_group()

    def blocks(self, count: int, inner: ParallelDims) -> tuple[Topology, Comm]:
        """The world cut into ``count`` blocks of consecutive ranks (DiLoCo's replicas), each laid out as
        ``inner``: (this rank's block as a topology of its own, the communicator across the blocks: the ranks
        at the same place of each). Its bytes count into this topology's stats, the group across under the
        label :data:`~shardwise.dims.DILOCO`. Created on first use (a collective: every rank calls it first
        at the same point), then kept."""
        if count not in self._blocks:
            self._blocks[count] = self._cut(count, inner)
        return self._blocks[count]

    def _cut(self, count: int, inner: ParallelDims) -> tuple[Topology, Comm]:
        size = self.world_size // count
        if inner.world != size or inner.ep > 1:
            raise ValueError(f"{count} blocks of {inner.label() or 'one rank'} ({inner.world} ranks, ep = 1) "
                             f"do not make the world of {self.world_size}")
        block = Topology(dims=inner, device=self.device, rank=self.rank % size, world_size=size, stats=self.stats,
                         timeout=self.timeout, diag=self.diag)
        if self.world_size == 1:
            return block, self._comm(None, DILOCO)
        mesh = init_device_mesh(self.device.type, (count, *inner.mesh_shape()), mesh_dim_names=(DILOCO, *MESH))
        block._take_groups(mesh)
        block._groups[WORLD] = mesh[MESH]._flatten(f"{DILOCO}_{WORLD}").get_group()  # the block is its world
        return block, self._comm(mesh.get_group(DILOCO), DILOCO)

    @property
    def sizes(self) -> dict[str, int]:
        """``{pp, dp, tp}`` (and cp, ep when used): see :meth:`ParallelDims.sizes`."""
        return self.dims.sizes()

    def size(self, dim: str) -> int:
        return self.dims.size(dim)

    def coord(self, dim: str) -> int:
        """This rank's index along ``dim``."""
        if self.world_size == 1:
            return 0
        if dim == WORLD:
            return self.rank
        return dist.get_rank(self._groups[self.dims.same_group(dim)])

    def comm(self, dim: str = WORLD) -> Comm:
        """A communicator on the group of ``dim`` (a name of :data:`shardwise.dims.NAMES`, or ``"world"``)."""
        if not self._groups:  # one process (a block of one rank has groups of one: group None is the world)
            return Comm(None, self.stats, self.timeout)
        dim = self.dims.same_group(dim)
        return self._comm(self._groups[dim], dim)

    def _comm(self, group: dist.ProcessGroup | None, label: str) -> Comm:
        # Every communicator counts into this topology's stats and reports to its diagnostics under its dim.
        return Comm(group, self.stats, self.timeout, self.diag, label=label)

    def close(self) -> None:
        """Stop the diagnostics thread (the process group itself is torn down by :func:`teardown`)."""
        if self.diag is not None:
            self.diag.close()

    def group(self, dim: str) -> dist.ProcessGroup | None:
        return self._groups.get(self.dims.same_group(dim))

    def replicas_and_shards(self, replicate: int) -> tuple[Comm, Comm] | None:
        """(shard comm, replicate comm) of the data-parallel ranks as ``replicate`` replicas of shards (HSDP).

        The mesh's own ``dp_shard``/``dp_replicate`` groups when the run's dims
        already split dp that way (the Trainer's and ``sw.setup``'s runs);
        otherwise (a Topology built by hand) a second mesh of the same world
        with dp regrouped, created on first use, a collective. ``None`` with one process.
        """
        regrouped = self.dims.with_replicas(replicate)  # checks that replicate divides dp
        if self.world_size == 1:
            return None
        if regrouped == self.dims:
            return self.comm(DP_SHARD), self.comm(DP_REPLICATE)
        if replicate not in self._regrouped:
            mesh = init_device_mesh(self.device.type, regrouped.mesh_shape(), mesh_dim_names=MESH)
            self._regrouped[replicate] = (self._comm(mesh.get_group(DP_SHARD), DP_SHARD),
                                          self._comm(mesh.get_group(DP_REPLICATE), DP_REPLICATE))
        return self._regrouped[replicate]


def _expert_groups(mesh: DeviceMesh, dims: ParallelDims) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ep, edp) groups of this rank: the dp x cp ranks of a (pp, tp) slice, read in mesh order, cut into blocks
    of ``ep`` neighbours (one block: every expert once), and the ranks at the same place of every block (they
    hold the same experts)."""
    ranks = mesh.mesh.reshape(dims.pp, dims.dp * dims.cp // dims.ep, dims.ep, dims.tp)
    ep_lists = [ranks[a, b, :, t].tolist() for a in range(dims.pp) for b in range(ranks.shape[1])
                for t in range(dims.tp)]
    edp_lists = [ranks[a, :, e, t].tolist() for a in range(dims.pp) for e in range(dims.ep) for t in range(dims.tp)]
    # Every rank creates every group, in the same order (making a group is a collective).
    ep_group, _ = dist.new_subgroups_by_enumeration(ep_lists)
    edp_group, _ = dist.new_subgroups_by_enumeration(edp_lists)
    return ep_group, edp_group


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
