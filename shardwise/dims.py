"""The parallel dimensions of a run: one value owns their names, their sizes and their rules.

Every other module names a dimension through the constants below (``topo.comm(TP)``,
``dims.size(DP)``); the strings themselves are written here and nowhere else in
the package (``tests/system/test_structure.py`` checks it). Adding a dimension starts
here: see docs/architecture.md, "How to add a parallel dimension".

The device mesh has the dimensions of :data:`MESH`, outermost first, in
torchtitan's order (``ParallelDims`` in torchtitan's ``parallel_dims.py``):

* ``pp``: pipeline stages (outermost: stages exchange only activations, the
  lightest traffic, so they may cross nodes);
* ``dp_replicate`` x ``dp_shard``: data parallelism, as replicas of shards
  (DDP is all replicas, ZeRO/FSDP all shards, HSDP both);
* ``cp``: context parallelism (the sequence split over ranks);
* ``tp``: tensor parallelism (innermost: a tp group is made of neighbouring
  ranks, the ones on one node, because it talks in every layer).

Four more names are derived, not mesh dimensions of their own: ``dp``, the
flattened data-parallel group (``dp_replicate * dp_shard`` ranks: what the data
is split over); ``dp_cp`` and ``dp_shard_cp``, the same with the cp ranks added
(the cp ranks of a replica hold the same parameters but see other tokens, so
gradients are averaged over ``dp_cp`` and sharded over ``dp_shard_cp``, as in
torchtitan); and ``ep``, expert parallelism, which borrows its ranks from
``dp * cp`` (torchtitan's from ``dp_shard * cp``) (each expert group sees different tokens).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

PP = "pp"
DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"
CP = "cp"
TP = "tp"
EP = "ep"
DP = "dp"  # the flattened data-parallel group: dp_replicate x dp_shard
DP_CP = "dp_cp"  # dp x cp: the ranks that hold one replica's parameters and see different tokens (DDP, losses)
DP_SHARD_CP = "dp_shard_cp"  # dp_shard x cp: where ZeRO/FSDP shard parameters and reduce-scatter gradients
EDP = "edp"  # expert data parallel: the ranks of dp_cp that hold the same experts (dp_cp / ep of them)
WORLD = "world"  # every rank: not a dimension, the name of the whole group
# DiLoCo's outer group: the ranks at the same place of each replica (a block of consecutive ranks), which average
# the pseudo-gradients. Not a dimension of the mesh above: a replica's own mesh is laid out inside its block.
DILOCO = "diloco"

MESH: tuple[str, ...] = (PP, DP_REPLICATE, DP_SHARD, CP, TP)  # the device mesh, outermost first
DERIVED: tuple[str, ...] = (DP, DP_CP, DP_SHARD_CP, EP, EDP)
SIZES: tuple[str, ...] = (PP, DP, TP)  # the classic three: Trainer.sizes, the checkpoint manifest, the CLI
SPLIT_BY: tuple[str, ...] = (DP, CP, TP, PP)  # the order "dp*cp*tp*pp = ..." names the sizes in messages
NAMES: tuple[str, ...] = MESH + DERIVED


@dataclass(frozen=True)
class ParallelDims:
    """Named sizes of the parallel dimensions; the world is their product (``ep`` is carved out of dp x cp).

    Build one with :meth:`for_world` (``dp=-1``: the ranks left over) or directly;
    either way it is valid once built: every size is at least 1 and ``ep``
    divides ``dp * cp``.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v}: parallel sizes must be >= 1")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"{EP}={self.ep} must divide {DP}*{CP} = {self.dp}*{self.cp}: experts are spread over "
                             f"the ranks that see different tokens")
        if self.ep > 1 and self.dp_replicate > 1 and self.dp_shard > 1:
            raise ValueError(f"{EP}={self.ep} with HSDP ({DP_REPLICATE}={self.dp_replicate} replicas of "
                             f"{DP_SHARD}={self.dp_shard} shards) is not supported; use replicate=1")

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel ranks: the batch is split ``dp`` ways."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return math.prod(self.size(d) for d in MESH)

    def size(self, name: str) -> int:
        """The size of a dimension (``dp``, ``ep`` and ``world`` included) by name."""
        if name == WORLD:
            return self.world
        if name == DP:
            return self.dp
        if name == DP_CP:
            return self.dp * self.cp
        if name == DP_SHARD_CP:
            return self.dp_shard * self.cp
        if name == EDP:
            return self.dp * self.cp // self.ep
        if name not in NAMES:
            raise KeyError(f"unknown parallel dimension {name!r}; valid: {', '.join((*NAMES, WORLD))}")
        return int(getattr(self, name))

    def sizes(self) -> dict[str, int]:
        """``{"pp", "dp", "tp"}``, plus ``cp`` and ``ep`` when they are used: the sizes people read and compare."""
        out = {d: self.size(d) for d in SIZES}
        out.update({d: self.size(d) for d in (CP, EP) if self.size(d) > 1})
        return out

    def same_group(self, name: str) -> str:
        """The dimension whose group is ``name``'s in these dims: with cp = 1, ``dp_cp`` is ``dp`` and
        ``dp_shard_cp`` is ``dp_shard`` (one group, one label in the byte counts, no extra group made)."""
        if name == EDP and self.ep == 1:
            name = DP_CP  # every dp x cp rank holds every expert: the experts' group is the dense one
        if self.cp == 1:
            return {DP_CP: DP, DP_SHARD_CP: DP_SHARD}.get(name, name)
        return name

    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.size(d) for d in MESH)

    def label(self) -> str:
        """``"dp=2, tp=2"``: the sizes above 1, in the order of :data:`SPLIT_BY`."""
        return ", ".join(f"{d}={self.size(d)}" for d in (*SPLIT_BY, EP) if self.size(d) > 1)

    # ---- building -------------------------------------------------------------------------------
    @classmethod
    def for_world(cls, world: int, dp: int = -1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                  replicate: int = 1) -> ParallelDims:
        """The dims of ``world`` ranks: ``dp=-1`` takes the ranks ``tp*pp*cp`` leave; ``replicate`` data-parallel
        replicas of ``dp // replicate`` shards (1: every dp rank one shard; ``replicate = dp``: pure replicas)."""
        given = {TP: tp, PP: pp, CP: cp}
        for name, v in given.items():
            if v < 1:
                raise ValueError(f"{name}={v}: parallel sizes must be >= 1")
        rest = tp * pp * cp
        shown = [d for d in SPLIT_BY if d != CP or cp > 1]  # the sizes messages name: cp only when it is used
        if dp == -1:
            if world % rest:
                others = [d for d in shown if d != DP]
                raise ValueError(f"world size {world} is not divisible by {'*'.join(others)} = "
                                 f"{'*'.join(str(given[d]) for d in others)} = {rest}")
            dp = world // rest
        if dp < 1:
            raise ValueError(f"{DP}={dp}: parallel sizes must be >= 1")
        sizes = {DP: dp, **given}
        if dp * rest != world:
            raise ValueError(
                f"{'*'.join(shown)} = {'*'.join(str(sizes[d]) for d in shown)} = {dp * rest} does not equal the "
                f"world size {world}; choose sizes whose product is {world} (or pass devices={dp * rest})")
        return cls(pp=pp, dp_shard=dp, cp=cp, tp=tp, ep=ep).with_replicas(replicate)

    def with_replicas(self, replicate: int) -> ParallelDims:
        """The same world with the data-parallel ranks regrouped as ``replicate`` replicas of shards.

        The one check that ``replicate`` divides dp (the Trainer's layouts, ``sw.Parallel``, a hand-built Topology)."""
        if replicate < 1 or self.dp % replicate:
            raise ValueError(f"replicate={replicate} must divide the data-parallel size {DP}={self.dp} "
                             f"(HSDP: {replicate} replicas of dp/replicate shards)")
        return replace(self, dp_replicate=replicate, dp_shard=self.dp // replicate)

    def with_shards(self, shard: int) -> ParallelDims:
        """The same world with the data-parallel ranks regrouped as replicas of ``shard`` ranks each (HSDP's
        shard size): the one check that ``shard`` divides dp (``sw.HSDP``, the planner's hsdp layouts)."""
        if shard < 1 or self.dp % shard:
            raise ValueError(f"HSDP shard_size={shard} must divide the data-parallel size {self.dp}")
        return self.with_replicas(self.dp // shard)


__all__ = ["CP", "DERIVED", "DILOCO", "DP", "DP_CP", "DP_REPLICATE", "DP_SHARD", "DP_SHARD_CP", "EDP", "EP", "MESH",
           "NAMES", "PP", "ParallelDims", "SIZES",
           "SPLIT_BY", "TP", "WORLD"]
