"""Every example runs end to end at a reduced size, and training actually lowers its loss."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

# Every rank here is a fresh process started by a command (torchrun, a script), never the pool.
pytestmark = [pytest.mark.timeout(300), pytest.mark.fresh_processes]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def first_and_final(stdout: str) -> tuple[float, float]:
    first = float(re.search(r"first loss ([0-9.]+)", stdout).group(1))  # type: ignore[union-attr]
    final = float(re.search(r"final loss ([0-9.]+)", stdout).group(1))  # type: ignore[union-attr]
    return first, final


def test_digits_example(tmp_path):
    out = tmp_path / "losses.json"
    r = run("examples/digits.py", "--strategy", "ddp", "--devices", "2", "--steps", "50", "--out", str(out))
    losses = json.loads(out.read_text())
    assert len(losses) == 50
    assert losses[-1] < 0.6 * losses[0]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)%", r.stdout).group(1))  # type: ignore[union-attr]
    assert accuracy > 50.0  # ten classes: chance is 10%


def test_char_gpt_example():
    r = run("examples/char_gpt.py", "--strategy", "ddp", "--devices", "2", "--steps", "12", "--chars", "20000",
            "--sample", "10")
    first, final = first_and_final(r.stdout)
    assert final < first - 0.5, r.stdout
    assert "held-out loss" in r.stdout and "tokens/s" in r.stdout and "sample:" in r.stdout


@pytest.mark.parametrize("flags", [("--strategy", "ddp"),
                                   ("--strategy", "zero3", "--precision", "bf16-mixed", "--activation-checkpointing")])
def test_hf_gpt2_example(flags):
    r = run("examples/hf_gpt2.py", *flags, "--devices", "2", "--steps", "8", "--chars", "20000")
    first, final = first_and_final(r.stdout)
    assert final < first - 0.2, r.stdout
    assert "held-out loss" in r.stdout


def test_setup_loop_example():
    r = run("-m", "shardwise", "run", "--nproc", "2", "examples/setup_loop.py", "--epochs", "2")
    losses = [float(v) for v in re.findall(r"epoch \d+: last loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 2, r.stdout
    assert losses[1] < losses[0], r.stdout
