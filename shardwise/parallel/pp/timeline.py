"""The vocabulary of a pipeline step and its clocks: actions, the events a step leaves, and the model clock.

A schedule (:mod:`shardwise.parallel.pp.schedules`) is a list of :class:`Action` per rank. Running it
(:func:`shardwise.parallel.pp.run.execute`) leaves one :class:`Event` per action in a :class:`Recorder`,
from which bubbles, activation memory and pictures are computed. :func:`replay` runs action lists on a model
clock instead (unit or given costs, free messages): it checks a schedule for deadlocks, gives its ideal timeline
(``schedules.simulate``) and, through :func:`retime`, the timeline of the per-rank order a real step recorded,
so that a run's bubble can be compared with a formula exactly.

It knows no schedule by name and imports none: the schedules import it (``schedules._joined`` asks the model
clock where a backward can run whole), never the reverse.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from shardwise.parallel.pp.placement import Placement


@dataclass(frozen=True)
class Action:
    """Forward (``"F"``), backward (``"B"``) or weight gradient (``"W"``) of micro-batch ``mb`` on model chunk
    ``chunk``. In a schedule with W actions (a split backward), B computes only the gradient of the stage's
    input (what the previous stage waits for) and W the gradient of its weights (what nobody waits for).

    ``whole`` (a B of a split schedule only) makes that B the whole backward, input and weight gradients in one
    autograd pass, as DualPipe runs the backward of an overlapped pair: the input gradient leaves after both,
    and the W that follows at once only marks where the weights' gradients were done. One pass costs less than
    two on the host (one engine call, no graph kept between them); a schedule asks for it only where nobody
    waits for the input gradient during W."""

    kind: str
    mb: int
    chunk: int = 0
    whole: bool = False

    def __repr__(self) -> str:
        return f"{self.kind}{'W' if self.whole else ''}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass
class Event:
    """One action as it ran: compute time only (waiting for a neighbour is not busy time)."""

    stage: int
    mb: int
    kind: str
    start: float
    end: float
    chunk: int = 0
    step: int = 0
    in_flight: int = 0          # micro-batches with a forward done and backward pending, after this action
    saved_bytes: int = 0        # activation bytes saved for backward on this rank, after this action
    whole: bool = False         # a whole backward (Action.whole): its W's event then has no length


@dataclass
class Recorder:
    """Collects pipeline events; clocks are ``time.perf_counter`` (one host: comparable across ranks).

    With ``track_saved`` the runner counts the bytes autograd saves for
    backward (activations; parameters excluded) through saved-tensor hooks.
    """

    track_saved: bool = False
    events: list[Event] = field(default_factory=list)
    step: int = 0
    peak_saved_bytes: int = 0

    def add(self, e: Event) -> None:
        e.step = self.step
        self.events.append(e)

    def gather(self, comm: Any) -> list[Event]:
        """Every rank's events of ``comm``'s group (all ranks get all)."""
        got = comm.all_gather_object([asdict(e) for e in self.events], name="pp.events")
        return [Event(**d) for part in got for d in part]


def bubble_fraction(events: list[Event]) -> float:
    """Idle share of the step, averaged over stages: ``1 - busy / span`` with one span for all."""
    stages = sorted({e.stage for e in events})
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    span = t1 - t0
    busy = [sum(e.end - e.start for e in events if e.stage == s) for s in stages]
    return 1.0 - sum(busy) / (len(stages) * span)


def peak_in_flight(events: list[Event]) -> dict[int, int]:
    """Most micro-batches whose activations a stage held at once, per stage."""
    out: dict[int, int] = {}
    for e in events:
        out[e.stage] = max(out.get(e.stage, 0), e.in_flight)
    return out


def recorded_orders(events: Sequence[Event]) -> list[list[Action]]:
    """Each rank's actions of one recorded step, in the order the rank ran them (by start time)."""
    steps = {e.step for e in events}
    if len(steps) != 1:
        # Orders of two steps interleaved would be no schedule at all: make the caller pick one.
        raise ValueError(f"events of one step expected, got steps {sorted(steps)}; keep those of one step "
                         "(e.g. [e for e in events if e.step == last])")
    ranks = max(e.stage for e in events) + 1
    orders: list[list[Action]] = [[] for _ in range(ranks)]
    # A rank runs one action at a time, so its start times order its actions; sorted() is stable, which
    # keeps the recorder's own order should two clocks ever read the same.
    for e in sorted(events, key=lambda e: e.start):
        orders[e.stage].append(Action(e.kind, e.mb, e.chunk, e.whole))
    return orders


def retime(events: Sequence[Event], where: Placement, t_f: float = 1.0, t_b: float = 2.0,
           t_w: float | None = None) -> list[Event]:
    """The recorded step again on the simulator's model clock: same per-rank order, model costs.

    A real step's timestamps carry the host's noise, so its bubble only approximates a formula. Re-timing
    keeps what the run decided (which action each rank ran when) and gives each action its model cost, as
    :func:`replay` does (forward ``t_f``, backward ``t_b``, of which W takes ``t_w``, default half, when
    split): it starts when its rank is free and the sends it consumes have ended (messages free). With unit
    costs the :func:`bubble_fraction` is then exact, and another recorded order gives another one. ``where``
    is the run's :func:`placement`. Raises if the order could not have run.
    """
    return replay(recorded_orders(events), where, t_f=t_f, t_b=t_b, t_w=t_w)


def gpipe_bubble(stages: int, microbatches: int) -> float:
    """GPipe's ideal bubble ``(p - 1) / (m + p - 1)`` (Huang et al. 2019)."""
    return (stages - 1) / (microbatches + stages - 1)


def replay(plans: Sequence[Sequence[Action]], place: Placement, t_f: float = 1.0, t_b: float = 2.0,
           t_w: float | None = None, t_pass: float = 0.0) -> list[Event]:
    """Every rank's actions (``plans[r]``, virtual stages where ``place`` puts them) on a model clock: forward
    ``t_f``, backward ``t_b`` per chunk, messages free.

    ``t_b`` is a whole backward; where there are W actions (a split backward) W takes ``t_w`` of it (default
    half) and B the rest, so every schedule does the same work. A whole B (:attr:`Action.whole`) takes all of
    ``t_b`` and its W none. ``t_pass`` is the host's fixed cost of one autograd pass (engine call, graph walk),
    added to each: a split backward pays it twice (B and W), a whole one once. Each rank runs its actions in
    order; an action starts when the rank is free and its inputs exist (the previous virtual stage's forward, or
    the next one's backward). Raises if the actions can deadlock.
    """
    p = place.stages
    if len(plans) != p:
        raise ValueError(f"{len(plans)} ranks' actions for a placement of {p} ranks")
    split = any(a.kind == "W" for plan in plans for a in plan)
    w = (t_b / 2 if t_w is None else t_w) if split else 0.0
    cost = {"F": t_f, "B": t_b - w + t_pass, "W": w + t_pass}
    joined: set[tuple[int, int]] = set()  # (micro-batch, virtual stage) of whole backwards: their W is done
    pos = [0] * p
    clock = [0.0] * p
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) -> end time
    held = [0] * p
    events: list[Event] = []
    last = place.last
    while any(pos[s] < len(plans[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] >= len(plans[s]):
                continue
            a = plans[s][pos[s]]
            k = place.virtual(s, a.chunk)
            need = [("F", a.mb, k - 1)] if a.kind == "F" and k > 0 else []
            if a.kind == "B":
                need = [("F", a.mb, k)] + ([("B", a.mb, k + 1)] if k < last else [])
            if a.kind == "W":
                need = [("B", a.mb, k)]
            if any(n not in done for n in need):
                continue
            start = max([clock[s]] + [done[n] for n in need])
            if a.whole:  # one pass for B and W: the input gradient exists when both are done
                joined.add((a.mb, k))
            end = start + (t_b + t_pass if a.whole else 0.0 if a.kind == "W" and (a.mb, k) in joined
                           else cost[a.kind])
            done[(a.kind, a.mb, k)] = end
            # Activations are freed by the action that last needs them: W when the backward is split.
            held[s] += 1 if a.kind == "F" else (-1 if a.kind == ("W" if split else "B") else 0)
            events.append(Event(s, a.mb, a.kind, start, end, a.chunk, in_flight=held[s], whole=a.whole))
            clock[s] = end
            pos[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: plans[s][pos[s]] for s in range(p) if pos[s] < len(plans[s])}
            raise RuntimeError(f"schedule deadlocks: every stage waits ({stuck})")
    return events


class Lanes:
    """Appends a schedule's actions, numbering each (kind, chunk) lane's micro-batches in order (the V schedules
    build their orders with it).

    ``split=False`` on a B is a whole backward (DualPipe's, :attr:`Action.whole`): its W follows at once. A split
    B's W waits in ``pending`` (oldest first) for :meth:`w_pending` or :meth:`w`."""

    def __init__(self) -> None:
        self.acts: list[Action] = []
        self.count: dict[tuple[str, int], int] = {}
        self.pending: list[tuple[int, int]] = []  # (chunk, micro-batch): B done, W not yet

    def n(self, kind: str, chunk: int) -> int:
        return self.count.get((kind, chunk), 0)

    def held(self, chunk: int) -> int:
        return sum(c == chunk for c, _ in self.pending)

    def f(self, chunk: int) -> None:
        mb = self.n("F", chunk)
        self.count[("F", chunk)] = mb + 1
        self.acts.append(Action("F", mb, chunk))

    def b(self, chunk: int, split: bool = True) -> None:
        mb = self.n("B", chunk)
        self.count[("B", chunk)] = mb + 1
        self.acts.append(Action("B", mb, chunk, whole=not split))
        if split:
            self.pending.append((chunk, mb))
        else:
            self.acts.append(Action("W", mb, chunk))

    def w(self, chunk: int) -> None:
        """The oldest pending W of ``chunk``."""
        i = next(i for i, (c, _) in enumerate(self.pending) if c == chunk)
        c, mb = self.pending.pop(i)
        self.acts.append(Action("W", mb, c))

    def w_pending(self) -> None:
        """The oldest pending W of either chunk, if any."""
        if self.pending:
            c, mb = self.pending.pop(0)
            self.acts.append(Action("W", mb, c))


__all__ = ["Action", "Event", "Lanes", "Recorder", "bubble_fraction", "gpipe_bubble", "peak_in_flight",
           "recorded_orders", "replay", "retime"]
