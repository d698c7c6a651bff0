"""What a run will build, described once: the input of the planner, of the Trainer and of the composition.

A :class:`RunLayout` is a plain value: the parallel sizes (its :attr:`RunLayout.dims`,
a :class:`~shardwise.dims.ParallelDims`), the data-parallel form over ``dp``
(DDP, ZeRO stage 1/2/3, HSDP replicas), offload, the pipeline's schedule and
micro-batches, and the run options that change memory (precision, activation
checkpointing). Every strategy returns one from its single
:meth:`~shardwise.strategies.base.Strategy.layout` method; the Trainer completes
it with its own options, builds the :class:`~shardwise.comm.topology.Topology`
from its dims, starts :attr:`RunLayout.processes` processes and splits each
batch :attr:`RunLayout.batch_shards` ways, so the memory check before a run
plans exactly the run that was asked for.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardwise.dims import CP, DP, EP, PP, TP, ParallelDims


def check_data_parallel(zero: int, replicate: int) -> None:
    """The data-parallel form over dp: a ZeRO stage 0-3, and HSDP replicas only of sharded parameters."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero}: valid are 0 (DDP over dp), 1, 2 (ZeRO stage 1/2) "
                         "and 3 (FSDP: parameters, gradients and optimizer states sharded)")
    if replicate < 1:
        raise ValueError(f"replicate={replicate}: must be >= 1")
    if replicate > 1 and zero != 3:
        raise ValueError(f"replicate={replicate} (HSDP) needs zero=3: it replicates shards of the "
                         "parameters; with zero<3 every dp rank already holds the full parameters")


@dataclass(frozen=True)
class RunLayout:
    """The layout of one run on ``dp * cp * tp * pp`` processes.

    Attributes:
        strategy: the strategy's name (``"ddp"``, ``"zero3"``, ``"parallel"``...).
        dp, tp, pp, cp, ep: the parallel sizes (see :mod:`shardwise.dims`).
        zero: the data-parallel form over dp: 0 = replicated (DDP), 1/2 = ZeRO
            stage 1/2, 3 = parameters sharded too (ZeRO-3/FSDP).
        replicate: HSDP: the dp ranks form ``replicate`` replicas of
            ``dp // replicate`` shards each (1: plain sharding over all of dp).
        offload: ``"none"``, ``"optimizer"`` or ``"all"`` (ZeRO-Offload).
        wrap: the FSDP unit policy (``"auto"``, a parameter count, ...); None when zero < 3.
        schedule, microbatches, chunks: the pipeline's (None/1 without one).
        precision: ``"32"``, ``"bf16-mixed"``, ``"16-mixed"`` (set by the Trainer).
        activation_checkpointing: recompute blocks in backward (set by the Trainer).
        servers: parameter-server ranks among the dp ranks (0 otherwise); they read no data.
        devices_per_process: devices one process drives (single-process DP and naive
            model parallelism drive all of them from one process; 1 otherwise).
        cp_mode: how attention crosses the cp ranks: ``"ring"`` (keys and values passed
            around the cp group) or ``"ulysses"`` (two all-to-alls turn a sequence shard
            into a head shard); None when cp = 1.
        sequence_parallel: Megatron sequence parallelism over the tp group (norms,
            dropout and residuals on ``s / tp`` tokens; each tp all-reduce becomes a
            reduce-scatter plus an all-gather).
    """

    strategy: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    replicate: int = 1
    offload: str = "none"
    wrap: Any = None
    schedule: str | None = None
    microbatches: int | None = None
    chunks: int = 1
    precision: str = "32"
    activation_checkpointing: bool = False
    servers: int = 0
    cp: int = 1
    ep: int = 1
    devices_per_process: int = 1
    cp_mode: str | None = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("chunks", "devices_per_process"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        check_data_parallel(self.zero, self.replicate)
        self.dims  # every size and divisibility rule, checked by ParallelDims

    @classmethod
    def of(cls, strategy: str, dims: ParallelDims, **form: Any) -> RunLayout:
        """The layout of ``dims`` (``replicate`` taken from them when the form shards parameters)."""
        if form.get("zero", 0) == 3:
            form.setdefault("replicate", dims.dp_replicate)
        return cls(strategy, dp=dims.dp, tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep, **form)

    @property
    def dims(self) -> ParallelDims:
        """The parallel dimensions: dp as replicas of shards by the data-parallel form (DDP: all replicas;
        ZeRO-1/2 and FSDP: all shards; HSDP: ``replicate`` replicas of shards)."""
        replicas = self.dp if self.zero == 0 else self.replicate
        return ParallelDims(pp=self.pp, dp_shard=self.dp, cp=self.cp, tp=self.tp, ep=self.ep).with_replicas(replicas)

    @property
    def devices(self) -> int:
        """Ranks (processes) of the run: the product of its parallel sizes."""
        return self.dims.world

    @property
    def processes(self) -> int:
        """Processes to start: one per rank (a single-process strategy has one rank and drives its devices)."""
        return self.devices

    @property
    def batch_shards(self) -> int:
        """Parts each global batch is split into: the data-parallel ranks that read data (servers do not)."""
        return self.dp - self.servers

    @property
    def shard_size(self) -> int:
        """Ranks over which sharded states are split (1 when nothing is sharded)."""
        return self.dp // self.replicate if self.zero else 1

    def with_run(self, precision: str, activation_checkpointing: bool) -> RunLayout:
        """This layout with the Trainer's run options."""
        return replace(self, precision=precision, activation_checkpointing=bool(activation_checkpointing))

    def label(self) -> str:
        sizes = {DP: self.dp, CP: self.cp, TP: self.tp, PP: self.pp, EP: self.ep}
        parts = [f"{d}={sizes[d]}" for d in (DP, TP, PP, CP, EP) if sizes[d] > 1]
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.replicate > 1:
            parts.append(f"replicate={self.replicate}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.cp > 1 and self.cp_mode:
            parts.append(f"cp_mode={self.cp_mode}")
        if self.sequence_parallel:
            parts.append("sequence_parallel")
        return f"{self.strategy}({', '.join(parts)})"


__all__ = ["RunLayout", "check_data_parallel"]
