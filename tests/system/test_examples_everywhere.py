"""Every example under every strategy it accepts exits 0 under `shardwise run --nproc 2`.

One launch runs every example under each strategy in turn, in the same ranks
(tests/scripts/each_strategy.py); a pair an example refuses runs in that launch
too, expected to raise in every rank before the ranks meet.

The strategies are every registered name that runs as one process per
device (one-process strategies, `single` and `dp`, do not belong under a
two-process launch), so a strategy added later is covered without an edit
here. Each example runs a couple of steps at a tiny size: this proves the
command works end to end on every layout; equivalence is proven elsewhere.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import once_per_run

from shardwise.strategies.registry import available_strategies, resolve

pytestmark = [pytest.mark.timeout(150), pytest.mark.fresh_processes]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
TEXT = ("--steps", "2", "--chars", "5000", "--embd", "32", "--block", "16", "--batch", "8")
EXAMPLES = {
    "char_gpt.py": (*TEXT, "--sample", "5"),
    "hf_gpt2.py": TEXT,
    "digits.py": ("--steps", "2"),
    "setup_loop.py": ("--epochs", "1"),
}
# A hand-written loop cannot drive a parameter server (its servers run their own loop): sw.setup refuses it.
REFUSED = {("setup_loop.py", "ps"): (
    "ValueError: strategy 'ps' cannot run in a hand-written loop: its server ranks hold no model replica and run a "
    "serving loop of their own while the workers train; use sw.Trainer('ps', devices=N).fit(...)")}
MULTI_PROCESS = [n for n in available_strategies() if n != "single" and resolve(n).processes(2) == 2]


def test_the_strategies_cover_every_family():
    assert {"ddp", "ps", "zero1", "zero2", "zero3", "fsdp", "hsdp", "tp", "pp", "parallel"} <= set(MULTI_PROCESS)


def shardwise_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise", "run", "--nproc", "2", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=420)


def accepted(example: str) -> list[str]:
    return [s for s in MULTI_PROCESS if (example, s) not in REFUSED]


@pytest.fixture(scope="module")
def every_run(tmp_path_factory) -> subprocess.CompletedProcess:
    """One launch runs every example under every strategy it accepts, in turn, in the same two ranks
    (tests/scripts/each_strategy.py): the same runs as one launch per pair, with the launcher's and the
    ranks' start-up (torch, transformers) paid once. The refused pairs come last, each written ``S!``: the
    example must raise in every rank, and rank 0 prints what it raised."""
    argv: list[str] = []
    for example, flags in EXAMPLES.items():
        argv += [*(["++"] if argv else []), f"examples/{example}", ",".join(accepted(example)), "--", *flags]
    for example, strategy in sorted(REFUSED):
        argv += ["++", f"examples/{example}", f"{strategy}!", "--", *EXAMPLES[example]]
    return once_per_run("examples-everywhere", tmp_path_factory,
                        lambda: shardwise_run("tests/scripts/each_strategy.py", *argv))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_exits_0_under_shardwise_run_with_every_strategy(every_run, example):
    r, names = every_run, accepted(example)
    done = [line.split()[2] for line in r.stdout.splitlines()
            if line.startswith(f"each_strategy: examples/{example} ") and line.endswith(" ok")]
    where = [line for line in r.stdout.splitlines() if line.startswith("each_strategy:")][-1:]
    assert done == names, f"failed at {where}:\n" + r.stdout[-2000:] + r.stderr[-4000:]
    ran = r.stdout.split(f"each_strategy: examples/{example} {names[0]} starts")[1].split(
        f"each_strategy: examples/{example} {names[-1]} ok")[0]
    finals = [line for line in ran.splitlines() if "final loss" in line or "epoch 0: last loss" in line]
    assert len(finals) == len(names), r.stdout[-2000:]
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example,strategy", sorted(REFUSED))
def test_a_refused_pair_fails_at_once_with_the_reason(every_run, example, strategy):
    # In the shared launch's ranks, under `shardwise run --nproc 2`: sw.setup refuses the pair before the ranks
    # meet, in each rank alone (each_strategy fails the launch if any rank goes on). That a rank's exception
    # fails a `shardwise run` job, its message first on stderr, is tests/system/test_fail_fast.py's claim.
    r = every_run
    said = [line for line in r.stdout.splitlines() if line.startswith(f"each_strategy: examples/{example} {strategy} ")]
    assert said == [f"each_strategy: examples/{example} {strategy} refused: {REFUSED[example, strategy]}"], (
        r.stdout[-2000:] + r.stderr[-4000:])
    assert r.returncode == 0, r.stderr[-4000:]
