"""One estimate per layout, every layout of a cluster, and the recommendation."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from shardwise.comm.quantized import element_bytes
from shardwise.dims import CP, DILOCO, DP, EP, PP, TP
from shardwise.plan.comm import (
    NETWORK_KINDS,
    Collective,
    _make,
    data_parallel_collectives,
    group_link,
    model_parallel_collectives,
    offload_copies,
)
from shardwise.plan.memory import (
    STAGING,
    Numels,
    StateBytes,
    activation_bytes,
    buffer_bytes,
    bytes_per_param,
    model_state_bytes,
    staging_state_bytes,
    total_numel,
)
from shardwise.plan.model import ModelSpec
from shardwise.plan.specs import CP_MODES, STRATEGIES, ClusterSpec, Layout, TrainingSpec, divisors
from shardwise.plan.timing import StepTime, model_flops_per_step, step_time


@dataclass(frozen=True)
class Estimate:
    """Memory, communication and time of one layout, for the busiest device. Bytes are per device."""

    layout: Layout
    model: str
    global_batch: int
    micro_batch: int
    microbatches: int  # per data-parallel rank per step (pipeline micro-batches or accumulation steps)
    seq_len: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    buffers: dict[str, int]
    host_bytes: int
    device_memory_bytes: int
    reserved_bytes: int
    collectives: tuple[Collective, ...]
    time: StepTime
    model_flops: float
    peak_flops: float  # all devices together, at the training precision, before efficiency
    notes: tuple[str, ...] = field(default=())
    schedule: str = "1f1b"
    params_per_device: int = 0  # parameters the busiest device holds (dense / tp, experts / ep)
    active_params_per_device: int = 0  # of those, what one token runs through (top_k of E experts)
    # Host memory per device by purpose, not counted against the device's (memory.STAGING with checkpoint_async).
    host_buffers: dict[str, int] = field(default_factory=dict)

    # ---- the layout --------------------------------------------------
    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def devices(self) -> int:
        return self.layout.devices

    # ---- memory --------------------------------------------------------
    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def buffer_bytes(self) -> int:
        return sum(self.buffers.values())

    @property
    def total_bytes(self) -> int:
        return self.model_states_bytes + self.activation_bytes + self.buffer_bytes

    @property
    def available_bytes(self) -> int:
        return self.device_memory_bytes - self.reserved_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.available_bytes

    @property
    def memory_terms(self) -> dict[str, int]:
        """Every term of the per-device total, by name (buffers by purpose)."""
        return {"parameters": self.params_bytes, "gradients": self.grads_bytes, "optimizer": self.optimizer_bytes,
                "activations": self.activation_bytes, **self.buffers}

    @property
    def largest_term(self) -> str:
        """The term that weighs most: why a layout does not fit."""
        return max(self.memory_terms.items(), key=lambda kv: kv[1])[0]

    # ---- communication and time ----------------------------------------
    @property
    def comm_bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for c in self.collectives:
            if c.kind in NETWORK_KINDS:
                out[c.kind] += c.bytes_sent
        return dict(out)

    @property
    def comm_bytes_per_step(self) -> int:
        return sum(self.comm_bytes_by_kind.values())

    @property
    def step_time_s(self) -> float:
        return self.time.total_s

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.seq_len / self.step_time_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: useful FLOPs over the devices' peak (Chowdhery et al. 2022)."""
        return self.model_flops / (self.step_time_s * self.peak_flops)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the ``--format json`` schema)."""
        t = self.time
        return {
            "strategy": self.strategy, DP: self.dp, TP: self.tp, PP: self.pp, CP: self.cp, EP: self.ep,
            "capacity_factor": self.layout.capacity_factor, "params_per_device": self.params_per_device,
            "active_params_per_device": self.active_params_per_device,
            "cp_mode": self.layout.cp_mode, "sequence_parallel": self.layout.sequence_parallel, "devices": self.devices,
            "shard_group": self.layout.shard_size if self.strategy == "hsdp" else None, "label": self.layout.label,
            "zero": self.layout.zero_stage, "code": self.layout.code(self.schedule), "largest_term": self.largest_term,
            "model": self.model, "global_batch": self.global_batch, "micro_batch": self.micro_batch,
            "microbatches": self.microbatches, "seq_len": self.seq_len,
            "params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes, "model_states_bytes": self.model_states_bytes,
            "activation_bytes": self.activation_bytes, "buffer_bytes": self.buffer_bytes, "buffers": self.buffers,
            "host_bytes": self.host_bytes, "host_buffers": self.host_buffers, "total_bytes": self.total_bytes,
            "available_bytes": self.available_bytes,
            "fits": self.fits, "comm_bytes_per_step": self.comm_bytes_per_step,
            "comm_bytes_by_kind": self.comm_bytes_by_kind,
            "collectives": [{"kind": c.kind, "group": c.group, "purpose": c.purpose, "name": c.name,
                             "ranks": c.ranks, "calls": c.calls, "bytes_sent": c.bytes_sent, "time_s": c.time_s,
                             "overlap": c.overlap} for c in self.collectives],
            "compute_time_s": t.compute_s, "model_parallel_comm_time_s": t.slot_comm_s,
            "cp_exposed_comm_time_s": t.cp_exposed_s, "bubble_time_s": t.bubble_s,
            "exposed_comm_time_s": t.exposed_dp_s, "optimizer_time_s": t.optimizer_s, "step_time_s": t.total_s,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "notes": list(self.notes),
        }


def check_layout(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout) -> str | None:
    """Why ``layout`` cannot run this model/recipe on this cluster, or None when it can."""
    if layout.devices > cluster.devices:
        return f"needs {layout.devices} devices, the cluster has {cluster.devices}"
    if (layout.tp > 1 or layout.pp > 1) and not model.is_transformer:
        return "tensor and pipeline parallelism need a transformer shape (layers, hidden, heads)"
    if layout.ep > 1 and not model.is_moe:
        return f"{EP}={layout.ep} needs a mixture of experts (experts, top_k)"
    if layout.ep > 1 and model.experts % layout.ep:
        return f"{EP}={layout.ep} does not divide the {model.experts} experts"
    if model.is_transformer and model.heads % layout.tp:
        return f"tp={layout.tp} does not divide {model.heads} attention heads"
    if model.is_transformer and layout.pp > model.layers:
        return f"pp={layout.pp} exceeds the {model.layers} layers"
    if layout.ep > 1 and layout.strategy == "zero3":
        # sw.Parallel(zero=3, ep=) shards with FSDP units (each experts module one): that is "fsdp" here.
        return f"zero3 (size-based units) does not combine with {EP}; fsdp does (an experts module is one unit)"
    if layout.pp > 1 and layout.strategy == "zero3":
        # Our pipelines shard with FSDP units (one per pipeline layer): the size-based ZeRO-3 preset is "fsdp" there.
        return "zero3 (size-based units) does not combine with pipeline parallelism; fsdp does (units per layer)"
    gb = training.resolved_global_batch(cluster.devices)
    if gb % (layout.dp * training.micro_batch):
        return f"global batch {gb} is not a multiple of dp x micro-batch = {layout.dp * training.micro_batch}"
    return _check_cp(model, training, layout)


def _check_cp(model: ModelSpec, training: TrainingSpec, layout: Layout) -> str | None:
    """Why the sequence cannot be split ``layout.cp`` ways, or None (see :mod:`shardwise.plan.comm`)."""
    c = layout.cp
    if c == 1:
        return None
    if not model.is_transformer:
        return "context parallelism needs a transformer shape (layers, hidden, heads)"
    s = _seq_len(model, training)
    if s % (2 * c):
        # Rank r holds chunks r and 2c-1-r of 2c equal chunks: causal attention's work is then even.
        return f"{CP}={c}: the sequence of {s} tokens does not split into 2 x {c} equal chunks"
    if layout.cp_mode == "ulysses":
        heads, kv = model.heads // layout.tp, model.kv_heads_per_rank(layout.tp)
        if heads % c:
            return f"ulysses over {CP}={c} splits the {heads} heads of a tp rank {c} ways: {c} must divide them"
        if kv % c and c % kv:
            return f"ulysses over {CP}={c}: the {kv} key/value heads of a tp rank neither split nor replicate {c} ways"
    return None


def estimate(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout) -> Estimate:
    """Memory per device, bytes sent per step and predicted step time of ``layout``."""
    problem = check_layout(model, cluster, training, layout)
    if problem:
        raise ValueError(f"{layout.label}: {problem}")
    notes: list[str] = []
    if training.sequence_parallel and layout.tp > 1 and not layout.sequence_parallel:
        layout = replace(layout, sequence_parallel=True)  # the recipe asks for it wherever tp > 1
    gb = training.resolved_global_batch(cluster.devices)
    m = gb // (layout.dp * training.micro_batch)
    s = _seq_len(model, training)
    if layout.pp > 1 and layout.zero_stage >= 2:
        # A pipeline runs a step's micro-batches with each chunk's gradient sync off until the last one
        # (shardwise.parallel.pp.run, as torchtitan does with FSDP2): whole gradients are held, reduced once.
        training = training.replace(no_sync=True)
    bpp = bytes_per_param(training.states_precision, training.optimizer, training.fp32_grads)
    local = model.stage_params(layout.tp, layout.pp)
    # A real module's parameter sizes make the shards exact (padding is per parameter); else one flat buffer.
    numels: Numels = model.param_numels if (model.param_numels and layout.tp == layout.pp == 1) else local
    experts: Numels = 0
    if layout.ep > 1:
        # Expert parallelism: E / ep experts per rank, their states over edp; the dense rest as before.
        dense, experts = model.stage_split(layout.tp, layout.pp, layout.ep)
        local = dense + experts
        numels = dense
        if model.param_numels and layout.tp == layout.pp == 1:
            numels, experts = model.local_numels(layout.ep)
    full = training.no_sync and m > 1
    states = model_state_bytes(numels, layout.strategy, layout.shard_size, bpp, training.offload, full_grads=full)
    if total_numel(experts):
        states = _add(states, model_state_bytes(experts, layout.strategy, layout.expert_shard_size, bpp,
                                                training.offload, full_grads=full))
    act = activation_bytes(model, training, layout, s, m)
    bufs = buffer_bytes(model, training, layout, s, local, bpp)
    comms = (data_parallel_collectives(model, cluster, training, layout, numels, bpp, m, experts)
             + model_parallel_collectives(model, cluster, training, layout, s, m)
             + offload_copies(cluster, training, layout, numels, bpp))
    t = step_time(model, cluster, training, layout, s, m, numels, bpp, comms, experts)
    if model.shape_inferred:
        notes.append(f"shape guessed from the parameter count ({model.layers} layers, hidden {model.hidden}, "
                     f"{model.heads} heads)")
    if not model.is_transformer and model.trace is None:
        notes.append("activations not estimated: give a transformer shape or a traced factory")
    if model.trace is not None and training.activation_checkpointing:
        notes.append("activation checkpointing is not modelled for traced models (activations shown without it)")
    if layout.pp > 1 and m < layout.pp:
        notes.append(f"only {m} micro-batches for {layout.pp} stages: the bubble dominates")
    return Estimate(layout=layout, model=model.name, global_batch=gb, micro_batch=training.micro_batch,
                    microbatches=m, seq_len=s, params_bytes=states.params, grads_bytes=states.grads,
                    optimizer_bytes=states.optimizer, activation_bytes=act, buffers=bufs, host_bytes=states.host,
                    device_memory_bytes=cluster.device_memory_bytes, reserved_bytes=cluster.reserved_bytes,
                    collectives=tuple(comms), time=t, model_flops=model_flops_per_step(model, s, gb),
                    peak_flops=layout.devices * cluster.flops(training.precision) / cluster.compute_efficiency,
                    notes=tuple(notes), schedule=training.schedule,
                    params_per_device=model.params_per_rank(layout.tp, layout.pp, layout.ep)[0],
                    active_params_per_device=model.params_per_rank(layout.tp, layout.pp, layout.ep)[1],
                    host_buffers={STAGING: staging_state_bytes(states)} if training.checkpoint_async else {})


def _add(a: StateBytes, b: StateBytes) -> StateBytes:
    """Two groups' states on one device (dense and expert): the busiest rank of each, so an upper bound for
    ZeRO-1/2's padded copies, which may sit on different ranks."""
    return StateBytes(a.params + b.params, a.grads + b.grads, a.optimizer + b.optimizer, a.host + b.host)


def _seq_len(model: ModelSpec, training: TrainingSpec) -> int:
    if model.trace is not None:
        shape = model.trace.input_shape  # token ids (batch, seq): tokens per sample; otherwise one per sample
        return shape[1] if len(shape) == 2 and "int" in model.trace.input_dtype else 1
    return training.seq_len or model.seq_len or 2048


def enumerate_layouts(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                      strategies: Iterable[str] | None = None, max_tp: int | None = None,
                      max_cp: int | None = None, cp_modes: Iterable[str] | None = None,
                      max_ep: int | None = None) -> list[Layout]:
    """Every valid layout on all of the cluster's devices.

    dp x cp x tp x pp over the divisors of the device count, tp inside a node
    (at most ``max_tp``, default devices per node), cp a power of two (at most
    ``max_cp``) that splits the sequence into 2 cp equal chunks, in each of
    ``cp_modes`` (default ring and Ulysses), with and without sequence
    parallelism where tp > 1 (only with it when the recipe asks for it);
    ZeRO stage 0-3 and FSDP over dp x cp (with a pipeline, ZeRO-3 is FSDP with
    a unit per pipeline layer, as ``sw.Parallel(zero=3)`` builds it); HSDP
    (shard dp_shard x cp inside a node, replicate across nodes) when dp spans nodes.
    For a mixture of experts, each layout also with every expert-parallel size
    ep > 1 (at most ``max_ep``) that divides both dp x cp and the expert count
    (not with HSDP's replicas, which expert parallelism does not combine with).
    """
    wanted = set(strategies or STRATEGIES)
    unknown = wanted - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; use {', '.join(STRATEGIES)}")
    modes = list(cp_modes or CP_MODES)
    if set(modes) - set(CP_MODES):
        raise ValueError(f"unknown cp modes {sorted(set(modes) - set(CP_MODES))}; use {', '.join(CP_MODES)}")
    d, g = cluster.devices, cluster.devices_per_node
    out: list[Layout] = []
    for tp in divisors(d):
        if tp > (max_tp or g):
            continue
        sps = [True] if tp > 1 and training.sequence_parallel else [False, True] if tp > 1 else [False]
        for cp in _powers_of_two(d // tp, max_cp):
            for pp in divisors(d // (tp * cp)):
                dp = d // (tp * cp * pp)
                # With a pipeline, ZeRO-3 is FSDP with one unit per pipeline layer (Parallel(zero=3)).
                names = ["ddp", "zero1", "zero2", "fsdp"] if pp > 1 else ["ddp", "zero1", "zero2", "zero3", "fsdp"]
                if dp * cp == 1:  # nothing to shard over: every ZeRO stage is plain replication
                    names = ["ddp"]
                shapes = [dict(cp=cp, cp_mode=mode, sequence_parallel=sp) for mode in (modes if cp > 1 else [None])
                          for sp in sps]
                candidates = [Layout(n, dp, tp, pp, **shape) for shape in shapes for n in names if n in wanted]  # type: ignore[arg-type]
                # HSDP shards over dp_shard x cp ranks filling a node and replicates across nodes.
                shard = g // (tp * cp) if g % (tp * cp) == 0 else 0
                if "hsdp" in wanted and shard and shard * cp > 1 and shard < dp and dp % shard == 0:
                    candidates += [Layout("hsdp", dp, tp, pp, shard_group=shard, **shape) for shape in shapes]  # type: ignore[arg-type]
                candidates += [replace(c, ep=e) for c in candidates for e in _expert_sizes(model, dp * cp, max_ep)
                               if c.strategy != "hsdp"]
                out += [c for c in candidates if check_layout(model, cluster, training, c) is None]
    return out


def _expert_sizes(model: ModelSpec, ranks: int, most: int | None) -> list[int]:
    """The ep sizes above 1 tried for ``ranks`` dp x cp ranks: divisors of both ``ranks`` and the expert count."""
    if not model.is_moe:
        return []
    return [e for e in divisors(ranks) if 1 < e <= (most or ranks) and model.experts % e == 0]


def _powers_of_two(n: int, most: int | None) -> list[int]:
    """1, 2, 4, ... up to ``most`` (default ``n``), each dividing ``n``: the cp sizes tried, powers of two as
    Megatron-Core's and torchtitan's context parallelism are run."""
    out, c = [], 1
    while n % c == 0 and c <= (most or n):
        out.append(c)
        c *= 2
    return out


def plan(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, strategies: Iterable[str] | None = None,
         max_tp: int | None = None, max_cp: int | None = None, cp_modes: Iterable[str] | None = None,
         max_ep: int | None = None) -> list[Estimate]:
    """Estimates of every layout: those that fit first, each group by predicted step time."""
    ests = [estimate(model, cluster, training, lay)
            for lay in enumerate_layouts(model, cluster, training, strategies, max_tp, max_cp, cp_modes, max_ep)]
    return sorted(ests, key=_rank)


def recommend(estimates: Sequence[Estimate]) -> Estimate | None:
    """The fastest layout that fits (ties: less memory), or None when nothing fits."""
    fitting = [e for e in estimates if e.fits]
    return min(fitting, key=_rank) if fitting else None


def _rank(e: Estimate) -> tuple[bool, float, int]:
    return (not e.fits, round(e.step_time_s, 12), e.total_bytes)

# ---- DiLoCo ----------------------------------------------------------------------------------------------------
# DiLoCo in the planner: one replica per node (the inner strategy inside it), a sync every H inner steps.
#
# The sync is one all-reduce of the pseudo-gradient, the size of the parameters this rank steps, over the R
# ranks at the same place of each replica (the group :data:`~shardwise.dims.DILOCO`, ``G = devices / R`` ranks
# apart): ``2 (R - 1) / R`` of those bytes per rank, what DDP's gradient all-reduce of the same model on R ranks
# sends. Spread over the H inner steps of a cycle, a step costs the inner strategy's own traffic (inside the
# replica) plus 1/H of a sync, and its time the inner step's plus 1/H of the sync's (nothing hides it: the
# replicas wait for the average before the next cycle).
#
# Streaming: with F fragments a sync carries 1/F of those bytes (the planner assumes equal fragments), F syncs a
# cycle, so the bytes per step stay the same and the peak of one sync falls F-fold. Quantized, an element costs
# the encoding's bytes (int8's scales included; the padding to whole chunks, at most R x 64 elements, aside).
# A delay of τ inner steps hides up to τ inner steps' time of each sync.


def sync_collective(param_bytes: int, replicas: int, ranks_per_replica: int, cluster: ClusterSpec,
                    fragments: int = 1, quantize: str | None = None, itemsize: int = 4) -> Collective:
    """One sync: the mean of one fragment of ``param_bytes`` (a rank's pieces of the pseudo-gradient, elements
    of ``itemsize`` bytes) over the replicas, sent in ``quantize``'s encoding: a ring's 2 (R - 1) / R of it."""
    link = group_link(cluster, replicas, ranks_per_replica)
    numel = -(-param_bytes // (itemsize * fragments))
    wire = int(numel * element_bytes(quantize, itemsize))
    return _make("all_reduce", DILOCO, "pseudo-gradients (DiLoCo sync)", wire, 1, replicas, link, "none")


@dataclass(frozen=True)
class DiLoCoEstimate:
    """DiLoCo's figures per inner step beside the inner strategy's (``inner``: one replica's estimate)."""

    replicas: int
    sync_every: int
    inner: Estimate
    sync: Collective  # one sync: one fragment's
    fragments: int = 1
    delay: int = 0

    @property
    def comm_bytes_per_step(self) -> float:
        return self.inner.comm_bytes_per_step + self.cross_replica_bytes_per_step

    @property
    def cross_replica_bytes_per_step(self) -> float:
        return self.fragments * self.sync.bytes_sent / self.sync_every

    @property
    def step_time_s(self) -> float:
        """The inner step's time plus each sync's, less the ``delay`` inner steps it overlaps."""
        exposed = max(0.0, self.sync.time_s - self.delay * self.inner.step_time_s)
        return self.inner.step_time_s + self.fragments * exposed / self.sync_every


def estimate_diloco(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, sync_every: int,
                    inner: str = "ddp", fragments: int = 1, delay: int = 0,
                    quantize: str | None = None) -> DiLoCoEstimate | None:
    """DiLoCo with one replica per node of ``cluster`` and ``inner`` inside each, the global batch split over
    the replicas; None when no layout of ``inner`` on one node is planned."""
    replicas = cluster.nodes
    node = dataclasses.replace(cluster, nodes=1)
    batch = training.global_batch // replicas if training.global_batch else None
    ests = [e for e in plan(model, node, dataclasses.replace(training, global_batch=batch), [inner], max_tp=1)
            if e.layout.dp == cluster.devices_per_node]
    if not ests:
        return None
    param_bytes = ests[0].params_bytes  # the parameters a rank of the replica steps (all of them under DDP)
    itemsize = max(1, round(param_bytes / max(1, model.params)))  # ddp inside: every parameter on each rank
    sync = sync_collective(int(param_bytes), replicas, cluster.devices_per_node, cluster, fragments, quantize,
                           itemsize)
    return DiLoCoEstimate(replicas, sync_every, ests[0], sync, fragments, delay)
