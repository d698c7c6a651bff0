"""Launching: `shardwise run` (torchrun) joins the group; the CLI verbs work end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Every rank here is a fresh process started by a command (torchrun, a script), never the pool.
pytestmark = [pytest.mark.timeout(240), pytest.mark.fresh_processes]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "shardwise", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_shardwise_run_under_torchrun_equals_spawned(tmp_path):
    out = tmp_path / "losses.json"
    r = run_cli("run", "--nproc", "2", "examples/digits.py", "--strategy", "ddp", "--steps", "6", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "test accuracy" in r.stdout
    torchrun_losses = json.loads(out.read_text())
    out2 = tmp_path / "single.json"
    r = subprocess.run([sys.executable, "examples/digits.py", "--strategy", "single", "--devices", "1", "--steps", "6",
                        "--out", str(out2)], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                       text=True, timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert torchrun_losses == pytest.approx(json.loads(out2.read_text()), rel=1e-5)


def test_setup_example_runs_under_torchrun():
    r = run_cli("run", "--nproc", "2", "examples/setup_loop.py", "--epochs", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "epoch 0: last loss" in r.stdout


def test_verify_on_a_user_factory(tmp_path):
    f = tmp_path / "mymodel.py"
    f.write_text("import torch\n"
                 "class Net(torch.nn.Module):\n"
                 "    def __init__(self):\n"
                 "        super().__init__(); self.a = torch.nn.Linear(12, 16); self.b = torch.nn.Linear(16, 3)\n"
                 "    def forward(self, x): return self.b(torch.tanh(self.a(x)))\n"
                 "def make():\n"
                 "    g = torch.Generator().manual_seed(0)\n"
                 "    ds = torch.utils.data.TensorDataset(torch.randn(128, 12, generator=g),"
                 " torch.randint(0, 3, (128,), generator=g))\n"
                 "    return Net(), ds\n")
    r = run_cli("verify", "--strategy", "ddp", "--devices", "2", "--model", f"{f}:make", "--steps", "4")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("verify ddp on 2 devices, workload ") and lines[0].endswith(", 4 steps")
    assert lines[1].startswith("  noise floor (single device, float32 against float64): losses ")
    assert lines[2].startswith("  losses:  largest difference ") and lines[2].endswith(" equal")
    assert lines[3].startswith("  weights: largest difference ") and lines[3].endswith(" equal")
    assert lines[4] == "  EQUAL"


def test_unknown_strategy_on_the_command_line():
    r = run_cli("verify", "--strategy", "nope", "--steps", "1")
    assert r.returncode != 0
    assert "unknown strategy 'nope'; valid strategies: single, ddp" in r.stderr


@pytest.mark.parametrize("nproc", ["0", "-2"])
def test_run_refuses_a_process_count_below_one(nproc):
    r = run_cli("run", f"--nproc={nproc}", "no_such_script.py", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == f"shardwise run: --nproc must be at least 1, got {nproc}"
