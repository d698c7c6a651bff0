"""Step time: compute from FLOPs, the pipeline bubble, and only the communication that cannot overlap.

FLOPs follow Kaplan et al. 2020 / Narayanan et al. 2021: a training step
costs 6 x parameters x tokens (2 forward, 4 backward) plus the attention
score products (4*s*h per layer per token in forward), and full activation
recomputation adds one more forward, 8 x parameters x tokens in all, which
is the 8 of Narayanan et al.'s equation 4, time ~ 8 T P / (n X).

Context parallelism over c ranks splits every sequence, and so every
micro-batch's FLOPs, c ways (the 2c-chunk split balances causal attention,
Megatron-Core's scheme). Ulysses' all-to-alls block the layer (they sit on the
critical path like tensor parallelism's all-reduces); ring attention sends the
next key/value block while the current one is computed (Liu et al. 2023,
section 3), so its traffic shows only where it outlasts the attention compute
of its pass.

A mixture of experts costs the FLOPs of its active parameters (the dense part
and top_k of each layer's E experts: Fedus et al. 2021, the point of sparse
models). Under balanced routing each rank of an ep group computes as many
expert rows as it dispatches, so ep does not change a rank's FLOPs; tp does
not split the experts (every tp rank runs them whole), so their share of the
work is not divided by tp. The dispatch and combine all-to-alls
(:func:`shardwise.plan.comm.expert_parallel_collectives`, on the ep group's
link as :func:`shardwise.plan.comm.all_to_all_time` prices it) sit on the
critical path of every micro-batch, like tensor parallelism's all-reduces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.parallel.pp.schedules import schedule_facts
from shardwise.plan.comm import Collective
from shardwise.plan.memory import BytesPerParam, Numels, sharded_numel, total_numel
from shardwise.plan.model import ModelSpec
from shardwise.plan.specs import ClusterSpec, Layout, TrainingSpec

SECONDS_PER_DAY = 86400.0


def training_time_s(tokens: float, params: float, devices: int, flops_per_device: float,
                    recompute: bool = True) -> float:
    """Narayanan et al. 2021, equation 4: end-to-end time ~ 8 T P / (n X) (6 without recomputation).

    ``flops_per_device`` is the *achieved* throughput X (the paper's 140
    TFLOP/s for GPT-3 on 1024 A100s), not the peak.
    """
    return (8 if recompute else 6) * tokens * params / (devices * flops_per_device)


def forward_flops_per_sample(model: ModelSpec, s: int) -> float:
    """Forward FLOPs of one sequence of ``s`` tokens (one traced sample for traced models)."""
    if model.trace is not None:
        return model.trace.flops / model.trace.batch / 3  # traced forward + backward; backward ~ 2x forward
    attention = 4 * model.layers * model.hidden * s * s if model.is_transformer else 0
    return 2 * model.active_params * s + attention


def model_flops_per_step(model: ModelSpec, s: int, global_batch: int) -> float:
    """Useful FLOPs of one optimizer step (recomputation excluded), the numerator of MFU."""
    return 3 * forward_flops_per_sample(model, s) * global_batch


@dataclass(frozen=True)
class StepTime:
    """Where one optimizer step's time goes, on the busiest device."""

    forward_s: float  # one micro-batch
    backward_s: float  # one micro-batch, recomputation included
    compute_s: float  # all micro-batches, compute only
    slot_comm_s: float  # tensor/pipeline-parallel traffic on the critical path, all micro-batches
    bubble_s: float
    exposed_dp_s: float  # data-parallel and host traffic that nothing hides
    optimizer_s: float
    total_s: float
    cp_exposed_s: float = 0.0  # ring attention's sends that outlast the attention compute, all micro-batches


def step_time(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout, s: int,
              microbatches: int, numels: Numels, bpp: BytesPerParam, comms: list[Collective],
              expert_numels: Numels = 0) -> StepTime:
    """Compose compute, bubble and exposed communication into one step's time (``expert_numels``: this rank's
    expert parameters when ep > 1, whose optimizer states are sharded over edp; ``numels`` the rest)."""
    speed = cluster.flops(training.precision)
    # The busiest device does its stage's share of the work, split tp ways and, over the tokens, cp ways;
    # the experts' share (active expert FLOPs over all active FLOPs) is not split tp ways.
    routed = expert_flops_fraction(model)
    share = model.stage_flops_share(layout.pp) * ((1 - routed) / layout.tp + routed) / layout.cp
    fwd = forward_flops_per_sample(model, s) * training.micro_batch * share / speed
    bwd = 2 * fwd + (fwd if training.activation_checkpointing else 0)
    slot_comm = sum(c.time_s for c in comms if c.overlap == "slot")
    m, p = microbatches, layout.pp
    ring = _ring_exposed(comms, model, training, layout, s, speed, m)
    slot = fwd + bwd + (slot_comm + ring) / m
    # The schedule's idle time per rank, from the runtime's table (GPipe and 1F1B: p - 1 slots, Narayanan et al.
    # 2021, section 2.2; interleaved: 1/v of that; ZB-H1 and the V schedules: see the table).
    v = training.chunks_per_rank
    bubble = schedule_facts(training.schedule).idle(p, m, v, fwd, slot) if p > 1 else 0.0
    exposed = _exposed(comms, fwd, bwd, m)
    updated = total_numel(numels) if layout.zero_stage == 0 else sharded_numel(numels, layout.shard_size)
    updated += total_numel(expert_numels) if layout.zero_stage == 0 else \
        sharded_numel(expert_numels, layout.expert_shard_size)
    touched = updated * (2 * bpp.param + bpp.grad + 2 * bpp.optimizer)  # read-modify-write of every state
    on_host = training.offload != "none" and layout.zero_stage > 0
    optimizer = touched / (cluster.host_memory_bw if on_host else cluster.memory_bw)
    total = m * slot + bubble + exposed + optimizer
    return StepTime(fwd, bwd, m * (fwd + bwd), slot_comm, bubble, exposed, optimizer, total, ring)


def expert_flops_fraction(model: ModelSpec) -> float:
    """The part of a token's parameter FLOPs spent in its top_k experts (0 for a dense model)."""
    if not model.is_moe:
        return 0.0
    return model.expert_params * model.top_k / model.experts / model.active_params


def _ring_exposed(comms: list[Collective], model: ModelSpec, training: TrainingSpec, layout: Layout, s: int,
                  speed: float, m: int) -> float:
    """Ring attention's traffic left over after hiding behind the attention compute of its pass, all micro-batches.

    A micro-batch's attention on this rank costs 4 h s^2 FLOPs per layer and sample in forward (the score
    and value products), split tp x cp ways, twice that in backward; recomputation replays the forward's
    attention and its sends in backward.
    """
    ring = [c for c in comms if c.overlap.startswith("attention-")]
    if not ring:
        return 0.0
    layers = math.ceil(model.layers / layout.pp)
    attn_fwd = 4 * layers * model.hidden * s * s * training.micro_batch / (layout.tp * layout.cp) / speed
    windows = {"attention-forward": attn_fwd * (2 if training.activation_checkpointing else 1),
               "attention-backward": 2 * attn_fwd}
    return sum(m * max(0.0, sum(c.time_s for c in ring if c.overlap == w) / m - window)
               for w, window in windows.items())


def _exposed(comms: list[Collective], fwd: float, bwd: float, m: int) -> float:
    """Data-parallel (and host) time left over after hiding what can hide behind compute.

    Traffic that overlaps backward (gradient buckets, ZeRO-3's second gather)
    hides behind the backward of the micro-batch it belongs to; ZeRO-3's
    forward gathers behind the forward. Once-per-step traffic shares the last
    micro-batch's window with that micro-batch's own traffic. The first gather
    and the last bucket can never hide, so at least one call is always exposed.
    """
    total = sum(c.time_s for c in comms if c.overlap == "none")
    for overlap, window in (("forward", fwd), ("backward", bwd)):
        per = [c for c in comms if c.overlap == overlap and c.per_microbatch]
        once = [c for c in comms if c.overlap == overlap and not c.per_microbatch]
        per_busy = sum(c.time_s for c in per) / m
        if per:
            total += m * max(max(c.call_time_s for c in per), per_busy - window)
        if once:
            left = max(0.0, window - per_busy)
            total += max(max(c.call_time_s for c in once), sum(c.time_s for c in once) - left)
    return total


def days(seconds: float) -> float:
    return seconds / SECONDS_PER_DAY


def steps_for_tokens(tokens: float, global_batch: int, s: int) -> int:
    return math.ceil(tokens / (global_batch * s))
