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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def launch(tmp_path, name, strategy="ddp", nproc=2, steps=12, run_args=(), script_args=()):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc", str(nproc), *run_args, SCRIPT, "--strategy", strategy,
           "--steps", str(steps), "--checkpoint-dir", str(tmp_path / f"ck-{name}"), "--out", str(out), *script_args]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=280)
    return r, out


# ddp on digits; the tied GPT over 2 pipeline stages; the same GPT on the 3-D layout dp2 x tp2 x pp2 with ZeRO-1.
@pytest.mark.parametrize("strategy,nproc,steps,kill", [("ddp", 2, 12, (1, 7)), ("pp", 2, 6, (1, 3)),
                                                       ("3d", 8, 4, (5, 3))], ids=["ddp", "pp", "3d"])
def test_sigkill_then_restart_resumes_with_identical_losses(tmp_path, strategy, nproc, steps, kill):
    reference = uninterrupted(tmp_path, strategy, nproc, steps)
    r, cmd_out = launch(tmp_path, "killed", strategy, nproc, steps,
                        ("--max-restarts", "1"), ("--kill-rank", str(kill[0]), "--kill-step", str(kill[1])))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SIGKILL" in r.stderr or "Signals.SIGKILL" in r.stderr or "-9" in r.stderr
    resumed = json.loads(cmd_out.read_text())
    assert resumed["restart"] == 1  # it really was the restarted attempt that finished
    assert resumed["losses"] == reference  # exactly, not approximately: same ranks, same order


@pytest.mark.fresh_processes
def test_without_restarts_the_kill_fails_the_job(tmp_path):
    out = tmp_path / "x.json"
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc", "2", SCRIPT, "--checkpoint-dir",
           str(tmp_path / "ck"), "--out", str(out), "--kill-rank", "1", "--kill-step", "3"]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode != 0
    assert not out.exists()
