"""Elastic restart: SIGKILL of a worker under --max-restarts 1 ends with the uninterrupted losses."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# The killed runs' ranks are fresh processes started by a command (torchrun); the uninterrupted reference
# runs on the session's pool, so only the test without one is marked fresh_processes.
pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_and_crash.py")


def _script():
    spec = importlib.util.spec_from_file_location("train_and_crash", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def uninterrupted(tmp_path, strategy, nproc, steps):
    """The script's training without a kill, on the session's worker pool: the same ranks, layout, threads per
    rank (one) and order of every sum as under `shardwise run`, without paying the start of nproc new
    interpreters (the 8-rank one took 20 s on 2 cores)."""
    m = _script()
    return m.fit(*m.build(strategy), nproc, str(tmp_path / "ck-plain"), 2, steps).losses


def launch(folder, runs, nproc, max_restarts):
    """One `shardwise run --nproc N --max-restarts R` of the script doing ``runs`` in turn in the same ranks
    (a new group each): each run ``(name, strategy, steps, kill rank, kill step, kill attempt)`` writes
    ``folder/name.json`` once it finishes, and a restart skips the runs already finished."""
    argv: list[str] = []
    for name, strategy, steps, rank, step, attempt in runs:
        argv += [*(["++"] if argv else []), "--strategy", strategy, "--steps", str(steps), "--checkpoint-dir",
                 str(folder / f"ck-{name}"), "--out", str(folder / f"{name}.json"), "--kill-rank", str(rank),
                 "--kill-step", str(step), "--kill-attempt", str(attempt)]
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc", str(nproc), "--max-restarts", str(max_restarts),
           SCRIPT, *argv]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=280)


# name: (strategy, ranks, steps, the rank killed, at which step). The tied GPT on dp2 x pp2 with ZeRO-1: a rank
# that holds a stage, a replica and a shard of the optimizer dies, and the restarted job rebuilds all three. The
# layouts a checkpoint crosses (tp and 3-D included) are tests/checkpoint/test_checkpoint_layouts.py's; here the
# claim is the restart itself, which four ranks show at half the start-up of eight.
CASES = {"dp2-pp2": ("dp-pp", 4, 4, 3, 3)}


@pytest.mark.parametrize("name", list(CASES))
def test_sigkill_then_restart_resumes_with_identical_losses(tmp_path, name):
    strategy, nproc, steps, kill_rank, kill_step = CASES[name]
    reference = uninterrupted(tmp_path, strategy, nproc, steps)
    r = launch(tmp_path, [(name, strategy, steps, kill_rank, kill_step, 0)], nproc, 1)
    out = tmp_path / f"{name}.json"
    assert out.exists(), f"{name} did not finish (exit code {r.returncode}):\n{r.stderr[-3000:]}"
    assert "SIGKILL" in r.stderr or "Signals.SIGKILL" in r.stderr or "-9" in r.stderr
    resumed = json.loads(out.read_text())
    assert resumed["restart"] == 1  # it really was the attempt after the kill that finished
    assert resumed["losses"] == reference  # exactly, not approximately: same ranks, same order
    # A callback's state came back from the checkpoint after the kill: it counted the steps before it too.
    assert resumed["steps_seen"] == steps
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.fresh_processes
def test_without_restarts_the_kill_fails_the_job(tmp_path):
    out = tmp_path / "x.json"
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc", "2", SCRIPT, "--checkpoint-dir",
           str(tmp_path / "ck"), "--out", str(out), "--kill-rank", "1", "--kill-step", "3"]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode != 0
    assert not out.exists()
