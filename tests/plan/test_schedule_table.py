"""One table of pipeline-schedule facts (shardwise.parallel.pp.schedules.SCHEDULES).

The runtime, the planner, the figures and the checks read every fact of a schedule (its order, title,
placement, chunks per rank, split backward, bubble and activation memory) from that one entry: a new schedule
is its order plus one entry, and a name registered there is seen by all of them. The table's formulas are
checked against the simulator, which replays each order on the model clock.
"""
from __future__ import annotations

import pytest

import shardwise as sw
from shardwise.commands import plots
from shardwise.parallel.pp import schedules
from shardwise.parallel.pp.placement import LOOP
from shardwise.parallel.pp.schedules import SCHEDULES, ScheduleFacts, bubble_fraction, peak_in_flight, simulate
from shardwise.plan import KNOWN_MODELS, ClusterSpec, Layout, TrainingSpec, estimate
from shardwise.plan.memory import in_flight_microbatches
from shardwise.plan.run import training_spec

pytestmark = pytest.mark.timeout(120)

# Every (p, m) a schedule runs, p >= 2 and m >= p (fewer micro-batches than stages is warned against).
GRID = [(p, m) for p in range(2, 6) for m in range(p, 3 * p + 1)]


def _runs(name: str) -> list[tuple[int, int, int, list[schedules.Event]]]:
    """(p, m, v, events) of ``name`` on the simulator's clock, each chunk 1/v of a stage (F 1, B 2 per stage)."""
    v = schedules.default_chunks(name)
    out = []
    for p, m in GRID:
        try:
            out.append((p, m, v, simulate(name, p, m, v, t_f=1.0 / v, t_b=2.0 / v)))
        except ValueError:
            continue  # an (m, p) this schedule does not run (interleaved: m % p; dualpipev: m >= 2p)
    return out


def _last_stage_peak(name: str, p: int, v: int, events: list[schedules.Event]) -> int:
    """Most micro-batches the last virtual stage holds at once (freed by its W when the backward is split)."""
    place = schedules.placement(name, p, v)
    free = "W" if SCHEDULES[name].split_backward else "B"
    held = peak = 0
    for e in sorted(events, key=lambda e: (e.start, e.end)):
        if place.virtual(e.stage, e.chunk) == place.last:
            held += 1 if e.kind == "F" else -(e.kind == free)
            peak = max(peak, held)
    return peak


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_tables_bubble_and_memory_are_the_simulators(name: str) -> None:
    facts = SCHEDULES[name]
    runs = _runs(name)
    assert runs, f"{name} runs no (p, m) of the grid"
    for p, m, v, events in runs:
        idle = facts.idle(p, m, v, 1.0, 3.0)  # unit costs: f = 1, slot = F + B = 3
        assert bubble_fraction(events) == pytest.approx(idle / (3 * m + idle), abs=1e-12), (p, m)
        assert facts.held(p, m, v) == max(peak_in_flight(events).values()) / v, (p, m)
        assert facts.last_held(p, m, v) >= _last_stage_peak(name, p, v, events), (p, m)
        assert any(e.kind == "W" for e in events) == facts.split_backward


def test_interleaved_is_planned_as_itself() -> None:
    """Narayanan et al. 2021, section 2.2.2: v chunks per rank cut 1F1B's bubble by v, hold (vp + p - 1)/v
    micro-batches at rank 0's peak instead of p, and send v times the messages."""
    model, cluster, lay = KNOWN_MODELS["gpt2-xl"], ClusterSpec.with_devices(4), Layout("ddp", dp=1, pp=4)
    one = estimate(model, cluster, TrainingSpec(global_batch=8), lay)
    for v in (2, 4):
        inter = estimate(model, cluster, TrainingSpec(global_batch=8, schedule="interleaved", chunks=v), lay)
        sends = {c.kind: c for c in inter.collectives if c.group == "pp"}["send_recv"]
        assert sends.calls == v * {c.kind: c for c in one.collectives if c.group == "pp"}["send_recv"].calls
        slot = inter.time.forward_s + inter.time.backward_s + inter.time.slot_comm_s / 8
        assert inter.time.bubble_s == pytest.approx(3 * slot / v)
        assert in_flight_microbatches("interleaved", 4, 8, v) == (4 * v + 3) / v
    run = sw.Parallel(pp=2, schedule="interleaved", chunks=3, microbatches=4).layout(2)
    assert training_spec(run, 8, 4, 1).schedule == "interleaved" and training_spec(run, 8, 4, 1).chunks == 3


def test_a_schedule_registered_in_the_table_is_seen_by_runtime_planner_and_plots(monkeypatch) -> None:
    """A throwaway name, 1F1B's order with facts of its own: every reader finds it, and reads it there."""
    toy = ScheduleFacts(schedules.one_f_one_b, "Toy 1F1B", idle=lambda p, m, v, f, slot: 7 * (p - 1) * slot,
                        held=lambda p, m, v: 5, last_held=lambda p, m, v: 1)
    monkeypatch.setitem(SCHEDULES, "toy", toy)
    # the runtime: its order, placement and chunks, a simulated step, the message check, the strategy
    assert schedules.get_schedule("toy") is schedules.one_f_one_b
    assert (schedules.shape_of("toy"), schedules.default_chunks("toy")) == (LOOP, 1)
    assert bubble_fraction(simulate("toy", 2, 4)) == pytest.approx(1 / 5)  # 1F1B's order: (p-1)/(m+p-1)
    schedules.check_message_order("toy", 2, 4)
    assert sw.Parallel(pp=2, schedule="toy").n_chunks() == 1
    # the planner: the name is valid and its bubble and memory are the entry's
    model, cluster, lay = KNOWN_MODELS["gpt2-xl"], ClusterSpec.with_devices(4), Layout("ddp", dp=1, pp=4)
    base = estimate(model, cluster, TrainingSpec(global_batch=8), lay)
    est = estimate(model, cluster, TrainingSpec(global_batch=8, schedule="toy"), lay)
    assert est.time.bubble_s == pytest.approx(7 * base.time.bubble_s)
    assert in_flight_microbatches("toy", pp=4, microbatches=8) == 5
    # the figures: every schedule of the table, by its title
    fig = plots.simulated_schedules(stages=2, microbatches=4)
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == [f.title for f in SCHEDULES.values()]
    assert fig.axes[-1].get_title().startswith("Toy 1F1B")


def test_an_unknown_name_is_refused_everywhere_with_the_tables_names() -> None:
    valid = ", ".join(SCHEDULES)
    with pytest.raises(ValueError, match=f"valid: {valid}"):
        sw.Parallel(schedule="nope")
    with pytest.raises(ValueError, match=f"use one of {valid}"):
        TrainingSpec(schedule="nope")
