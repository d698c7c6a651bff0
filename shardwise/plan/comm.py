"""Communication per step: which collectives each layout issues, how many bytes each device sends, how long.

Cost model: alpha-beta (Hockney) with the bus-bandwidth factors of the
bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009; Thakur et al. 2005;
NVIDIA nccl-tests "PERFORMANCE.md"): for a buffer of S bytes on n ranks each
rank sends
    all-reduce                   2 (n-1)/n * S
    all-gather, reduce-scatter     (n-1)/n * S     (S = the full, gathered buffer)
and the time is latency + those bytes / the link's bandwidth. For the latency
we charge ceil(log2 n) steps (2x for all-reduce): NCCL switches to tree and
other logarithmic algorithms exactly when latency dominates, and a pure ring's
(n-1) steps would make a 1024-rank job look absurdly latency-bound.

Volumes per data-parallel rank per step are the ZeRO paper's (section 7):
DDP, ZeRO-1 and ZeRO-2 move 2 Psi (all-reduce, or reduce-scatter + all-gather),
ZeRO-3 3 Psi (all-gather in forward, again in backward, reduce-scatter).
The byte counts equal what :class:`shardwise.comm.Comm` records.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.dims import DP, DP_REPLICATE, DP_SHARD, PP, TP
from shardwise.plan.memory import BytesPerParam, Numels, sharded_numel, total_numel
from shardwise.plan.model import ModelSpec
from shardwise.plan.specs import ClusterSpec, Layout, TrainingSpec

NETWORK_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


@dataclass(frozen=True)
class Link:
    """The bottleneck link of a process group: bandwidth (bytes/s), latency per step (s)."""

    bandwidth: float
    latency: float
    spans_nodes: bool


def group_link(cluster: ClusterSpec, ranks: int, stride: int) -> Link:
    """Link of a group of ``ranks`` ranks ``stride`` apart in the global rank order.

    Inside a node the fabric's per-device bandwidth applies. Across nodes a
    ring leaves each node through the NICs; with k of the group's ranks on a
    node, k rings share k NICs (NCCL runs one channel per NIC), so the group
    sees k times one device's network bandwidth, capped by the fabric.
    """
    g = cluster.devices_per_node
    if (ranks - 1) * stride + 1 <= g and g % stride == 0 or cluster.nodes == 1:
        return Link(cluster.intra_bw, cluster.intra_latency_s, False)
    per_node = max(1, min(ranks, g // stride)) if stride < g else 1
    return Link(min(cluster.intra_bw, per_node * cluster.inter_bw), cluster.inter_latency_s, True)


def latency_steps(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


def collective_time(kind: str, size_bytes: float, n: int, link: Link) -> float:
    """Seconds for one collective over ``n`` ranks; ``size_bytes`` is the full buffer (or message)."""
    if kind in ("send_recv", "host_copy"):
        return link.latency + size_bytes / link.bandwidth
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * latency_steps(n) * link.latency + 2 * (n - 1) / n * size_bytes / link.bandwidth
    if kind in ("all_gather", "reduce_scatter"):
        return latency_steps(n) * link.latency + (n - 1) / n * size_bytes / link.bandwidth
    raise ValueError(f"unknown collective {kind!r}")


def bytes_sent(kind: str, size_bytes: int, n: int) -> int:
    """Bytes one rank sends in one call (ring algorithms; all-gather/reduce-scatter buffers are padded to n)."""
    if kind == "send_recv":
        return size_bytes
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1) * size_bytes // n
    return (n - 1) * (-(-size_bytes // n))


@dataclass(frozen=True)
class Collective:
    """One kind of communication of a step: ``calls`` calls of ``size_bytes`` each on ``ranks`` ranks.

    ``overlap`` says what it can hide behind: ``"backward"``/``"forward"``
    compute (per micro-batch when ``per_microbatch``), ``"slot"`` means it
    sits inside every micro-batch's critical path (tensor and pipeline
    parallel traffic), ``"none"`` that nothing hides it.
    """

    kind: str
    group: str
    purpose: str
    ranks: int
    size_bytes: int
    calls: int
    bytes_sent: int
    time_s: float
    overlap: str
    per_microbatch: bool = False

    @property
    def call_time_s(self) -> float:
        return self.time_s / self.calls if self.calls else 0.0


def _make(kind: str, group: str, purpose: str, total_bytes: int, calls: int, n: int, link: Link,
          overlap: str, per_microbatch: bool = False) -> Collective:
    calls = max(1, calls)
    size = -(-total_bytes // calls)
    # Splitting a buffer into calls (buckets, units) does not change the ring's volume.
    sent = bytes_sent(kind, total_bytes, n) if kind in NETWORK_KINDS else total_bytes
    return Collective(kind, group, purpose, n, size, calls, sent,
                      calls * collective_time(kind, size, n, link), overlap, per_microbatch)


def data_parallel_collectives(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                              numels: Numels, bpp: BytesPerParam, microbatches: int) -> list[Collective]:
    """Gradient and parameter traffic over the data-parallel dimension (ZeRO volumes).

    ``numels``: the device's parameter count, or its parameters' sizes (each padded to the ranks).
    """
    out: list[Collective] = []
    eb = bpp.param  # 16-bit (or fp32) gradients and parameters travel in the working precision
    local_numel = total_numel(numels)
    units = _units(model, layout, local_numel)
    m = microbatches
    # Sharded gradients cannot stay unreduced across micro-batches unless the full ones are kept (no_sync).
    rs = 1 if training.no_sync else m
    if layout.strategy == "hsdp":
        n, r = layout.shard_size, layout.dp // layout.shard_size
        shard_link = group_link(cluster, n, layout.tp)
        repl_link = group_link(cluster, r, layout.tp * n)
        full = n * sharded_numel(numels, n) * eb
        out += [_make("all_gather", DP_SHARD, "gather parameters (forward)", full * m, units * m, n, shard_link,
                      "forward", True),
                _make("all_gather", DP_SHARD, "gather parameters (backward)", full * m, units * m, n, shard_link,
                      "backward", True),
                _make("reduce_scatter", DP_SHARD, "reduce-scatter gradients", full * rs, units * rs, n,
                      shard_link, "backward", rs > 1),
                _make("all_reduce", DP_REPLICATE, "all-reduce gradient shards across replicas",
                      sharded_numel(numels, n) * eb, units, r, repl_link, "backward")]
        return [c for c in out if c.ranks > 1]
    n = layout.dp
    if n == 1:
        return []
    link = group_link(cluster, n, layout.tp)
    full = n * sharded_numel(numels, n) * eb
    buckets = max(1, math.ceil(local_numel * eb / training.bucket_bytes))
    stage = layout.zero_stage
    if stage == 0:
        out.append(_make("all_reduce", DP, "all-reduce gradients", local_numel * eb, buckets, n, link, "backward"))
    elif stage in (1, 2):
        k = rs if stage == 2 else 1  # ZeRO-1 keeps full gradients anyway and reduces once
        out.append(_make("reduce_scatter", DP, "reduce-scatter gradients", full * k, buckets * k, n, link,
                         "backward", k > 1))
        out.append(_make("all_gather", DP, "all-gather updated parameters", full, buckets, n, link, "none"))
    else:
        out += [_make("all_gather", DP, "gather parameters (forward)", full * m, units * m, n, link, "forward",
                      True),
                _make("all_gather", DP, "gather parameters (backward)", full * m, units * m, n, link, "backward",
                      True),
                _make("reduce_scatter", DP, "reduce-scatter gradients", full * rs, units * rs, n, link,
                      "backward", rs > 1)]
    return out


def model_parallel_collectives(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                               s: int, microbatches: int) -> list[Collective]:
    """Tensor-parallel activation traffic (Megatron f/g) and pipeline sends, per step."""
    out: list[Collective] = []
    if not model.is_transformer:
        return out
    eb = 4 if training.precision == "fp32" else 2
    act = s * training.micro_batch * model.hidden * eb
    layers = math.ceil(model.layers / layout.pp)
    t = layout.tp
    if t > 1:
        link = group_link(cluster, t, 1)
        # Two all-reduces in forward and two in backward per layer (Shoeybi et al. 2019, Fig. 4);
        # recomputation replays the forward ones.
        n_ar = layers * (6 if training.activation_checkpointing else 4) * microbatches
        if training.sequence_parallel:
            # Korthikanti et al.: each all-reduce becomes a reduce-scatter plus an all-gather, same volume.
            out.append(_make("all_gather", TP, "sequence-parallel all-gather", act * n_ar, n_ar, t, link, "slot"))
            out.append(_make("reduce_scatter", TP, "sequence-parallel reduce-scatter", act * n_ar, n_ar, t, link,
                             "slot"))
        else:
            out.append(_make("all_reduce", TP, "tensor-parallel all-reduce", act * n_ar, n_ar, t, link, "slot"))
    if layout.pp > 1:
        link = group_link(cluster, layout.pp, t * layout.dp)
        # A middle stage sends each micro-batch's activation forward and its gradient backward; with tp
        # each rank sends only its 1/t slice (Narayanan et al. 2021, scatter/gather optimisation).
        msg = -(-act // t)
        out.append(_make("send_recv", PP, "pipeline activations and gradients", 2 * microbatches * msg,
                         2 * microbatches, 2, link, "slot"))
    return out


def offload_copies(cluster: ClusterSpec, training: TrainingSpec, layout: Layout, numels: Numels,
                   bpp: BytesPerParam) -> list[Collective]:
    """ZeRO-Offload's host traffic: gradient shards down, updated parameter shards up (PCIe, not network)."""
    if training.offload == "none" or layout.zero_stage == 0:
        return []
    part = sharded_numel(numels, layout.shard_size) * bpp.param
    link = Link(cluster.host_bw, 0.0, False)
    return [_make("host_copy", "host", "offload gradients and parameters", 2 * part, 1, 1, link, "none")]


def _units(model: ModelSpec, layout: Layout, local_numel: int) -> int:
    """Gather/reduce units: one per transformer block plus one for embeddings and head."""
    if model.is_transformer:
        return math.ceil(model.layers / layout.pp) + 1
    return max(1, math.ceil(local_numel / max(1, model.unit_params)))
