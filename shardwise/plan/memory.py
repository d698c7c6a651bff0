"""Memory per device: model states (ZeRO), activations (Korthikanti et al.) and temporary buffers.

Model states follow Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", section 3.1 and Table 1: with
Psi parameters, 16-bit weights (2 Psi) and gradients (2 Psi) plus K Psi of
optimizer states (K = 12 for mixed-precision Adam: fp32 master weights,
momentum, variance). Sharded over N data-parallel ranks, ZeRO-1 divides the
optimizer term by N, ZeRO-2 also the gradients, ZeRO-3 everything.
Shards are ``ceil(numel / N)`` elements, as our flat buffers are padded.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.parallel.pp.schedules import default_chunks, schedule_facts
from shardwise.plan.model import ModelSpec
from shardwise.plan.specs import Layout, TrainingSpec, uses_sequence_parallel


def shard_numel(numel: int, n: int) -> int:
    """Elements each of ``n`` ranks holds of a flat buffer of ``numel`` padded to a multiple of ``n``."""
    if n < 1:
        raise ValueError("n must be at least 1")
    return -(-numel // n)


Numels = int | Sequence[int]


def sharded_numel(numels: Numels, n: int) -> int:
    """Elements per rank when one buffer (an int) or each parameter (a sequence) is padded to a multiple of n.

    Our ZeRO and FSDP pad every parameter separately (shardwise.parallel.dp.sharding),
    so given the model's parameter sizes the prediction is exact to the element.
    """
    if isinstance(numels, int):
        return shard_numel(numels, n)
    return sum(shard_numel(x, n) for x in numels)


def padded_copy_numel(numels: Numels, n: int) -> int:
    """Elements of the padded piece copies ZeRO-1/2 keep on the busiest of ``n`` ranks.

    ZeRO-1/2 hand the optimizer a view of the full parameter wherever a rank's
    piece is whole; a piece cut short by the parameter's end (``numel`` not a
    multiple of the piece size ``c = ceil(numel/n)``, or past the end) is a
    ``c``-element copy (shardwise.parallel.dp.zero). Which rank holds it depends
    on the parameter, so this is the maximum over ranks of the copies' sizes.
    Zero for one flat buffer (an int): a single padded buffer has no pieces.
    """
    if isinstance(numels, int) or n == 1:
        return 0
    per_rank = [0] * n
    for x in numels:
        c = shard_numel(x, n)
        for r in range(n):
            if max(0, min(c, x - r * c)) < c:
                per_rank[r] += c
    return max(per_rank)


def total_numel(numels: Numels) -> int:
    return numels if isinstance(numels, int) else sum(numels)


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of the three model states for one precision/optimizer pair."""

    param: int
    grad: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


def bytes_per_param(precision: str, optimizer: str, fp32_grads: bool = False) -> BytesPerParam:
    """fp32: 4 + 4 + states; bf16-mixed: 2 + 2 + fp32 master copy and states (ZeRO's K)."""
    states = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]  # fp32 tensors per parameter
    if precision == "fp32":
        return BytesPerParam(4, 4, 4 * states)
    if precision == "bf16-mixed":
        return BytesPerParam(2, 4 if fp32_grads else 2, 4 + 4 * states)  # master weights + states
    raise ValueError(f"unknown precision {precision!r}")


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one device (``host`` is what ZeRO-Offload keeps in host memory instead)."""

    params: int
    grads: int
    optimizer: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state_bytes(numel: Numels, strategy: str, shard: int, bpp: BytesPerParam, offload: str = "none",
                      full_grads: bool = False) -> StateBytes:
    """Per-device bytes of parameters, gradients and optimizer states for ``numel`` local parameters.

    ``numel`` is a count (one flat buffer) or the parameters' sizes (padded
    one by one); ``strategy`` is ddp, zero1, zero2, zero3, fsdp or hsdp;
    ``shard`` the number of ranks the states are sharded over. The
    conventions are the ones our training code counts: ddp ``P + G + O``,
    zero1 ``P + G + O/N``, zero2 ``P + (G + O)/N``, zero3 ``(P + G + O)/N``.
    ``full_grads``: ZeRO-2/3 accumulating micro-batches under ``no_sync``
    also hold the full, unreduced gradients (in the working precision).
    """
    part = sharded_numel(numel, shard)
    numel_list, numel = numel, total_numel(numel)
    stage = {"ddp": 0, "zero1": 1, "zero2": 2}.get(strategy, 3)
    p = bpp.param * (part if stage >= 3 else numel + (padded_copy_numel(numel_list, shard) if stage >= 1 else 0))
    g = bpp.grad * (part if stage >= 2 else numel) + (bpp.param * numel if full_grads and stage >= 2 else 0)
    o = bpp.optimizer * (part if stage >= 1 else numel)
    if offload == "none" or stage == 0:
        return StateBytes(p, g, o)
    # ZeRO-Offload: the optimizer (with its fp32 gradient partition) runs on the host;
    # "all" (ZeRO-Infinity style) also parks the parameter shards there.
    host = o + (g if stage >= 2 else 0)
    if offload == "all" and stage >= 3:
        return StateBytes(0, 0, 0, host + p)
    return StateBytes(p, 0 if stage >= 2 else g, 0, host)


# A save in the background (``Trainer(checkpoint_async=True)``) copies the rank's checkpoint share to host memory
# and keeps the copy for the whole fit: its parameters and optimizer states (and what is offloaded), not its
# gradients. The exact, rank-by-rank count of a real module is :mod:`shardwise.plan.staging`'s.
STAGING = "checkpoint staging (checkpoint_async)"


def staging_state_bytes(states: StateBytes) -> int:
    """Host bytes a background save stages on a device holding ``states`` (an upper bound with offload, whose
    host bytes include the gradient shards)."""
    return states.params + states.optimizer + states.host


# ---- activations -----------------------------------------------------------
# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models" (arXiv:2205.05198): bytes stored per transformer layer for one
# micro-batch of b sequences of length s, 16-bit activations, 1-byte dropout
# masks, a heads, hidden size h, tensor-parallel size t (their Table 2):
#   no parallelism           s*b*h*(34 + 5*a*s/h)
#   tensor parallel          s*b*h*(10 + 24/t + 5*a*s/(h*t))
#   tensor + sequence par.   s*b*h*(34/t + 5*a*s/(h*t))   (Megatron; shardwise's: 4 + 30/t, see below)
#   full recomputation       s*b*h*2            (only the layer input is kept; /t when it is
#                                                sequence-parallel, as Megatron-LM stores it)
# The 34 is 11 (attention) + 19 (MLP with 4h inner size) + 4 (two layernorms);
# 10 of it is outside the tensor-parallel region (norm and block inputs,
# dropout masks). We generalise the MLP's 16 (GeLU input and output, 2*s*b*4h
# bytes each) to other inner sizes and to gated MLPs (gate, up, activation and
# product: four tensors of the inner size), so the formula is exact for GPT-style
# models and reasonable for Llama-style ones.
#
# Context parallelism over c ranks: each rank holds s/c tokens of every sequence,
# so every term that grows with the tokens (the s*b*h ones) is that of s/c
# tokens. The attention scores are the exception: a rank's s/c queries meet all
# s keys, (s/c)*s scores per head (5 bytes each, as the paper counts them) in
# both modes: ring attention computes them block by block against every rank's
# keys (Liu et al. 2023), Ulysses computes a/c heads over the whole sequence
# (Jacobs et al. 2023), a/c * s * s = a * (s/c) * s. The key/value blocks a ring
# is receiving are a temporary buffer (see buffer_bytes), not per-layer storage.

#
# A mixture of experts (every block's MLP an MoE layer of E experts, top k) keeps, per token, instead of
# the MLP's input (2) and inner tensors: the k rows dispatched to its experts (2k, the experts' input), the
# inner tensors of k gated experts of width I (8 k I / h), the k rows combined back (2k, kept for the
# routing weights' gradient) and the router's E fp32 probabilities (4 E / h). Our tp plans leave the experts
# whole, so that part is not divided by t (expert_coefficient).

def layer_coefficient(model: ModelSpec) -> float:
    """The paper's 34 for this model (per s*b*h bytes, attention scores excluded)."""
    if model.is_moe:
        return 16 + expert_coefficient(model)
    inner = model.ffn / model.hidden
    return 18 + (8 if model.gated_mlp else 4) * inner


def expert_coefficient(model: ModelSpec) -> float:
    """The MoE layer's part of :func:`layer_coefficient` (0 for a dense model): never split by tp."""
    if not model.is_moe:
        return 0.0
    k, h = model.top_k, model.hidden
    return 4 * k + 8 * k * model.moe_ffn / h + 4 * model.experts / h


def layer_activation_bytes(model: ModelSpec, s: int, b: int, tp: int = 1, sequence_parallel: bool = False,
                           recompute: bool = False, flash_attention: bool = False, cp: int = 1,
                           fp32_residual: bool = False) -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch (16-bit activations).

    ``s`` is the whole sequence; with ``cp`` > 1 this rank holds ``s / cp`` of its tokens. ``fp32_residual``:
    autocast over fp32 weights, where the residual stream stays fp32, so the layer's input (all a checkpointed
    layer keeps) and its two norms' inputs take 4 bytes an element, not 2 (measured on CPU and an H200).
    """
    h, a = model.hidden, model.heads
    sbh = s / cp * b * h  # this rank's tokens
    sp = sequence_parallel and tp > 1
    residual = 4 if fp32_residual else 2
    if recompute:
        return residual * sbh / (tp if sp else 1)
    c = layer_coefficient(model)
    x = expert_coefficient(model)  # whole on every tp rank
    # Flash attention never stores the a*s*s score matrices, only a per-row fp32 log-sum-exp (per local query).
    # Otherwise every local query keeps a score for each of the s keys, the whole sequence's.
    scores = 4 * a / h if flash_attention else 5 * a * s / h
    if sp:
        # shardwise's sequence parallelism keeps the all-gathered inputs of q/k/v and of fc1 whole (2 bytes x
        # s*b*h each), so each layer moves exactly plain tp's bytes; Megatron keeps 1/t of them and gathers them
        # again in backward (Table 2's 34/t). Ours: 4 + (34 - 4)/t (shardwise/parallel/tp/sequence_parallel.py).
        return sbh * (4 + x + (c - 4 - x) / tp + scores / tp) + 2 * (residual - 2) * sbh / tp
    return sbh * (10 + x + (c - 10 - x) / tp + scores / tp) + 2 * (residual - 2) * sbh


def no_stored_scores(model: ModelSpec, training: TrainingSpec) -> bool:
    """Attention keeps no (heads x s x s) scores for backward: asked for (``--flash-attention``) or the model's own
    kernel is fused (:attr:`ModelSpec.fused_attention`)."""
    return training.flash_attention or model.fused_attention


def fp32_residual(training: TrainingSpec) -> bool:
    """Autocast over fp32 weights (shardwise's "bf16-mixed"): the residual stream stays fp32."""
    return training.autocast and training.precision != "fp32"


def output_activation_bytes(model: ModelSpec, s: int, b: int, tp: int = 1, sequence_parallel: bool = False,
                            cp: int = 1, scale: int = 1) -> float:
    """Final norm and output-layer inputs (4*s*b*h for 16-bit activations, ``scale`` = 2 for fp32 ones) plus fp32
    logits kept for cross entropy (4*s*b*V/t in either precision: fp32 training used to count them twice, 1.4x
    the measured checkpointed GPT), for the ``s / cp`` tokens this rank holds."""
    sp = sequence_parallel and tp > 1
    tokens = s / cp
    return scale * 4 * tokens * b * model.hidden / (tp if sp else 1) + 4 * tokens * b * model.vocab / tp


def cp_block_bytes(model: ModelSpec, s: int, b: int, tp: int, cp: int, element_bytes: int) -> int:
    """One key (or value) block of a ring step: b x (s/cp) tokens x this tp rank's kv heads x head size."""
    return b * (s // cp) * model.kv_heads_per_rank(tp) * model.head_dim * element_bytes


def in_flight_microbatches(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """Micro-batches (of a whole stage) whose activations the busiest rank holds at its peak: the schedule's
    ``held`` in the runtime's table (:data:`shardwise.parallel.pp.schedules.SCHEDULES`), e.g. 1F1B's p (Narayanan
    et al. 2021, PipeDream-Flush: the first backward starts after p forwards), GPipe's m. ``chunks``: per rank
    (1: the schedule's own). Without a pipeline a rank holds one micro-batch at a time."""
    if pp == 1:
        return 1
    return schedule_facts(schedule).held(pp, microbatches, default_chunks(schedule, chunks))


def activation_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, s: int, microbatches: int) -> int:
    """Peak activation bytes of the busiest device, or 0 when the model has neither shape nor trace."""
    b, tp, pp, cp = training.micro_batch, layout.tp, layout.pp, layout.cp
    act_scale = 2 if training.precision == "fp32" else 1  # the formulas count 16-bit activations
    if model.trace is not None:
        tr = model.trace
        per_sample = tr.saved_bytes - (tr.saved_float_bytes / 2 if training.precision != "fp32" else 0)
        return math.ceil(per_sample / tr.batch * b)
    if not model.is_transformer:
        return 0
    sp = uses_sequence_parallel(training, layout)
    per_layer = act_scale * layer_activation_bytes(model, s, b, tp, sp, training.activation_checkpointing,
                                                   no_stored_scores(model, training), cp,
                                                   fp32_residual(training))
    layers = math.ceil(model.layers / pp)
    first = in_flight_microbatches(training.schedule, pp, microbatches, training.chunks) * layers * per_layer
    # The last stage's micro-batches in flight, its logits included (the table's last_held: 1 under 1F1B, all of
    # them under GPipe, p under ZB-H1, whose last stage holds back p - 1 weight gradients).
    last_inflight = 1 if pp == 1 else \
        schedule_facts(training.schedule).last_held(pp, microbatches, training.chunks_per_rank)
    last = last_inflight * (layers * per_layer + output_activation_bytes(model, s, b, tp, sp, cp, act_scale))
    return math.ceil(max(first, last))


def buffer_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout, s: int, local_numel: int,
                 bpp: BytesPerParam) -> dict[str, int]:
    """Temporary buffers alive at the peak, by purpose."""
    out: dict[str, int] = {}
    act_bytes = 4 if training.precision == "fp32" else 2
    comm_grad = bpp.param  # gradients travel in the working precision
    # DDP and ZeRO-1 keep full gradients, and those are the communication buckets themselves (our DDP, and
    # torch's with gradient_as_bucket_view=True), so they need nothing extra. ZeRO-2 keeps only a shard:
    # the unsharded buckets being filled and reduce-scattered are extra, two in flight.
    if layout.zero_stage == 2 and layout.shard_size > 1:
        out["gradient buckets"] = min(2 * training.bucket_bytes, local_numel * comm_grad)
    if layout.zero_stage >= 3:
        # The gathered unit's 16-bit parameters and its unsharded gradient before reduce-scatter;
        # FSDP prefetches the next unit, so two are alive.
        live = 2 if layout.strategy in ("fsdp", "hsdp") else 1
        unit = math.ceil(model.unit_params / layout.tp)
        if model.is_moe and layout.ep > 1 and model.is_transformer and not model.largest_layer_params:
            # Under ep each experts module is a unit of its own (E / ep experts), the rest of the block another.
            experts = model.expert_layer_params()
            unit = max(math.ceil((model.layer_params() - experts) / layout.tp), math.ceil(experts / layout.ep),
                       math.ceil(model.vocab * model.hidden / layout.tp))
        out["gathered units"] = live * unit * (bpp.param + comm_grad)
    if model.is_transformer and model.trace is None:
        b, cp = training.micro_batch, layout.cp
        if model.is_moe and layout.ep > 1:
            # One MoE layer's dispatch: the rows gathered for sending and those received, each (b s/cp k) x h
            # (balanced routing), alive around the all-to-all; the combine reuses the space.
            out["expert all-to-all rows"] = 2 * b * (s // cp) * model.top_k * model.hidden * act_bytes
        if training.activation_checkpointing:
            # Backward recomputes one layer at a time: that layer's full activations come back.
            full = layer_activation_bytes(model, s, b, layout.tp, uses_sequence_parallel(training, layout), False,
                                          no_stored_scores(model, training), cp,
                                          fp32_residual(training))
            out["recomputed layer"] = math.ceil(full * act_bytes / 2)
        if layout.pp > 1:
            out["pipeline send/recv"] = 2 * math.ceil(s // cp * b * model.hidden * act_bytes / layout.tp)
        if cp > 1 and layout.cp_mode == "ring":
            # Ring attention computes on one key/value block while the next arrives: two blocks (each a key
            # and a value) are being received at any time (Liu et al. 2023, double buffering).
            out["cp key/value blocks in flight"] = 2 * 2 * cp_block_bytes(model, s, b, layout.tp, cp, act_bytes)
        elif cp > 1:
            # Ulysses' all-to-alls are out of place: while q, k and v change from sequence to head shards both
            # copies exist; the head-sharded ones are what attention saves (the same bytes as Korthikanti's).
            q = b * (s // cp) * (model.heads // layout.tp) * model.head_dim * act_bytes
            out["cp all-to-all buffers"] = q + 2 * ulysses_kv_bytes(model, s, b, layout.tp, cp, act_bytes)
    return out


def ulysses_kv_bytes(model: ModelSpec, s: int, b: int, tp: int, cp: int, element_bytes: int) -> int:
    """A key (or value) tensor one rank gives Ulysses' all-to-all: its s/cp tokens of this tp rank's kv heads,
    replicated up to cp heads when there are fewer (each cp rank needs at least one head; Jacobs et al. 2023)."""
    heads = max(model.kv_heads_per_rank(tp), cp)
    return b * (s // cp) * heads * model.head_dim * element_bytes
