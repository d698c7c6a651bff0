"""The command line for first-time users and for pipes (issue 17, item 4): help on every flag, our own
`run --help`, `--version`, help without importing torch."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from shardwise import __version__
from shardwise.cli import RUN_HELP, build_parser

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_without_a_terminal_progress_is_plain_lines():
    r = subprocess.run([sys.executable, "-c", FIT], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    import re

    lines = re.findall(r"^shardwise: step (\d+)/20 \((\d+)%\), loss \d+\.\d{4}, [\d.]+ ms/step, RSS \d+ MiB, "
                       r"elapsed \d:\d\d:\d\d, ETA \d:\d\d:\d\d$", r.stderr, re.M)
    assert [int(s) for s, _ in lines] == list(range(2, 21, 2)), r.stderr
    assert "\x1b[" not in r.stderr  # no terminal control codes in a log
