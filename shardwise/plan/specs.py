"""What the planner is asked about: the cluster, the training recipe and one parallel layout.

The model is described in :mod:`shardwise.plan.model`. Everything here is plain
data; the arithmetic lives in ``memory``, ``comm`` and ``timing``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardwise.dims import CP, DP, DP_SHARD_CP, EDP, EP, PP, TP, ParallelDims
from shardwise.parallel.dp.buckets import DDP_BUCKET_MB
from shardwise.parallel.pp.schedules import SCHEDULES, default_chunks

PRECISIONS = ("fp32", "bf16-mixed")
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
OFFLOADS = ("none", "optimizer", "all")
# Names of the data-parallel treatment of the model states; tp and pp are sizes of a layout.
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
# How attention crosses the cp ranks (RunLayout.cp_mode): key/value blocks around a ring, or all-to-alls.
CP_MODES = ("ring", "ulysses")


@dataclass(frozen=True)
class ClusterSpec:
    """Devices and the links between them.

    Bandwidths are unidirectional bytes/s *per device*: ``intra_bw`` over the
    node's fabric (NVLink), ``inter_bw`` through the device's own network card
    (one NIC per device, as on DGX-class nodes). Latencies are seconds per
    algorithm step. ``peak_flops`` is the dense 16-bit peak; fp32 training runs
    at ``fp32_peak_flops`` (TF32 tensor cores: half the 16-bit peak when not given).
    ``compute_efficiency`` is the fraction of peak that the matrix multiplies
    reach; ``reserved_bytes`` is memory the framework takes before any tensor
    (CUDA context, NCCL buffers, allocator fragmentation).
    """

    devices_per_node: int = 8
    nodes: int = 1
    device_memory_bytes: int = 80 * 10**9
    intra_bw: float = 450e9
    inter_bw: float = 50e9
    intra_latency_s: float = 3e-6
    inter_latency_s: float = 10e-6
    peak_flops: float = 989e12
    fp32_peak_flops: float | None = None
    compute_efficiency: float = 0.5
    reserved_bytes: int = 0
    memory_bw: float = 3.35e12  # device memory: the optimizer step is bound by it
    host_bw: float = 25e9  # device <-> host (PCIe), for offloaded optimizer states
    host_memory_bw: float = 25e9  # this device's share of host memory bandwidth (CPU optimizer step)
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise ValueError("devices_per_node and nodes must be at least 1")
        if self.device_memory_bytes <= 0:
            raise ValueError("device_memory_bytes must be positive")
        if min(self.intra_bw, self.inter_bw, self.peak_flops, self.memory_bw, self.host_bw, self.host_memory_bw) <= 0:
            raise ValueError("bandwidths and peak_flops must be positive")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError("compute_efficiency must be in (0, 1]")

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    def flops(self, precision: str) -> float:
        """Sustained FLOP/s of one device at ``precision``."""
        peak = self.peak_flops if precision != "fp32" else (self.fp32_peak_flops or self.peak_flops / 2)
        return peak * self.compute_efficiency

    @classmethod
    def with_devices(cls, devices: int, devices_per_node: int = 8, **kw: object) -> ClusterSpec:
        """``devices`` in total, filling nodes of ``devices_per_node`` (fewer means one partial node)."""
        if devices < 1:
            raise ValueError("devices must be at least 1")
        per_node = min(devices, devices_per_node)
        if devices % per_node:
            raise ValueError(f"{devices} devices do not fill whole nodes of {devices_per_node}")
        return cls(devices_per_node=per_node, nodes=devices // per_node, **kw)  # type: ignore[arg-type]

    def replace(self, **kw: object) -> ClusterSpec:
        return replace(self, **kw)  # type: ignore[arg-type]


# Public data sheets (SXM parts, dense 16-bit peak); bandwidths unidirectional
# per device: NVLink 3 = 300 GB/s, NVLink 4 = 450 GB/s; NICs HDR 200 Gb/s and
# NDR 400 Gb/s, one per GPU; PCIe 4 = 25 GB/s, PCIe 5 = 50 GB/s. reserved_bytes:
# ~1 GB for the CUDA context and NCCL buffers a real device loses before the first tensor.
GPU_PRESETS: dict[str, dict[str, float | int]] = {
    "a100-40gb": dict(device_memory_bytes=40 * 10**9, intra_bw=300e9, inter_bw=25e9, peak_flops=312e12,
                      memory_bw=1.555e12, host_bw=25e9, reserved_bytes=10**9),
    "a100-80gb": dict(device_memory_bytes=80 * 10**9, intra_bw=300e9, inter_bw=25e9, peak_flops=312e12,
                      memory_bw=2.039e12, host_bw=25e9, reserved_bytes=10**9),
    "h100-80gb": dict(device_memory_bytes=80 * 10**9, intra_bw=450e9, inter_bw=50e9, peak_flops=989e12,
                      memory_bw=3.35e12, host_bw=50e9, reserved_bytes=10**9),
    "h200-141gb": dict(device_memory_bytes=141 * 10**9, intra_bw=450e9, inter_bw=50e9, peak_flops=989e12,
                       memory_bw=4.8e12, host_bw=50e9, reserved_bytes=10**9),
}


@dataclass(frozen=True)
class TrainingSpec:
    """The recipe, identical for every layout: same global batch, same optimizer, same precision.

    ``global_batch`` is in samples (sequences) per optimizer step; ``None``
    means one micro-batch per device. ``seq_len`` ``None`` takes the model's.
    ``sequence_parallel`` asks for Megatron sequence parallelism in every
    layout with tp > 1 (without it the layouts are tried with and without).
    ``fp32_grads`` keeps the (sharded) gradients in fp32 as DeepSpeed's ZeRO
    does; ``offload`` moves optimizer states (and gradients), or everything,
    to host memory (ZeRO-Offload), and only applies to ZeRO layouts.
    ``no_sync`` accumulates unreduced gradients over a step's micro-batches
    and reduces once (what our trainer does); otherwise ZeRO-2/3 reduce-scatter
    every micro-batch (DeepSpeed's and FSDP2's default) and keep only shards.
    ``autocast``: mixed precision as torch.amp (and shardwise's Trainer) runs
    it: the parameters, gradients and optimizer states stay fp32 and FSDP
    gathers fp32 weights; only activations and the matrix multiplies are
    16-bit. Without it ``bf16-mixed`` means Megatron/DeepSpeed's 16-bit weights
    and gradients next to an fp32 master copy (the ZeRO paper's 2 + 2 + K).
    ``schedule`` is a pipeline schedule of the runtime's table
    (:data:`shardwise.parallel.pp.schedules.SCHEDULES`), whose bubble and memory the
    planner reads; ``chunks`` its model chunks per rank (1: the schedule's own,
    2 for interleaved and the V schedules), as ``sw.Parallel(chunks=)``.
    """

    global_batch: int | None = None
    micro_batch: int = 1
    seq_len: int | None = None
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    flash_attention: bool = False
    schedule: str = "1f1b"
    fp32_grads: bool = False
    offload: str = "none"
    no_sync: bool = False
    autocast: bool = False
    checkpoint_async: bool = False  # saves in the background stage the checkpoint share in host memory
    bucket_bytes: int = int(DDP_BUCKET_MB * 2**20)  # the runtime's DDP default, in bytes
    chunks: int = 1

    def __post_init__(self) -> None:
        for name, value, allowed in (("precision", self.precision, PRECISIONS),
                                     ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("schedule", self.schedule, SCHEDULES),
                                     ("offload", self.offload, OFFLOADS)):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; use one of {', '.join(allowed)}")
        if self.micro_batch < 1 or (self.global_batch is not None and self.global_batch < 1):
            raise ValueError("micro_batch and global_batch must be at least 1")

    def resolved_global_batch(self, devices: int) -> int:
        return self.global_batch if self.global_batch is not None else devices * self.micro_batch

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks per pipeline rank the schedule runs (the runtime's rule: ``sw.Parallel.n_chunks``)."""
        return default_chunks(self.schedule, self.chunks)

    @property
    def states_precision(self) -> str:
        """The precision the model states are kept in (fp32 under autocast)."""
        return "fp32" if self.autocast else self.precision

    def replace(self, **kw: object) -> TrainingSpec:
        return replace(self, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Layout:
    """One way to place the model: ``strategy`` over the data-parallel ranks of a pp x dp x cp x tp mesh.

    The mesh is ordered tp (innermost, neighbouring devices), then cp, then dp,
    then pp, as :data:`shardwise.dims.MESH` orders it (torchtitan's order; tp
    inside a node as in Megatron-LM): the dimension that talks most is innermost.
    ``shard_group`` is HSDP's data-parallel shard count (replicas = dp / shard_group).

    ``cp`` splits every sequence over that many ranks (context parallelism):
    the batch is still split over dp only, parameters are whole on every cp
    rank, and gradients are averaged over dp x cp, so ZeRO/FSDP shard the model
    states over dp_shard x cp ranks (:attr:`shard_size`). ``cp_mode`` says how
    attention crosses the cp ranks: ``"ring"`` (key/value blocks passed around,
    Liu et al. 2023) or ``"ulysses"`` (all-to-alls from sequence to head shards,
    Jacobs et al. 2023); it is ``"ring"`` when unset with cp > 1, as
    ``sw.Parallel`` defaults it, and None with cp = 1. ``sequence_parallel``:
    Megatron sequence parallelism over the tp ranks (Korthikanti et al. 2022).

    ``ep`` spreads every MoE layer's experts over that many ranks (expert
    parallelism), carved from the dp x cp ranks (``ep`` divides dp x cp, as
    :class:`shardwise.dims.ParallelDims` requires): a rank holds E / ep experts,
    tokens travel to them by all-to-all, and the expert states are sharded (or,
    under DDP, replicated) over the ``edp = dp x cp / ep`` ranks that hold the
    same experts (:attr:`expert_shard_size`), the dense ones over dp x cp as
    before. ``capacity_factor`` (None: dropless) caps what each expert takes
    from one rank's tokens at ``ceil(cf x tokens x top_k / E)`` slots.
    """

    strategy: str
    dp: int
    tp: int = 1
    pp: int = 1
    shard_group: int | None = None
    cp: int = 1
    cp_mode: str | None = None
    sequence_parallel: bool = False
    ep: int = 1
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        self.dims  # every size and divisibility rule (ep's and HSDP's included) is ParallelDims'  # noqa: B018
        # One spelling per layout (equal layouts compare equal): no mode without cp, ring by default with it.
        mode = None if self.cp == 1 else (self.cp_mode or "ring")
        if mode is not None and mode not in CP_MODES:
            raise ValueError(f"unknown cp_mode {mode!r}; use one of {', '.join(CP_MODES)}")
        object.__setattr__(self, "cp_mode", mode)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel splits the sequence over the tp ranks: it needs tp > 1")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0 (None: dropless)")

    @property
    def dims(self) -> ParallelDims:
        """The parallel dimensions of this layout: dp as HSDP's replicas of ``shard_group`` ranks, all shards
        otherwise (DDP's dp x cp group then counts as its "shard", where nothing is sharded)."""
        flat = ParallelDims(pp=self.pp, dp_shard=self.dp, cp=self.cp, tp=self.tp, ep=self.ep)
        return flat.with_shards(self.shard_group or self.dp) if self.strategy == "hsdp" else flat

    @property
    def devices(self) -> int:
        return self.dims.world

    @property
    def zero_stage(self) -> int:
        return {"ddp": 0, "zero1": 1, "zero2": 2}.get(self.strategy, 3)

    @property
    def shard_size(self) -> int:
        """Ranks over which model states are sharded: dp_shard x cp (the size of ddp's dp x cp group, where
        nothing is sharded)."""
        return self.dims.size(DP_SHARD_CP)

    @property
    def expert_shard_size(self) -> int:
        """Ranks over which expert states are sharded (ZeRO/FSDP; DDP replicates them there): ``edp = dp x cp /
        ep``, the ranks holding the same experts (:data:`shardwise.dims.EDP`)."""
        return self.dims.size(EDP)

    @property
    def label(self) -> str:
        """``"fsdp dp4xcp8xtp2 (ulysses, sp)"``: the sizes above 1 (dp always), then the options."""
        sizes = ((DP, self.dp), (CP, self.cp), (TP, self.tp), (PP, self.pp))
        dims = "x".join(f"{d}{n}" for d, n in sizes if d == DP or n > 1)
        # ep is carved from dp x cp, not a factor of the device count: shown as an option, not among the sizes.
        extra = [f"shard {self.shard_size}"] * (self.strategy == "hsdp") + [self.cp_mode or ""] * (self.cp > 1) \
            + ["sp"] * self.sequence_parallel + [f"{EP} {self.ep}"] * (self.ep > 1) \
            + ([f"capacity {self.capacity_factor:g}"] if self.capacity_factor is not None else [])
        return f"{self.strategy} {dims}" + (f" ({', '.join(extra)})" if extra else "")

    def code(self, schedule: str = "1f1b") -> str:
        """The strategy argument of ``sw.Trainer`` that builds this layout."""
        if self.tp == self.pp == self.cp == self.ep == 1 and self.capacity_factor is None:
            if self.strategy == "hsdp":
                return f"sw.HSDP(shard_size={self.shard_size})"
            return repr(self.strategy)
        args = [f"{d}={getattr(self, d)}" for d in (DP, TP, PP)] + [f"zero={min(self.zero_stage, 3)}"]
        if self.strategy == "hsdp":
            args.append(f"replicate={self.dp // (self.shard_group or self.dp)}")
        if self.pp > 1:
            args.append(f"schedule={schedule!r}")
        if self.cp > 1:
            args += [f"{CP}={self.cp}", f"cp_mode={self.cp_mode!r}"]
        if self.sequence_parallel:
            args.append("sequence_parallel=True")
        if self.ep > 1:
            args.append(f"{EP}={self.ep}")
        if self.capacity_factor is not None:
            args.append(f"capacity_factor={self.capacity_factor!r}")
        return f"sw.Parallel({', '.join(args)})"


def uses_sequence_parallel(training: TrainingSpec, layout: Layout) -> bool:
    """Whether ``layout`` runs Megatron sequence parallelism: its own flag, or the recipe's (``--sequence-parallel``
    asks for it wherever tp > 1)."""
    return layout.sequence_parallel or (training.sequence_parallel and layout.tp > 1)


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
