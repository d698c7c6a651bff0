"""Pictures from real small runs: files are valid PNGs, figures are labelled, timelines have every box."""
from __future__ import annotations

import pytest

from shardwise.commands import plots
from shardwise.parallel.pp.schedules import get_schedule

pytestmark = pytest.mark.timeout(300)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_png(path) -> None:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert 0 < len(data) < 200 * 1024


def check_labelled(fig) -> None:
    for ax in fig.axes:
        assert ax.get_title(), "every plot has a title"
        assert ax.get_xlabel() and ax.get_ylabel(), "both axes are labelled"
        assert ax.get_legend() is not None, "every plot has a legend"


@pytest.fixture(scope="module")
def pipeline_events():
    return plots.record_pipeline(("gpipe", "1f1b"), stages=2, microbatches=4, width=64, batch=32)


def test_timeline_has_a_box_per_forward_and_backward(pipeline_events, tmp_path):
    assert set(pipeline_events) == {"gpipe", "1f1b"}
    for events in pipeline_events.values():
        # One recorded step: each of 2 stages ran 4 forwards and 4 backwards.
        assert sorted((e.stage, e.kind, e.mb) for e in events) == \
            sorted((s, k, m) for s in range(2) for k in "FB" for m in range(4))
    fig = plots.timeline_figure(pipeline_events, "test timeline")
    check_labelled(fig)
    assert len(fig.axes) == 2  # GPipe and 1F1B side by side
    assert plots.count_boxes(fig) == 2 * 2 * 4 * 2  # schedules x stages x micro-batches x (F, B)
    assert all(plots.count_boxes_in(ax) == 2 * 4 * 2 for ax in fig.axes)
    check_png(plots.save(fig, tmp_path / "pipeline_test.png"))


def test_gpipe_holds_every_microbatch_1f1b_at_most_stages(pipeline_events):
    # What the picture shows, checked on the same events: GPipe's stage 0 runs all
    # forwards before any backward; 1F1B's stage 0 starts backward after p = 2 forwards.
    def order(events, stage):
        return [f"{e.kind}{e.mb}" for e in sorted(events, key=lambda e: e.start) if e.stage == stage]

    assert order(pipeline_events["gpipe"], 0) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert order(pipeline_events["1f1b"], 0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]


def test_memory_figure_from_digits_runs(tmp_path):
    results = plots.measure_memory(["ddp", "zero1", "zero2", "zero3"], devices=2, workload="digits", steps=2)
    rows = plots.memory_rows(results)
    assert [(r["strategy"], r["rank"]) for r in rows] == [(s, r) for s in ("ddp", "zero1", "zero2", "zero3")
                                                          for r in (0, 1)]
    by = {(r["strategy"], r["rank"]): r for r in rows}
    # The bars show what the strategies hold: ZeRO-1 shards optimizer states, ZeRO-2 also
    # gradients, ZeRO-3 also parameters (Rajbhandari et al. 2020); activations are per rank.
    assert by[("zero1", 0)]["optimizer"] < by[("ddp", 0)]["optimizer"]
    assert by[("zero2", 0)]["grads"] < by[("zero1", 0)]["grads"]
    assert by[("zero3", 0)]["params"] < by[("zero2", 0)]["params"]
    assert all(r["activation"] > 0 for r in rows)
    fig = plots.memory_figure(rows, "test memory")
    check_labelled(fig)
    # 4 kinds stacked on 8 bars
    assert len(fig.axes[0].patches) == 4 * 8
    check_png(plots.save(fig, tmp_path / "memory_test.png"))


def test_throughput_figure_from_runs(tmp_path):
    records = plots.measure_throughput(["ddp"], [1, 2], workload="digits", steps=3)
    assert [(r["strategy"], r["devices"]) for r in records] == [("ddp", 1), ("ddp", 2)]
    assert all(r["samples_per_s"] > 0 for r in records)
    fig = plots.throughput_figure(records + [{"strategy": "zero1", "devices": 2, "samples_per_s": 1.0}], "test")
    check_labelled(fig)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["ddp", "zero1"]
    check_png(plots.save(fig, tmp_path / "throughput_test.png"))


def test_cli_flags_exist():
    import argparse

    from shardwise.bench import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--plot", "d"]).plot_dir == "d"


def test_demo_throughput_is_a_bar_per_run_each_its_own_colour(tmp_path):
    # Twelve runs, as the demo has: matplotlib's default cycle would repeat after ten.
    records = [{"strategy": f"s{i}", "devices": 1 + i % 2, "samples_per_s": 100.0 * (i + 1)} for i in range(12)]
    fig = plots.throughput_bars(records, "demo")
    ax = fig.axes[0]
    bars = [p for p in ax.patches if p.get_gid() == plots.BAR]
    assert len(bars) == 12
    assert len({tuple(round(c, 4) for c in b.get_facecolor()) for b in bars}) == 12
    assert [round(b.get_width()) for b in bars] == [100 * (i + 1) for i in range(12)]
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["s0 (1 dev.)", "s1 (2 dev.)"]
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()  # the labels name each bar: no legend
    check_png(plots.save(fig, tmp_path / "bars.png"))
    assert len(set(plots.distinct_colors(30))) == 30


def test_throughput_lines_have_distinct_colours():
    records = [{"strategy": f"s{i}", "devices": d, "samples_per_s": 1.0} for i in range(12) for d in (1, 2)]
    lines = plots.throughput_figure(records).axes[0].get_lines()
    assert len({line.get_color() if isinstance(line.get_color(), str) else tuple(line.get_color())
                for line in lines}) == 12


def test_all_six_schedules_in_one_picture_on_one_time_axis(tmp_path):
    """docs/img/pipeline_schedules_all.png: the six simulated schedules one under the other, same p and m (stated
    in the title), one shared time axis, so a schedule that finishes the same work sooner has a shorter row."""
    fig = plots.simulated_schedules(stages=4, microbatches=8)
    assert plots.ALL_SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
    assert "p = 4" in fig.get_suptitle() and "m = 8" in fig.get_suptitle()
    axes = fig.axes
    assert [ax.get_title().split(":")[0] for ax in axes] == \
        ["GPipe", "1F1B", "interleaved 1F1B", "ZB-H1", "ZBV", "DualPipeV"]
    assert all(ax.get_shared_x_axes().joined(axes[0], ax) for ax in axes)
    assert len({ax.get_xlim() for ax in axes}) == 1
    assert axes[-1].get_xlabel() == "time (model units)"
    assert all(ax.get_ylabel() and ax.get_legend() is not None for ax in axes)
    # stages x micro-batches x actions (F, B; F, B, W when split) x chunks per rank; a whole backward (34 in
    # ZBV, 48 in DualPipeV) is one box, its W included
    whole = [sum(a.whole for r in range(4) for a in get_schedule(s)(4, 8, r, 2)) for s in ("zbv", "dualpipev")]
    assert whole == [34, 48]
    assert [plots.count_boxes_in(ax) for ax in axes] == [4 * 8 * 2, 4 * 8 * 2, 4 * 8 * 2 * 2, 4 * 8 * 3,
                                                         4 * 8 * 3 * 2 - 34, 4 * 8 * 3 * 2 - 48]
    # Where each step ends on the shared clock: 3(m+p-1), interleaved's 28.5, 3m+p-1, (6m+p-1)/2.
    ends = [max(p.get_x() + p.get_width() for p in ax.patches if p.get_gid() == plots.BOX) for ax in axes]
    assert ends == [33.0, 33.0, 28.5, 27.0, 25.5, 25.5]
    check_png(plots.save(fig, tmp_path / "all.png", colors=64))
