"""Elastic restart: SIGKILL of a worker under --max-restarts 1 ends with the uninterrupted losses."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Every rank here is a fresh process started by a command (torchrun, a script), never the pool.
pytestmark = [pytest.mark.timeout(300), pytest.mark.fresh_processes]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_and_crash.py")


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
    r, out = launch(tmp_path, "plain", strategy, nproc, steps)
    assert r.returncode == 0, r.stderr[-3000:]
    uninterrupted = json.loads(out.read_text())
    r, cmd_out = launch(tmp_path, "killed", strategy, nproc, steps,
                        ("--max-restarts", "1"), ("--kill-rank", str(kill[0]), "--kill-step", str(kill[1])))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SIGKILL" in r.stderr or "Signals.SIGKILL" in r.stderr or "-9" in r.stderr
    resumed = json.loads(cmd_out.read_text())
    assert resumed["restart"] == 1  # it really was the restarted attempt that finished
    assert resumed["losses"] == uninterrupted["losses"]  # exactly, not approximately: same ranks, same order


def test_without_restarts_the_kill_fails_the_job(tmp_path):
    out = tmp_path / "x.json"
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc", "2", SCRIPT, "--checkpoint-dir",
           str(tmp_path / "ck"), "--out", str(out), "--kill-rank", "1", "--kill-step", "3"]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode != 0
    assert not out.exists()
