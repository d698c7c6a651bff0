"""What a run will build, described once: the input of the planner and of the composition.

A :class:`RunLayout` is a plain value: the parallel sizes, the data-parallel
form over ``dp`` (DDP, ZeRO stage 1/2/3, HSDP replicas), offload, the
pipeline's schedule and micro-batches, and the run options that change
memory (precision, activation checkpointing). Every strategy returns one from
:meth:`shardwise.strategy.Strategy.describe`; the Trainer completes it with its
own options (precision, activation checkpointing), so the memory check before a
run plans exactly the run that was asked for.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


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
    """The layout of one run on ``dp * tp * pp`` processes.

    Attributes:
        strategy: the strategy's name (``"ddp"``, ``"zero3"``, ``"parallel"``...).
        dp, tp, pp: mesh sizes.
        zero: the data-parallel form over dp: 0 = replicated (DDP), 1/2 = ZeRO
            stage 1/2, 3 = parameters sharded too (ZeRO-3/FSDP).
        replicate: HSDP: the dp ranks form ``replicate`` replicas of
            ``dp // replicate`` shards each (1: plain sharding over all of dp).
        offload: ``"none"``, ``"optimizer"`` or ``"all"`` (ZeRO-Offload).
        wrap: the FSDP unit policy (``"auto"``, a parameter count, ...); None when zero < 3.
        schedule, microbatches, chunks: the pipeline's (None/1 without one).
        precision: ``"32"``, ``"bf16-mixed"``, ``"16-mixed"`` (set by the Trainer).
        activation_checkpointing: recompute blocks in backward (set by the Trainer).
        servers: parameter-server ranks (0 otherwise).
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

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "replicate", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        check_data_parallel(self.zero, self.replicate)
        if self.dp % self.replicate:
            raise ValueError(f"replicate={self.replicate} must divide the data-parallel size dp={self.dp}")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shard_size(self) -> int:
        """Ranks over which sharded states are split (1 when nothing is sharded)."""
        return self.dp // self.replicate if self.zero else 1

    def with_run(self, precision: str, activation_checkpointing: bool) -> RunLayout:
        """This layout with the Trainer's run options."""
        return replace(self, precision=precision, activation_checkpointing=bool(activation_checkpointing))

    def label(self) -> str:
        parts = [f"{d}={getattr(self, d)}" for d in ("dp", "tp", "pp") if getattr(self, d) > 1]
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.replicate > 1:
            parts.append(f"replicate={self.replicate}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        return f"{self.strategy}({', '.join(parts)})"


__all__ = ["RunLayout", "check_data_parallel"]
