"""Pipeline schedules: which forward and backward each stage runs, in which order.

A schedule is a pure function ``(stages, microbatches, stage) -> [Action]``;
it knows nothing about models or communication (partitioning lives in
:mod:`shardwise.parallel.pp.build`; running the actions, with their messages,
in :func:`shardwise.parallel.pp.run.execute`). The actions, the events a
step records and the model clock are :mod:`shardwise.parallel.pp.timeline`'s (its
names are importable from here too); :func:`simulate` replays a schedule named
here on that clock, which checks it for deadlocks and gives its ideal timeline.

* GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural
  Networks using Pipeline Parallelism"): all forwards, then all backwards.
  Every stage holds the activations of all ``m`` micro-batches; the bubble is
  ``(p - 1) / (m + p - 1)`` of the step.
* 1F1B (Narayanan et al. 2019, PipeDream; the flush variant of Narayanan et
  al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", section 2.2): stage ``s`` runs ``p - s - 1`` warm-up
  forwards, then alternates one forward and one backward. Same bubble, but
  at most ``p - s`` micro-batches are in flight on stage ``s``.
* Interleaved 1F1B (same paper, section 2.2.2): each rank holds ``v`` model
  chunks (virtual stages ``r, r + p, ...``); the bubble shrinks by ``v`` at
  the price of ``v`` times more point-to-point messages. Needs ``m % p == 0``.
* ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with each
  backward split into B (input gradient) and W (weight gradient), the Ws
  moved into the drain's bubbles: a third of 1F1B's bubble at its memory.
* ZB-V (same paper, section 6) and DualPipeV (DeepSeek-V3's DualPipe in its
  V form): two chunks per rank placed in a V (:mod:`~shardwise.parallel.pp.placement`),
  so the turn and both ends cost no message; for F = B = W every rank idles
  only the ``p - 1`` forwards its first input needs to arrive.

Everything else known about a schedule is one entry of one table,
:data:`SCHEDULES` (a :class:`ScheduleFacts` per name): its order, its title,
where its virtual stages sit, its model chunks per rank, whether its backward
is split, its bubble and its activation memory. The runtime
(:func:`get_schedule`, :func:`placement`, :func:`default_chunks`), the planner
(:mod:`shardwise.plan`), the figures (:mod:`shardwise.commands.plots`) and the checks
all read it there, so a new schedule is its order plus one entry.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardwise.parallel.pp.placement import LOOP, Placement, V
from shardwise.parallel.pp.timeline import (
    Action,
    Event,
    Lanes,
    Recorder,
    bubble_fraction,
    gpipe_bubble,
    peak_in_flight,
    recorded_orders,
    replay,
    retime,
)


def gpipe(stages: int, microbatches: int, stage: int, chunks: int = 1) -> list[Action]:
    """All forwards, then all backwards (in micro-batch order)."""
    _check(stages, microbatches, stage, chunks, "gpipe")
    return [Action("F", i) for i in range(microbatches)] + [Action("B", i) for i in range(microbatches)]


def one_f_one_b(stages: int, microbatches: int, stage: int, chunks: int = 1) -> list[Action]:
    """PipeDream-Flush: ``p - s - 1`` warm-up forwards, then one forward / one backward, then drain."""
    _check(stages, microbatches, stage, chunks, "1f1b")
    warm = min(stages - stage - 1, microbatches)
    acts = [Action("F", i) for i in range(warm)]
    for f in range(warm, microbatches):
        acts += [Action("F", f), Action("B", f - warm)]
    return acts + [Action("B", b) for b in range(microbatches - warm, microbatches)]


def interleaved_1f1b(stages: int, microbatches: int, stage: int, chunks: int = 2) -> list[Action]:
    """Megatron's interleaved 1F1B over ``chunks`` model chunks per rank (requires ``m % p == 0``).

    Forwards go through chunks in groups of ``p`` micro-batches (chunk 0 for
    micro-batches 0..p-1, chunk 1 for the same, ..., then the next group);
    backwards visit the chunks in reverse. Warm-up is ``2(p - s - 1) + (v - 1)p``
    forwards (all of them when ``m == p``).
    """
    _check(stages, microbatches, stage, chunks, "interleaved")
    p, v, m = stages, chunks, microbatches
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the number of micro-batches ({m}) to be a multiple of the "
                         f"pipeline size ({p}): micro-batches move through the chunks in groups of {p}")
    total = m * v

    def which(k: int, forward: bool) -> tuple[int, int]:
        c = (k // p) % v
        return (k // (p * v)) * p + k % p, (c if forward else v - 1 - c)

    warm = total if m == p else min(total, 2 * (p - stage - 1) + (v - 1) * p)
    acts = [Action("F", *which(k, True)) for k in range(warm)]
    for k in range(total - warm):
        acts += [Action("F", *which(warm + k, True)), Action("B", *which(k, False))]
    return acts + [Action("B", *which(k, False)) for k in range(total - warm, total)]


def zb_h1(stages: int, microbatches: int, stage: int, chunks: int = 1) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3.1): 1F1B with the backward split.

    The forwards and the input-gradient backwards (B) are 1F1B's, so the previous
    stage gets its gradient as soon as 1F1B would give it, sooner in the drain,
    where B no longer waits behind W. Stage ``s`` holds back its first ``s``
    weight gradients (W) and then runs one W after each B: the held-back ones
    fill the drain's bubbles. A stage holds the activations of a micro-batch
    until its W, so stage ``s`` keeps at most ``(p - s) + s = p`` micro-batches,
    1F1B's peak (stage 0's). With unit costs (F = B = W) the idle time per stage
    is ``(p - 1)(F + B - W) = p - 1`` against 1F1B's ``(p - 1)(F + B + W)``: a
    third of the bubble.
    """
    _check(stages, microbatches, stage, chunks, "zb-h1")
    warm = min(stages - stage - 1, microbatches)
    acts = [Action("F", i) for i in range(warm)]
    held: list[int] = []  # micro-batches whose B ran and whose W did not
    order = [(f, f - warm) for f in range(warm, microbatches)] + [(None, b) for b in range(microbatches - warm,
                                                                                           microbatches)]
    for n, (f, b) in enumerate(order):
        if f is not None:
            acts.append(Action("F", f))
        acts.append(Action("B", b))
        held.append(b)
        if n >= stage:  # stage s holds back its first s weight gradients for the drain
            acts.append(Action("W", held.pop(0)))
    return acts + [Action("W", b) for b in held]


def _zbv_order(stages: int, microbatches: int, stage: int, chunks: int = 2) -> list[Action]:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6): two chunks per rank in a V.

    Rank ``r`` holds virtual stages ``r`` (chunk 0, the way down) and ``2p-1-r`` (chunk 1, the way back);
    F, B and W cost the same on both. Warm-up: ``2(p-r)-1`` forwards of chunk 0 (rank ``p-1``, at the turn,
    feeds itself), then ``r`` pairs of a chunk-1 and a chunk-0 forward, then ``p-r`` times chunk 1's
    ``F B W``, the first backwards coming back up. Steady state: ``F B W`` of chunk 0, then of chunk 1. Drain:
    ``r`` pairs of Bs, then ``p-r`` times a chunk-0 B and the oldest W, then every W held back (chunk 1's
    first). Each rank holds at most ``2p`` chunk-activations (``p`` micro-batches of a whole stage, 1F1B's
    peak), and with F = B = W every rank is idle ``2(p-1)`` units against ZB-H1's ``p-1`` of twice the size:
    ``(p-1)/(6m+p-1)`` of the step in whole-stage units (docs/model_parallel.md derives it).

    The order is laid out for at least ``2p-1`` micro-batches (the warm-up's length); with fewer, it is that
    order without the micro-batches that do not exist.
    """
    _check(stages, microbatches, stage, chunks, "zbv")
    p, m, r = stages, microbatches, stage
    n = max(m, 2 * p - 1)
    lane = Lanes()
    for _ in range(2 * (p - r) - 1):
        lane.f(0)
    for _ in range(r):
        lane.f(1)
        lane.f(0)
    for _ in range(p - r):
        lane.f(1)
        lane.b(1)
        lane.w(1)
    while lane.n("F", 1) < lane.n("F", 0) or lane.n("F", 0) < n:
        if lane.n("F", 0) < n:
            lane.f(0)
        lane.b(0)
        lane.w(0)
        lane.f(1)
        lane.b(1)
        lane.w(1)
    for _ in range(r):
        lane.b(0)
        lane.b(1)
    for _ in range(p - r):
        lane.b(0)
        lane.w(0)
    while lane.held(1):
        lane.w(1)
    while lane.held(0):
        lane.w(0)
    return [a for a in lane.acts if a.mb < m]


def _dualpipev_order(stages: int, microbatches: int, stage: int, chunks: int = 2) -> list[Action]:
    """DualPipeV (DeepSeek-V3's DualPipe, Liu et al. 2024, in the V form of deepseek-ai/DualPipe): two chunks per
    rank in a V, ``m >= 2p``.

    Eight phases on rank ``r``: ``2(p-r-1)`` forwards of chunk 0; ``r+1`` pairs F0 F1; ``p-r-1`` times
    ``B1 W F1`` (zero-bubble style); the main phase, ``m-2p+r+1`` times the pairs (F0, B1) and (F1, B0);
    ``p-r-1`` times B1 and the pair (F1, B0); ``r+1`` times B1 B0, whose backwards switch to split (W held
    back) half way; ``p-r-1`` times a held-back W and a B0; the last ``r+1`` held-back Ws.

    DualPipe overlaps the forward and the backward of a pair on two streams (compute of one hides the
    all-to-all of the other); here a pair runs F then the whole backward (one autograd pass, :attr:`Action.whole`,
    written as B then its W), which is its order without the overlap. As in DualPipe, the input gradient of a
    whole backward leaves after the weights' gradients; where it does, the rank that takes it is busy for that
    long anyway, so the step is as long as with every backward split (the simulator checks: idle ``p-1`` per
    rank either way, for every ``p`` and ``m``), at fewer autograd passes.
    """
    _check(stages, microbatches, stage, chunks, "dualpipev")
    p, m, r = stages, microbatches, stage
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2p = {2 * p} micro-batches for {p} stages (its steady phase "
                         f"runs m - 2p + r + 1 pairs on rank r), got {m}; use microbatches >= {2 * p}")
    lane = Lanes()

    def pair(fwd: int, bwd: int) -> None:  # DualPipe's overlapped F&B, here one after the other
        lane.f(fwd)
        lane.b(bwd, split=False)

    for _ in range(2 * (p - r - 1)):
        lane.f(0)
    for _ in range(r + 1):
        lane.f(0)
        lane.f(1)
    for _ in range(p - r - 1):
        lane.b(1)
        lane.w_pending()
        lane.f(1)
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # the last rank's first pair is not overlapped (DualPipe: a smaller bubble)
            lane.f(0)
            lane.b(1, split=False)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(p - r - 1):
        lane.b(1, split=False)
        pair(1, 0)
    split = False
    for i in range(r + 1):  # the second half of these backwards holds W back, to fill the drain
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        lane.b(1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        lane.b(0, split)
    for _ in range(p - r - 1):
        lane.w_pending()
        lane.b(0, split)
    for _ in range(r + 1):
        lane.w_pending()
    if lane.pending:  # every W must run: a schedule that left one behind would train on a partial gradient
        raise AssertionError(f"dualpipev left weight gradients {lane.pending} of rank {r} unscheduled")
    return lane.acts


# The host's fixed cost of one autograd pass (engine call, graph walk), in forwards of one chunk: near 0 where
# compute dwarfs it (large layers on a GPU); about 0.3 for the 2 x Linear(1024) chunks of `shardwise bench --pairs
# zb` on a 2-core CPU, where a whole backward took 2.3 forwards and B and W 1.3 each
# (benchmarks/results/zero-bubble/NOTES.md, 2026-11-27). Multiples of 1/4, so that the model clock's sums are exact.
PASS_COSTS = (0.0, 0.25, 0.5)


@functools.lru_cache(maxsize=128)
def _joined(order: Schedule, stages: int, microbatches: int, chunks: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ``order``, each split B whose W follows at once made whole (one autograd pass instead of two)
    where nobody waits for its input gradient during that W, at every per-pass cost of :data:`PASS_COSTS`.

    On the model clock (F = B = W = 1 per chunk, plus ``t_pass`` per autograd pass) of ``order`` itself (its own
    whole backwards included), the stage that takes the gradient starts its B at least W's compute (1) after
    this B ends, or there is none (virtual stage 0). The whole backward sends the gradient exactly that much
    later and ends ``t_pass`` sooner than B and W together, so, all such joins made at once, no action starts
    later than in ``order`` (by induction over the dependencies) and the step is no longer, at each of these
    costs; where a pass costs something, some start sooner. The per-pass cost matters: DualPipeV's first
    chunk-1 backward on rank 0 at p = 2 has exactly 1 of slack when passes are free and less when they are not."""
    place = Placement(stages, chunks, V)
    plans = [order(stages, microbatches, s, chunks) for s in range(stages)]
    # The split Bs whose W follows at once, as (rank, index, micro-batch, virtual stage); each cost's clock then
    # keeps those whose taker, if any, starts a W's compute after they end.
    free = [(s, i, a.mb, place.virtual(s, a.chunk)) for s, plan in enumerate(plans) for i, a in enumerate(plan)
            if a.kind == "B" and not a.whole and plan[i + 1:i + 2] == [Action("W", a.mb, a.chunk)]]
    for c in PASS_COSTS:
        events = replay(plans, place, t_f=1.0, t_b=2.0, t_w=1.0, t_pass=c)
        b = {(e.mb, place.virtual(e.stage, e.chunk)): e for e in events if e.kind == "B"}
        free = [(s, i, mb, k) for s, i, mb, k in free if k == 0 or b[(mb, k - 1)].start >= b[(mb, k)].end + 1.0]
    whole = {(s, i) for s, i, _, _ in free}
    return tuple(tuple(Action(a.kind, a.mb, a.chunk, a.whole or (s, i) in whole) for i, a in enumerate(plan))
                 for s, plan in enumerate(plans))


def zbv(stages: int, microbatches: int, stage: int, chunks: int = 2) -> list[Action]:
    """ZB-V's order (:func:`_zbv_order`, the paper's and torch's ``ScheduleZBVZeroBubble``'s), with each B that
    nobody waits for run whole (:func:`_joined`): no action later on the model clock, fewer autograd passes."""
    return list(_joined(_zbv_order, stages, microbatches, chunks)[stage])


def dualpipev(stages: int, microbatches: int, stage: int, chunks: int = 2) -> list[Action]:
    """DualPipeV's order (:func:`_dualpipev_order`, with DualPipe's whole backwards, as torch's
    ``ScheduleDualPipeV``), with each further B that nobody waits for run whole (:func:`_joined`)."""
    return list(_joined(_dualpipev_order, stages, microbatches, chunks)[stage])


def forward_only(stages: int, microbatches: int, stage: int, chunks: int = 1) -> list[Action]:
    """Evaluation: forwards only, each micro-batch through this rank's chunks in order (no backward, so no
    schedule to balance; a rank waits only for the forward before it, and sends keep receive order)."""
    _check(stages, microbatches, stage, 1, "forward_only")
    return [Action("F", i, c) for i in range(microbatches) for c in range(chunks)]


def _check(stages: int, microbatches: int, stage: int, chunks: int, name: str) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"{name}: stages ({stages}) and micro-batches ({microbatches}) must be >= 1")
    if not 0 <= stage < stages:
        raise ValueError(f"{name}: stage {stage} is outside 0..{stages - 1}")
    facts = SCHEDULES.get(name)  # None for forward_only, which runs whatever chunks the model has
    if facts is None or facts.any_chunks or chunks == facts.chunks:
        return
    if facts.shape == V:
        raise ValueError(f"{name} runs exactly {facts.chunks} model chunks per rank, placed in a V (rank r holds "
                         f"virtual stages r and 2p-1-r), got chunks={chunks}; use chunks={facts.chunks} (or leave "
                         "it unset)")
    raise ValueError(f"{name} runs one model chunk per stage, got chunks={chunks}; use schedule='interleaved'")


Schedule = Callable[[int, int, int, int], list[Action]]
# idle(p, m, v, f, slot): one rank's idle time per step (p ranks, m micro-batches, v chunks per rank), where f is
# one micro-batch's forward through a whole stage (a weight gradient W costs as much: dW = x^T dY against Y = x W)
# and slot its forward and whole backward, with the traffic on the critical path.
Idle = Callable[[int, int, int, float, float], float]
# held(p, m, v): activations at a peak, in micro-batches of a whole stage (a chunk's count 1/v each).
Held = Callable[[int, int, int], float]


@dataclass(frozen=True)
class ScheduleFacts:
    """One pipeline schedule: all that is known of it, in one place (an entry of :data:`SCHEDULES`).

    Attributes:
        order: ``(stages, microbatches, stage, chunks) -> [Action]``, what one rank runs.
        title: its name in figures and tables.
        idle: its bubble, one rank's idle time per step (:data:`Idle`). At unit costs (f = 1, slot = 3: the
            simulator's F = 1 and B = 2, of which W = 1 when split) the bubble's share of the step is
            ``idle / (3m + idle)``, which tests/plan/test_schedule_table.py checks against :func:`simulate`.
        held: activations the busiest rank holds at its peak (:data:`Held`): the planner's activation memory.
        last_held: micro-batches whose activations and outputs (the logits) the last stage holds at its peak;
            for a V an upper bound (its joined backwards free them sooner).
        shape: where its virtual stages sit on ranks (:mod:`shardwise.parallel.pp.placement`), ``"loop"`` or ``"v"``.
        chunks: model chunks per rank it runs when none are asked for.
        any_chunks: whether it runs other counts too (interleaved: any); otherwise exactly ``chunks``.
        split_backward: whether its backward is split into B (the input's gradient) and W (the weights').
    """

    order: Schedule
    title: str
    idle: Idle
    held: Held
    last_held: Held
    shape: str = LOOP
    chunks: int = 1
    any_chunks: bool = False
    split_backward: bool = False


# The schedules, in the order the docs introduce them (the figures draw them in this order).
SCHEDULES: dict[str, ScheduleFacts] = {
    # Huang et al. 2019: every forward first, so every micro-batch is held; idle (p-1)/(m+p-1) of the step.
    "gpipe": ScheduleFacts(gpipe, "GPipe", idle=lambda p, m, v, f, slot: (p - 1) * slot,
                           held=lambda p, m, v: m, last_held=lambda p, m, v: m),
    # PipeDream-Flush (Narayanan et al. 2021, section 2.2): GPipe's bubble, at most p micro-batches in flight.
    "1f1b": ScheduleFacts(one_f_one_b, "1F1B", idle=lambda p, m, v, f, slot: (p - 1) * slot,
                          held=lambda p, m, v: min(p, m), last_held=lambda p, m, v: 1),
    # Narayanan et al. 2021, section 2.2.2: a chunk is 1/v of a stage, so the bubble is 1/v of 1F1B's,
    # (p-1)/(vm+p-1) of the step; rank 0 warms up with 2(p-1) + (v-1)p chunk-forwards and runs one more before
    # its first backward, (vp + p - 1)/v stages' worth. With m = p every forward comes first, as in GPipe.
    "interleaved": ScheduleFacts(interleaved_1f1b, "interleaved 1F1B",
                                 idle=lambda p, m, v, f, slot: (p - 1) * slot / v,
                                 held=lambda p, m, v: min(m * v, v * p + p - 1) / v,
                                 last_held=lambda p, m, v: m if m == p else 1, chunks=2, any_chunks=True),
    # Qi et al. 2024: the held-back Ws fill the drain, idle (p-1)(F + B - W), never less than the forward the
    # drain waits for (exact from m = p on); the last stage holds its p - 1 held-back micro-batches and one more.
    "zb-h1": ScheduleFacts(zb_h1, "ZB-H1", idle=lambda p, m, v, f, slot: (p - 1) * max(slot - 2 * f, f),
                           held=lambda p, m, v: min(p, m), last_held=lambda p, m, v: min(p, m),
                           split_backward=True),
    # Two chunks in a V, F = B = W per chunk: each rank idles p - 1 chunk-forwards (with m < 2p, 4p - 2 - 2m when
    # more), (p-1)/(6m+p-1) of the step (docs/model_parallel.md derives it); at most 2p chunk-activations.
    "zbv": ScheduleFacts(zbv, "ZBV", idle=lambda p, m, v, f, slot: max(p - 1, 4 * p - 2 - 2 * m) * f / v,
                         held=lambda p, m, v: min(p, m), last_held=lambda p, m, v: min(p, m), shape=V, chunks=2,
                         split_backward=True),
    # DeepSeek-V3's DualPipe in its V form: ZBV's bubble at every m >= 2p, at 2p + 1 chunk-activations.
    "dualpipev": ScheduleFacts(dualpipev, "DualPipeV", idle=lambda p, m, v, f, slot: (p - 1) * f / v,
                               held=lambda p, m, v: min(2 * p + 1, 2 * m) / v, last_held=lambda p, m, v: min(p, m),
                               shape=V, chunks=2, split_backward=True),
}


def schedule_facts(name: str) -> ScheduleFacts:
    """The table's entry for ``name`` (a ValueError naming the valid ones otherwise)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def get_schedule(name: str) -> Schedule:
    return schedule_facts(name).order


def placement(schedule: str, stages: int, chunks: int = 1) -> Placement:
    """Where ``schedule`` puts the ``stages * chunks`` virtual stages (its shape in the table)."""
    return Placement(stages, chunks, shape_of(schedule))


def shape_of(schedule: str) -> str:
    """The placement shape ``schedule`` needs: ``"v"`` for zbv and dualpipev, ``"loop"`` for the others."""
    return schedule_facts(schedule).shape


def default_chunks(schedule: str, chunks: int = 1) -> int:
    """Model chunks per rank a schedule runs when ``chunks`` is left at 1: 2 for interleaved and the V ones."""
    return max(chunks, schedule_facts(schedule).chunks)


# Point-to-point tags: activations and gradients travel on two ordered channels between a pair of ranks.
ACT_TAG, GRAD_TAG = 0, 1


@functools.lru_cache(maxsize=64)
def check_message_order(schedule: str, stages: int, microbatches: int, chunks: int = 1, tagged: bool = True) -> None:
    """Raise unless, between every two ranks, messages are received in the order they are sent.

    Point-to-point messages between a pair of ranks are matched in order: per
    tag with gloo, so activations (:data:`ACT_TAG`) and gradients
    (:data:`GRAD_TAG`) are two channels (``tagged``); all in one with NCCL,
    which ignores tags (``tagged=False``). A schedule is only runnable when,
    on every channel, the sender's order of sends equals the receiver's order
    of receives. The V schedules need the two channels: a rank sends chunk
    0's activations and chunk 1's gradients to the same neighbour, in an order
    its neighbour does not receive them in.
    """
    p, v, m = stages, chunks, microbatches
    place = placement(schedule, p, v)
    sent: dict[tuple[int, ...], list[tuple[str, int, int]]] = {}
    got: dict[tuple[int, ...], list[tuple[str, int, int]]] = {}

    def message(src: int, dst: int, what: tuple[str, int, int], box: dict[tuple[int, ...], Any]) -> None:
        if src != dst:  # two virtual stages on one rank hand over in memory (the turn of a V): no message
            channel = (src, dst, ACT_TAG if what[0] == "act" else GRAD_TAG) if tagged else (src, dst)
            box.setdefault(channel, []).append(what)

    for r in range(p):
        for a in get_schedule(schedule)(p, m, r, v):
            k = place.virtual(r, a.chunk)
            if a.kind == "W":
                continue  # a weight gradient stays on its stage
            if a.kind == "F":
                if k > 0:
                    message(place.rank_of(k - 1), r, ("act", a.mb, k - 1), got)
                if k < place.last:
                    message(r, place.rank_of(k + 1), ("act", a.mb, k), sent)
            else:
                if k < place.last:
                    message(place.rank_of(k + 1), r, ("grad", a.mb, k), got)
                if k > 0:
                    message(r, place.rank_of(k - 1), ("grad", a.mb, k - 1), sent)
    for channel in sorted(set(sent) | set(got)):
        if sent.get(channel, []) != got.get(channel, []):
            how = "" if tagged else (" (one channel per pair, as NCCL has); on NCCL use schedule='1f1b', "
                                     "'interleaved' or 'zb-h1', or run on gloo (accelerator='cpu'), which keeps "
                                     "activations and gradients in two channels")
            raise ValueError(f"schedule {schedule!r} with {p} stages, {m} micro-batches, {v} chunks sends "
                             f"messages from rank {channel[0]} to rank {channel[1]} in a different order than they "
                             f"are received; it cannot run on ordered point-to-point channels{how}")


def simulate(schedule: str | Schedule, stages: int, microbatches: int, chunks: int = 1, t_f: float = 1.0,
             t_b: float = 2.0, t_w: float | None = None, where: Placement | None = None) -> list[Event]:
    """Replay the schedule on a model clock (:func:`~shardwise.parallel.pp.timeline.replay`: forward ``t_f``,
    backward ``t_b`` per chunk, of which W takes ``t_w`` when split, free messages). Raises if it can deadlock.

    Virtual stages sit where the schedule places them (``where`` for a schedule given as a function: the loop
    placement by default)."""
    fn = get_schedule(schedule) if isinstance(schedule, str) else schedule
    place = placement(schedule, stages, chunks) if isinstance(schedule, str) else (where or Placement(stages, chunks))
    return replay([fn(stages, microbatches, s, chunks) for s in range(stages)], place, t_f=t_f, t_b=t_b, t_w=t_w)


__all__ = ["Action", "Event", "Recorder", "SCHEDULES", "ScheduleFacts",
           "bubble_fraction", "check_message_order", "default_chunks", "dualpipev", "forward_only",
           "get_schedule", "gpipe", "gpipe_bubble", "interleaved_1f1b", "one_f_one_b", "peak_in_flight", "placement",
           "recorded_orders", "replay", "retime", "schedule_facts", "shape_of", "simulate", "zb_h1", "zbv"]
