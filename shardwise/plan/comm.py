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
The byte counts equal what :class:`shardwise.comm.Comm` records, under the
labels of the groups it records them in.

Context parallelism over c ranks (the cp group, tp ranks apart) adds, per
attention layer and micro-batch, with k = key/value heads on this tp rank, d
the head size, b the micro-batch and e the element size:

* ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers"):
  forward, c-1 steps each sending the key block and the value block
  (b (s/c) k d e bytes each, name ``cp.kv``); backward, the same c-1 sends
  again plus c sends of the key and value gradients (``cp.dkv``);
* Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses"): all-to-alls of q, k, v
  and of the attention output in forward, their mirror in backward
  (``cp.a2a``); each sends (c-1)/c of the local tensor, so q, k, v and the
  output of a whole sequence of N tokens and hidden size h move 4 N h / P per
  rank and direction as c grows, the paper's per-link volume.

and the data-parallel collectives run over dp x cp ranks (``dp_cp`` for DDP,
``dp_shard_cp`` for ZeRO/FSDP), because the cp ranks of a replica compute
gradients of the same parameters from different tokens.

Expert parallelism over ep ranks (blocks of ep neighbours of the dp x cp
ranks, tp apart) adds, per MoE layer and micro-batch, with N = b s / cp
tokens on a rank, k experts per token, E experts and hidden size h: one
all-to-all of the E per-expert counts (int64, ``ep_counts``), then the
dispatch of the routed rows to their experts' ranks (``ep_dispatch``) and
their return (``ep_combine``), both mirrored in backward (``ep_combine_grad``,
``ep_dispatch_grad``). Only rows that leave the rank are sent; under balanced
routing (every expert receives N k / E of a rank's slots, the expectation of
a router that balances, not what a given batch does) a rank sends

    rows = N k (ep - 1) / ep,   bytes = rows x h x e   per all-to-all,

fewer with a capacity factor cf below 1 (each expert takes at most
``C = ceil(cf N k / E)`` of a rank's slots: rows = (E - E/ep) min(N k / E, C)).
The expert gradients are reduced (and, under ZeRO/FSDP, sharded) over
``edp`` (dp x cp / ep ranks, tp x ep apart), the dense ones over dp x cp as
before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.dims import CP, DP, DP_CP, DP_REPLICATE, DP_SHARD, DP_SHARD_CP, EDP, EP, PP, TP
from shardwise.plan.memory import BytesPerParam, Numels, cp_block_bytes, sharded_numel, total_numel, ulysses_kv_bytes
from shardwise.plan.model import ModelSpec
from shardwise.plan.specs import ClusterSpec, Layout, TrainingSpec, uses_sequence_parallel

NETWORK_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")


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
    if kind == "all_to_all":  # every rank keeps 1/n and sends the rest, to n - 1 peers at once
        return latency_steps(n) * link.latency + (n - 1) / n * size_bytes / link.bandwidth
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
    if kind == "all_to_all":  # size_bytes is the local tensor (Comm.all_to_all's count)
        return size_bytes * (n - 1) // n
    return (n - 1) * (-(-size_bytes // n))


@dataclass(frozen=True)
class Collective:
    """One kind of communication of a step: ``calls`` calls of ``size_bytes`` each on ``ranks`` ranks.

    ``overlap`` says what it can hide behind: ``"backward"``/``"forward"``
    compute (per micro-batch when ``per_microbatch``), ``"slot"`` means it
    sits inside every micro-batch's critical path (tensor and pipeline
    parallel traffic, Ulysses' all-to-alls), ``"attention-forward"`` /
    ``"attention-backward"`` that it hides behind that micro-batch's attention
    compute of that pass (ring attention), ``"none"`` that nothing hides it.
    ``name`` is the prefix of the names :class:`shardwise.comm.Comm` records
    the calls under, where the planner knows it (``"cp.kv"``); every kind
    here receives what it sends.
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
    name: str = ""

    @property
    def call_time_s(self) -> float:
        return self.time_s / self.calls if self.calls else 0.0

    @property
    def bytes_received(self) -> int:
        """Ring collectives, all-to-alls and the ring's sends receive as much as they send (host copies: 0)."""
        return self.bytes_sent if self.kind in NETWORK_KINDS else 0


def _make(kind: str, group: str, purpose: str, total_bytes: int, calls: int, n: int, link: Link,
          overlap: str, per_microbatch: bool = False) -> Collective:
    calls = max(1, calls)
    size = -(-total_bytes // calls)
    # Splitting a buffer into calls (buckets, units) does not change the ring's volume.
    sent = bytes_sent(kind, total_bytes, n) if kind in NETWORK_KINDS else total_bytes
    return Collective(kind, group, purpose, n, size, calls, sent,
                      calls * collective_time(kind, size, n, link), overlap, per_microbatch)


def data_parallel_collectives(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                              numels: Numels, bpp: BytesPerParam, microbatches: int,
                              expert_numels: Numels = 0) -> list[Collective]:
    """Gradient and parameter traffic over the data-parallel dimension (ZeRO volumes).

    ``numels``: the device's parameter count, or its parameters' sizes (each padded to the ranks).
    ``expert_numels``: with ep > 1, this rank's expert rows (a count or sizes), reduced and sharded over
    ``edp`` instead (``numels`` then being the dense rest); with ep = 1 they are simply part of ``numels``.
    """
    if total_numel(expert_numels) and layout.ep == 1:  # one group for all: the experts' is the dense one
        numels = total_numel(numels) + total_numel(expert_numels) \
            if isinstance(numels, int) or isinstance(expert_numels, int) else tuple(numels) + tuple(expert_numels)
        expert_numels = 0
    out = _dense_collectives(model, cluster, training, layout, numels, bpp, microbatches)
    if total_numel(expert_numels) == 0:
        return out
    n = layout.expert_shard_size
    if n == 1:
        return out  # every expert on one rank of each ep group: nothing to reduce
    # The edp group: the ranks at the same place of every block of ep neighbours, tp x ep apart.
    link = group_link(cluster, n, layout.tp * layout.ep)
    units = math.ceil(model.layers / layout.pp) if model.is_transformer else 1  # each experts module one unit
    return out + _family(EDP, n, link, units, training, layout.zero_stage, expert_numels, bpp, microbatches,
                         "expert ")


def _dense_collectives(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                       numels: Numels, bpp: BytesPerParam, microbatches: int) -> list[Collective]:
    out: list[Collective] = []
    eb = bpp.param  # 16-bit (or fp32) gradients and parameters travel in the working precision
    local_numel = total_numel(numels)
    units = _units(model, layout, local_numel)
    m = microbatches
    # Sharded gradients cannot stay unreduced across micro-batches unless the full ones are kept (no_sync).
    rs = 1 if training.no_sync else m
    shard = dp_group(layout)
    # The cp ranks sit between dp and tp in the mesh: a dp x cp group is tp ranks apart, cp innermost.
    if layout.strategy == "hsdp":
        n = layout.shard_size  # dp_shard x cp ranks
        r = layout.dp * layout.cp // n
        shard_link = group_link(cluster, n, layout.tp)
        repl_link = group_link(cluster, r, layout.tp * n)
        full = n * sharded_numel(numels, n) * eb
        out += [_make("all_gather", shard, "gather parameters (forward)", full * m, units * m, n, shard_link,
                      "forward", True),
                _make("all_gather", shard, "gather parameters (backward)", full * m, units * m, n, shard_link,
                      "backward", True),
                _make("reduce_scatter", shard, "reduce-scatter gradients", full * rs, units * rs, n,
                      shard_link, "backward", rs > 1),
                _make("all_reduce", DP_REPLICATE, "all-reduce gradient shards across replicas",
                      sharded_numel(numels, n) * eb, units, r, repl_link, "backward")]
        return [c for c in out if c.ranks > 1]
    n = layout.dp * layout.cp
    if n == 1:
        return []
    link = group_link(cluster, n, layout.tp)
    return _family(shard, n, link, units, training, layout.zero_stage, numels, bpp, m)


def _family(group: str, n: int, link: Link, units: int, training: TrainingSpec, stage: int, numels: Numels,
            bpp: BytesPerParam, m: int, what: str = "") -> list[Collective]:
    """The ZeRO volumes of ``numels`` over a group of ``n`` (label ``group``): DDP's all-reduce, ZeRO-1/2's
    reduce-scatter and all-gather, ZeRO-3's two gathers and reduce-scatter (``what`` names the parameters)."""
    eb = bpp.param
    local_numel = total_numel(numels)
    rs = 1 if training.no_sync else m
    full = n * sharded_numel(numels, n) * eb
    buckets = max(1, math.ceil(local_numel * eb / training.bucket_bytes))
    if stage == 0:
        return [_make("all_reduce", group, f"all-reduce {what}gradients", local_numel * eb, buckets, n, link,
                      "backward")]
    if stage in (1, 2):
        k = rs if stage == 2 else 1  # ZeRO-1 keeps full gradients anyway and reduces once
        return [_make("reduce_scatter", group, f"reduce-scatter {what}gradients", full * k, buckets * k, n, link,
                      "backward", k > 1),
                _make("all_gather", group, f"all-gather updated {what}parameters", full, buckets, n, link, "none")]
    return [_make("all_gather", group, f"gather {what}parameters (forward)", full * m, units * m, n, link, "forward",
                  True),
            _make("all_gather", group, f"gather {what}parameters (backward)", full * m, units * m, n, link,
                  "backward", True),
            _make("reduce_scatter", group, f"reduce-scatter {what}gradients", full * rs, units * rs, n, link,
                  "backward", rs > 1)]


def dp_group(layout: Layout) -> str:
    """The label of the group that reduces (and, under ZeRO/FSDP, shards) the gradients, as ``Comm`` records it.

    With cp > 1 the cp ranks join it: DDP all-reduces over ``dp_cp``, ZeRO and FSDP (HSDP's shard groups too)
    over ``dp_shard_cp``. With cp = 1 those groups are ``dp`` (DDP, ZeRO, FSDP: every dp rank one shard) and
    ``dp_shard`` (HSDP), the labels of before.
    """
    if layout.cp == 1:
        return DP_SHARD if layout.strategy == "hsdp" else DP
    return DP_CP if layout.zero_stage == 0 else DP_SHARD_CP


def model_parallel_collectives(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                               s: int, microbatches: int) -> list[Collective]:
    """Tensor-parallel activation traffic (Megatron f/g), context-parallel attention traffic and pipeline
    sends, per step. ``s`` is the whole sequence; a cp rank's activations are those of ``s / cp`` tokens."""
    out: list[Collective] = []
    if not model.is_transformer:
        return out
    eb = 4 if training.precision == "fp32" else 2
    act = s // layout.cp * training.micro_batch * model.hidden * eb
    layers = math.ceil(model.layers / layout.pp)
    t = layout.tp
    if t > 1:
        link = group_link(cluster, t, 1)
        # Two all-reduces in forward and two in backward per layer (Shoeybi et al. 2019, Fig. 4);
        # recomputation replays the forward ones.
        n_ar = layers * (6 if training.activation_checkpointing else 4) * microbatches
        if uses_sequence_parallel(training, layout):
            # Korthikanti et al.: each all-reduce becomes a reduce-scatter plus an all-gather, same volume.
            out.append(_make("all_gather", TP, "sequence-parallel all-gather", act * n_ar, n_ar, t, link, "slot"))
            out.append(_make("reduce_scatter", TP, "sequence-parallel reduce-scatter", act * n_ar, n_ar, t, link,
                             "slot"))
        else:
            out.append(_make("all_reduce", TP, "tensor-parallel all-reduce", act * n_ar, n_ar, t, link, "slot"))
    out += context_parallel_collectives(model, cluster, training, layout, s, microbatches)
    out += expert_parallel_collectives(model, cluster, training, layout, s, microbatches)
    if layout.pp > 1:
        link = group_link(cluster, layout.pp, t * layout.cp * layout.dp)
        # A middle stage sends each micro-batch's activation forward and its gradient backward, once per model
        # chunk it holds (interleaved: v times 1F1B's messages, Narayanan et al. 2021, section 2.2.2); with tp
        # each rank sends only its 1/t slice (the same paper's scatter/gather optimisation).
        msg = -(-act // t)
        sends = 2 * microbatches * training.chunks_per_rank
        out.append(_make("send_recv", PP, "pipeline activations and gradients", sends * msg, sends, 2, link, "slot"))
    return out


def context_parallel_collectives(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                                 s: int, microbatches: int) -> list[Collective]:
    """The cp group's attention traffic per step (group label ``cp``), forward and backward separately.

    Per attention layer and micro-batch (see the module docstring): ring, c-1 sends of the key and the value
    block forward, the same c-1 plus c sends of their gradients backward; Ulysses, 4 all-to-alls forward
    (q, k, v, output) and their 4 mirrors backward. Full recomputation replays the forward's traffic in
    backward, as it replays tensor parallelism's all-reduces.
    """
    c = layout.cp
    if c == 1 or not model.is_transformer:
        return []
    eb = 4 if training.precision == "fp32" else 2
    b, t = training.micro_batch, layout.tp
    calls = math.ceil(model.layers / layout.pp) * microbatches  # attention layers run on this rank per step
    replays = 2 if training.activation_checkpointing else 1
    if layout.cp_mode == "ulysses":
        q = b * (s // c) * (model.heads // t) * model.head_dim * eb  # the output has q's shape
        kv = ulysses_kv_bytes(model, s, b, t, c, eb)
        per_layer = [q, kv, kv, q]
        sent = sum(bytes_sent("all_to_all", x, c) for x in per_layer)  # Comm counts each call's (c-1)/c apart
        busy = sum(all_to_all_time(cluster, x, c, t) for x in per_layer)
        again = ", and again in its recomputation" if replays > 1 else ""
        return [Collective("all_to_all", CP, f"Ulysses all-to-alls of q, k, v and the output (forward{again})", c,
                           max(per_layer), 4 * calls * replays, sent * calls * replays, busy * calls * replays,
                           "slot", True, "cp.a2a"),
                Collective("all_to_all", CP, "Ulysses all-to-alls of their gradients (backward)", c, max(per_layer),
                           4 * calls, sent * calls, busy * calls, "slot", True, "cp.a2a")]
    block = cp_block_bytes(model, s, b, t, c, eb)
    link = ring_link(cluster, c, t)
    step = collective_time("send_recv", block, 2, link)

    def sends(n: int, purpose: str, overlap: str, name: str) -> Collective:
        return Collective("send_recv", CP, purpose, c, block, n, n * block, n * step, overlap, True, name)

    again = ", and again in its recomputation" if replays > 1 else ""
    return [sends(2 * (c - 1) * calls * replays, f"ring attention: key and value blocks (forward{again})",
                  "attention-forward", "cp.kv"),
            sends(2 * (c - 1) * calls, "ring attention: key and value blocks again (backward)",
                  "attention-backward", "cp.kv"),
            sends(2 * c * calls, "ring attention: key and value gradients (backward)", "attention-backward",
                  "cp.dkv")]


def expert_rows_sent(tokens: int, top_k: int, experts: int, ep: int, capacity_factor: float | None = None) -> float:
    """Rows one rank sends in one dispatch (and receives back in the combine) under balanced routing: of its
    ``tokens x top_k`` slots, each expert takes ``tokens x top_k / experts`` (at most the capacity
    ``ceil(cf x tokens x top_k / experts)``), and the ``experts - experts / ep`` experts of other ranks' are
    the ones that leave it."""
    per_expert = tokens * top_k / experts
    if capacity_factor is not None:
        per_expert = min(per_expert, math.ceil(capacity_factor * tokens * top_k / experts))
    return (experts - experts // ep) * per_expert


def expert_all_to_all_bytes(rows: float, hidden: int, element_size: int) -> int:
    """Bytes one rank sends in an expert all-to-all of ``rows`` off-rank rows: ``rows x hidden x element size``
    (its own rows stay put; what :class:`shardwise.comm.Comm` records for ``ep_dispatch`` and its kin)."""
    return round(rows * hidden * element_size)


def expert_parallel_collectives(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                                s: int, microbatches: int) -> list[Collective]:
    """The ep group's token traffic per step (group label ``ep``; see the module docstring), by name.

    Per MoE layer on this rank and micro-batch: the counts' all-to-all and the dispatch and combine in
    forward (replayed by full recomputation, as tensor parallelism's all-reduces are), their mirrors in
    backward. Every block is taken to be an MoE layer (Mixtral's and our GPT's). The all-to-alls sit on the
    critical path: the experts wait for their rows, the next layer for the combine.
    """
    e = layout.ep
    if e == 1 or not model.is_moe or not model.is_transformer:
        return []
    eb = 4 if training.precision == "fp32" else 2
    tokens = training.micro_batch * (s // layout.cp)  # a tp rank runs the MoE on every token of its dp x cp rank
    calls = math.ceil(model.layers / layout.pp) * microbatches
    replays = 2 if training.activation_checkpointing else 1
    rows = expert_rows_sent(tokens, model.top_k, model.experts, e, layout.capacity_factor)
    sent = expert_all_to_all_bytes(rows, model.hidden, eb)
    size = -(-sent * e // (e - 1))  # the local tensor, this rank's own rows included (Comm's count)
    busy = all_to_all_time(cluster, size, e, layout.tp)
    counts = model.experts * 8  # int64 per expert
    again = ", and again in its recomputation" if replays > 1 else ""

    def a2a(name: str, purpose: str, n: int) -> Collective:
        return Collective("all_to_all", EP, purpose, e, size, n, sent * n, busy * n, "slot", True, name)

    return [a2a("ep_dispatch", f"expert dispatch: routed rows to their experts' ranks (forward{again})",
                calls * replays),
            a2a("ep_combine", f"expert combine: the experts' outputs back (forward{again})", calls * replays),
            a2a("ep_combine_grad", "expert combine's gradient: rows to the experts again (backward)", calls),
            a2a("ep_dispatch_grad", "expert dispatch's gradient: back to the tokens' ranks (backward)", calls),
            Collective("all_to_all", EP, f"expert load counts (forward{again})", e, counts, calls * replays,
                       bytes_sent("all_to_all", counts, e) * calls * replays,
                       all_to_all_time(cluster, counts, e, layout.tp) * calls * replays, "slot", True, "ep_counts")]


def all_to_all_time(cluster: ClusterSpec, size_bytes: float, ranks: int, stride: int) -> float:
    """Seconds for one all-to-all of a ``size_bytes`` local tensor over ``ranks`` ranks ``stride`` apart.

    Each rank sends 1/n of its tensor to every other rank at once. Inside a node that is (n-1)/n of it over
    the fabric; across nodes the part for other nodes leaves through the device's own network card while the
    part for its node's k ranks crosses the fabric, and the slower of the two sets the time (unlike a ring,
    an all-to-all cannot spread one device's traffic over its node's other cards).
    """
    link = group_link(cluster, ranks, stride)
    if ranks <= 1:
        return 0.0
    if not link.spans_nodes:
        return collective_time("all_to_all", size_bytes, ranks, link)
    g = cluster.devices_per_node
    k = max(1, min(ranks, g // stride)) if stride < g else 1  # the group's ranks on one node
    off_node = (ranks - k) / ranks * size_bytes / cluster.inter_bw
    on_node = (k - 1) / ranks * size_bytes / cluster.intra_bw
    return latency_steps(ranks) * link.latency + max(off_node, on_node)


def ring_link(cluster: ClusterSpec, ranks: int, stride: int) -> Link:
    """The slowest hop of a ring of point-to-point sends over ``ranks`` ranks ``stride`` apart.

    Every rank sends its block to the next at each step, so the ring moves at its slowest hop: a node's
    fabric when the ring stays in a node, else one device's own network card (the hop that leaves a node).
    """
    inside = group_link(cluster, ranks, stride)
    if not inside.spans_nodes:
        return inside
    return Link(min(cluster.intra_bw, cluster.inter_bw), cluster.inter_latency_s, True)


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
