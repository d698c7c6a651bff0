"""A script that calls fit, then validate, test and predict on one Trainer starts its ranks once: every call's
forwards run in the same two processes (tests/scripts/kept_ranks.py records their ids), and none is left when the
script ends. (fit also runs the model's forward once in the script itself, on the meta device, before any rank
starts: the checks before start.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fit_validate_test_and_predict_run_on_the_ranks_the_first_call_started(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "kept_ranks.py"), str(tmp_path)],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=110,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    script = int(r.stdout.split()[-1])
    pids = {call: {int(p) for p in os.listdir(tmp_path / call)} for call in ("fit", "validate", "test", "predict")}
    ranks = pids["fit"] - {script}
    assert len(ranks) == 2 and script in pids["fit"], pids
    assert pids["validate"] == pids["test"] == pids["predict"] == ranks, pids
    for pid in ranks:  # stopped with the script
        assert not os.path.exists(f"/proc/{pid}"), f"rank process {pid} outlived the script"
