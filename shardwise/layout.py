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

# Whose mechanisms run a strategy (``engine=``): ours, or PyTorch's own (shardwise.strategies.torch_engine).
SHARDWISE, TORCH = "shardwise", "torch"
ENGINES = (SHARDWISE, TORCH)


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


@dataclass(frozen=True, init=False)
class RunLayout:
    """The layout of one run on ``dp * cp * tp * pp`` processes.

    Built as ``RunLayout(strategy, dp=2, tp=2, ...)`` (each size left out is 1, or the ``dims``'
    one when those are given) or ``RunLayout.of(strategy, dims, ...)``; ``dataclasses.replace``
    takes sizes (``replace(layout, tp=1)``) as well as fields.

    Attributes:
        strategy: the strategy's name (``"ddp"``, ``"zero3"``, ``"parallel"``...).
        dims: the parallel dimensions (:mod:`shardwise.dims`), dp grouped into replicas of shards by
            the data-parallel form (DDP: all replicas; ZeRO-1/2 and FSDP: all shards; HSDP:
            ``replicate`` replicas of shards); ``dp``, ``tp``, ``pp``, ``cp`` and ``ep`` read them.
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
        engine: whose mechanisms hold the states: ``"shardwise"`` or ``"torch"`` (PyTorch's DDP,
            ``ZeroRedundancyOptimizer``, FSDP2, DTensor and pipelining, which partition
            differently: :mod:`shardwise.plan.states`).
    """

    # The defaults are the constructor's: written once, in its signature.
    strategy: str
    dims: ParallelDims
    zero: int
    replicate: int
    offload: str
    wrap: Any
    schedule: str | None
    microbatches: int | None
    chunks: int
    precision: str
    activation_checkpointing: bool
    servers: int
    devices_per_process: int
    cp_mode: str | None
    sequence_parallel: bool
    engine: str

    def __init__(self, strategy: str, dp: int | None = None, tp: int | None = None, pp: int | None = None,
                 zero: int = 0, replicate: int = 1, offload: str = "none", wrap: Any = None,
                 schedule: str | None = None, microbatches: int | None = None, chunks: int = 1,
                 precision: str = "32", activation_checkpointing: bool = False, servers: int = 0,
                 cp: int | None = None, ep: int | None = None, devices_per_process: int = 1,
                 cp_mode: str | None = None, sequence_parallel: bool = False, *,
                 dims: ParallelDims | None = None, engine: str = SHARDWISE) -> None:
        for name, v in (("chunks", chunks), ("devices_per_process", devices_per_process)):
            if v < 1:
                raise ValueError(f"{name}={v}: must be >= 1")
        check_data_parallel(zero, replicate)
        sized = _with_sizes(dims or ParallelDims(), {DP: dp, TP: tp, PP: pp, CP: cp, EP: ep})
        # Every size and divisibility rule is ParallelDims'; the grouping of dp is the form's, decided here.
        grouped = sized.with_replicas(sized.dp if zero == 0 else replicate)
        fields = dict(strategy=strategy, dims=grouped, zero=zero, replicate=replicate, offload=offload, wrap=wrap,
                      schedule=schedule, microbatches=microbatches, chunks=chunks, precision=precision,
                      activation_checkpointing=activation_checkpointing, servers=servers,
                      devices_per_process=devices_per_process, cp_mode=cp_mode, sequence_parallel=sequence_parallel,
                      engine=engine)
        for name, value in fields.items():
            object.__setattr__(self, name, value)  # frozen: the one way in

    @classmethod
    def of(cls, strategy: str, dims: ParallelDims, **form: Any) -> RunLayout:
        """The layout of ``dims`` (``replicate`` taken from them when the form shards parameters)."""
        if form.get("zero", 0) == 3:
            form.setdefault("replicate", dims.dp_replicate)
        return cls(strategy, dims=dims, **form)

    # ---- the sizes, read from dims ---------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def ep(self) -> int:
        return self.dims.ep

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
        parts = [f"{d}={self.dims.size(d)}" for d in (DP, TP, PP, CP, EP) if self.dims.size(d) > 1]
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
        if self.engine != SHARDWISE:
            parts.append(f"engine={self.engine}")
        return f"{self.strategy}({', '.join(parts)})"


def _with_sizes(dims: ParallelDims, sizes: dict[str, int | None]) -> ParallelDims:
    """``dims`` with the sizes given (not None) put in; dp's replica grouping is left to the caller."""
    own = {d: dims.size(d) for d in sizes}
    own.update({d: n for d, n in sizes.items() if n is not None})
    return ParallelDims(pp=own[PP], dp_shard=own[DP], cp=own[CP], tp=own[TP], ep=own[EP])


__all__ = ["ENGINES", "RunLayout", "SHARDWISE", "TORCH", "check_data_parallel"]
