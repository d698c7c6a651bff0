"""The command line for first-time users and for pipes: help on every flag, our own
`run --help`, `--version`, help without importing torch."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from shardwise import __version__
from shardwise.cli import RUN_HELP, build_parser, main

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shardwise(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardwise", *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=100)


def parsers(p: argparse.ArgumentParser, path: str = "shardwise"):
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_every_flag_of_every_verb_has_help():
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, p in parsers(build_parser())
               for a in p._actions if not isinstance(a, argparse._SubParsersAction) and not a.help]
    assert missing == []


def test_the_parser_is_built_without_torch():
    r = subprocess.run([sys.executable, "-c", "import sys; from shardwise.cli import build_parser; build_parser(); "
                        "import shardwise; shardwise.__version__; print(sorted(m for m in sys.modules "
                        "if m.split('.')[0] in ('torch', 'numpy', 'transformers')))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_run_help_is_ours_and_names_our_flags():
    r = shardwise("run", "--help")
    assert r.returncode == 0
    assert r.stdout == RUN_HELP
    for flag in ("--nproc N", "--standalone", "--help-torchrun", "--nnodes", "--max-restarts"):
        assert flag in r.stdout
    assert shardwise("run").returncode == 2  # no script: the same text, as an error


def test_torchruns_own_help_is_one_flag_away():
    r = shardwise("run", "--help-torchrun")
    assert r.returncode == 0
    assert "--nproc-per-node" in r.stdout and "--rdzv-backend" in r.stdout


def test_version():
    from importlib.metadata import version

    r = shardwise("--version")
    assert r.returncode == 0
    assert r.stdout == f"shardwise {__version__} (torch {version('torch')})\n"


def test_the_bench_help_names_every_pair():
    from shardwise.bench import PAIR_NAMES
    from shardwise.bench.pairs import PAIRS

    assert PAIR_NAMES == tuple(PAIRS)


def test_a_piped_table_is_not_cut():
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = subprocess.run([sys.executable, "-m", "shardwise", "plan", "--params", "7e9", "--devices", "8"], cwd=ROOT,
                       env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout
    assert "│  1 │ zero3 dp8" in r.stdout  # the layout column whole, where 80 columns cut it to "zer…"


FIT = """import functools, torch
import shardwise as sw
from shardwise.workloads import digits
work = digits()
sw.Trainer("single", accelerator="cpu").fit(work.make_model(), work.train, work.loss_fn,
                                            functools.partial(torch.optim.AdamW, lr=1e-3), batch_size=64, max_steps=20)
"""


def fit_without_a_terminal(code: str, capsys) -> tuple[str, str]:
    """Run ``code`` (one device: it trains in this process) with stdout and stderr captured, so neither is a
    terminal, as in a log or a pipe: what it printed on each."""
    capsys.readouterr()
    exec(compile(code, "<fit>", "exec"), {"__name__": "fit"})
    r = capsys.readouterr()
    return r.out, r.err


def test_without_a_terminal_progress_is_plain_lines(capsys):
    _, err = fit_without_a_terminal(FIT, capsys)
    import re

    lines = re.findall(r"^shardwise: step (\d+)/20 \((\d+)%\), loss \d+\.\d{4}, [\d.]+ ms/step, RSS \d+ MiB, "
                       r"elapsed \d:\d\d:\d\d, ETA \d:\d\d:\d\d$", err, re.M)
    assert [int(s) for s, _ in lines] == list(range(2, 21, 2)), err
    assert "\x1b[" not in err  # no terminal control codes in a log


def test_without_a_terminal_progress_false_prints_nothing(capsys):
    quiet = FIT.replace('accelerator="cpu")', 'accelerator="cpu", progress=False)')
    assert quiet != FIT
    out, err = fit_without_a_terminal(quiet, capsys)
    assert "shardwise: step" not in err and out == ""


def test_run_without_a_script_is_an_error_on_stderr():
    r = shardwise("run")
    assert r.returncode == 2
    assert r.stdout == "" and r.stderr == RUN_HELP


def test_every_verb_says_what_it_does():
    for path, p in parsers(build_parser()):
        assert p.description, f"`{path} --help` opens with a description"


# ---- the demo's pictures ------------------------------------------------------


def demo_finished():
    """What `shardwise demo` hands plots.write_demo: label -> (FitResult, devices, global batch), for every run of
    the demo's table, with made-up numbers (no training)."""
    from types import SimpleNamespace

    from shardwise.commands.demo import DEMO_RUNS

    out = {}
    for i, (label, _, n) in enumerate(DEMO_RUNS):
        stats = [{"rank": r, "step_time_s": 1e-3 * (i + 1) * (1 + r / 10), "params_bytes": 1000 + i, "grads_bytes": 900,
                  "optimizer_bytes": 1800, "activation_bytes": 300} for r in range(n)]
        out[label] = (SimpleNamespace(stats=stats), n, 64)
    return out


def tick_labels_overlap(fig, axis: str) -> list[tuple[str, str]]:
    """Neighbouring tick labels whose drawn boxes intersect, on the first axes of ``fig``."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    labels = [t for t in (ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()) if t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in labels]
    return [(a.get_text(), b.get_text()) for a, b, ba, bb in zip(labels, labels[1:], boxes, boxes[1:])
            if ba.overlaps(bb)]


def test_the_demo_throughput_is_a_bar_per_run_each_its_own_colour():
    from shardwise.commands import plots
    from shardwise.commands.demo import DEMO_RUNS

    finished = demo_finished()
    fig = plots.throughput_bars(plots.samples_per_s(finished), "demo")
    ax = fig.axes[0]
    bars = [p for p in ax.patches if p.get_gid() == plots.BAR]
    assert len(bars) == len(DEMO_RUNS) == 12  # bars, not one-point lines
    assert ax.get_lines() == []
    assert len({tuple(round(c, 4) for c in b.get_facecolor()) for b in bars}) == len(DEMO_RUNS)
    # each bar is the global batch over the slowest rank's median step time
    assert [round(b.get_width(), 6) for b in bars] == \
        [round(64 / max(s["step_time_s"] for s in res.stats), 6) for res, _, _ in finished.values()]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"{lbl} ({n} dev.)" for lbl, _, n in DEMO_RUNS]
    assert tick_labels_overlap(fig, "y") == []


def test_the_demo_memory_labels_do_not_overlap():
    from shardwise.commands import plots

    finished = demo_finished()
    rows = plots.memory_rows({label: res for label, (res, _, _) in finished.items()})
    assert len(rows) == sum(n for _, n, _ in finished.values())  # one bar per rank of every run
    fig = plots.memory_figure(rows, "demo memory")
    assert tick_labels_overlap(fig, "x") == []


def test_the_timed_step_leaves_out_the_first(tmp_path):
    # The demo's bars divide by FitResult.stats' step_time_s: the median of the steps after the first, which
    # pays one-off costs (allocations, lazy initialisation), so a short run's time is not its start-up's.
    import functools
    import json
    import statistics

    import torch

    import shardwise as sw
    from shardwise.workloads import digits

    work = digits()
    path = tmp_path / "steps.jsonl"
    res = sw.Trainer("single", accelerator="cpu", progress=False, metrics_path=str(path),
                     log_every_n_steps=1).fit(
        work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3), batch_size=64,
        max_steps=6)
    times = [json.loads(line)["step_time_s"] for line in path.read_text().splitlines()]
    assert len(times) == 6
    assert res.stats[0]["step_time_s"] == pytest.approx(statistics.median(times[1:]))


def test_timeline_labels_fit_their_boxes():
    # A real step's forwards can be a few pixels wide: their "Fi" labels ran into each other ("F1F2F3").
    import dataclasses

    from shardwise.commands import plots
    from shardwise.parallel.pp.schedules import simulate

    events = simulate("gpipe", 2, 4, t_f=1.0, t_b=2.0)
    narrow = [dataclasses.replace(e, end=e.start + 0.02) if e.kind == "F" and e.mb > 0 else e for e in events]
    fig = plots.timeline_figure({"gpipe": narrow, "1f1b": simulate("1f1b", 2, 4)}, "narrow boxes")
    assert plots.count_boxes(fig) == 2 * 2 * 4 * 2  # every box drawn, labelled or not
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        texts = [t for t in ax.texts if t.get_gid() == plots.BOX_LABEL]
        assert len(texts) == 2 * 4 * 2
        shown = [t for t in texts if t.get_visible()]
        boxes = [t.get_window_extent(renderer) for t in shown]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    hidden = {t.get_text() for t in fig.axes[0].texts if not t.get_visible()}
    assert hidden == {"F1", "F2", "F3"}  # the narrow forwards of both stages; every 1F1B box keeps its label
    assert all(t.get_visible() for t in fig.axes[1].texts)


def test_a_narrow_console_wraps_the_plan_table_instead_of_cutting_it(monkeypatch, capsys):
    # The command's own process is test_a_piped_table_is_not_cut's; the width is read from COLUMNS at each print.
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "--params", "7e9", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines() if line.startswith(("┃", "│"))) <= 80
