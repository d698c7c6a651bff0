"""Launching: `shardwise run` (torchrun) joins the group; the CLI verbs work end to end."""
from __future__ import annotations

import functools
import json
import os
import runpy
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import section

import shardwise as sw
from shardwise import cli
from shardwise.fit.config import flat
from shardwise.models import MLP
from shardwise.workloads import Digits

# The tests that launch by command (torchrun, a script) are marked fresh_processes: their ranks are fresh
# processes. The verbs called in this process (verify) run their ranks on the session's pool.
pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "shardwise", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.fresh_processes
def test_shardwise_run_under_torchrun_equals_spawned(under_run, tmp_path, monkeypatch, capsys):
    r, out = under_run  # examples/digits.py in the session's shared `shardwise run --nproc 2` (tests/conftest.py)
    assert "test accuracy" in section(r, "examples/digits.py")
    torchrun_losses = json.loads((out / "losses.json").read_text())
    # The reference: the same example on one device, which trains in the calling process (no ranks to start).
    single = tmp_path / "single.json"
    monkeypatch.setattr(sys, "argv", ["examples/digits.py", "--strategy", "single", "--devices", "1", "--steps", "6",
                                      "--out", str(single)])
    monkeypatch.chdir(ROOT)
    runpy.run_path("examples/digits.py", run_name="__main__")
    assert "test accuracy" in capsys.readouterr().out
    assert torchrun_losses == pytest.approx(json.loads(single.read_text()), rel=1e-5)


@pytest.mark.fresh_processes
def test_setup_example_runs_under_torchrun(under_run):
    r, _ = under_run
    assert "epoch 0: last loss" in section(r, "examples/setup_loop.py")
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.fresh_processes
def test_the_configured_example_under_torchrun_is_its_run_in_python_and_flags_win(under_run):
    # examples/configured.py --config examples/configured.yaml --trainer.strategy zero3 --fit.max_steps 6 in the
    # session's shared `shardwise run --nproc 2` (tests/conftest.py): the file says ddp and 100 steps.
    r, out = under_run
    assert "zero3, devices=2: final loss" in section(r, "examples/configured.py")
    written = yaml.safe_load(open(os.path.join(ROOT, "examples", "configured.yaml")))
    kept = yaml.safe_load((out / "configured" / "config.yaml").read_text())
    flags = {"trainer.strategy": "zero3", "fit.max_steps": 6, "out": str(out / "configured.json")}
    assert {k: v for k, v in flat(written).items() if k in flags} == {"trainer.strategy": "ddp", "fit.max_steps": 100,
                                                                      "out": None}
    assert {k: v for k, v in flat(kept).items() if k in flat(written)} == {**flat(written), **flags}
    # The reference: the same run written in Python, on one device in this process.
    torch.manual_seed(0)
    model = MLP(in_features=64, width=128, depth=2, classes=10)
    trainer = sw.Trainer("single", accelerator="cpu", seed=0, progress=False)
    ref = trainer.fit(model, Digits("train"), torch.nn.functional.cross_entropy,
                      functools.partial(torch.optim.AdamW, lr=0.003), batch_size=64, max_steps=6,
                      val_dataset=Digits("test"))
    assert json.loads((out / "configured.json").read_text()) == pytest.approx(ref.losses, rel=1e-5)


def test_verify_on_a_user_factory(tmp_path, monkeypatch, capsys):
    # The verb in this process, its ranks on the session's pool: `shardwise verify` is cli.main (its exit
    # code is main's return value), and nothing in it needs fresh rank processes. A module name of its own,
    # because load() imports the file by name (here and in the pooled ranks, from the caller's sys.path).
    monkeypatch.setattr(sys, "path", list(sys.path))  # load() puts the file's folder on it
    f = tmp_path / "launch_user_model.py"
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
    try:
        code = cli.main(["verify", "--strategy", "ddp", "--devices", "2", "--model", f"{f}:make", "--steps", "4"])
    finally:
        sys.modules.pop("launch_user_model", None)
    r = capsys.readouterr()
    assert code == 0, r.out + r.err[-3000:]
    lines = r.out.splitlines()
    assert lines[0].startswith("verify ddp on 2 devices, workload ") and lines[0].endswith(", 4 steps")
    assert lines[1].startswith("  noise floor (single device, float32 against float64 and itself in 2 other sample "
                               "orders): losses ")
    assert lines[2].startswith("  losses:  largest difference ") and lines[2].endswith(" equal")
    assert lines[3].startswith("  weights: largest difference ") and lines[3].endswith(" equal")
    assert lines[4] == "  EQUAL"


def test_unknown_strategy_on_the_command_line(capsys):
    assert cli.main(["verify", "--strategy", "nope", "--steps", "1"]) != 0
    assert "unknown strategy 'nope'; valid strategies: single, ddp" in capsys.readouterr().err


@pytest.mark.fresh_processes
@pytest.mark.parametrize("nproc", ["0", "-2"])
def test_run_refuses_a_process_count_below_one(nproc):
    r = run_cli("run", f"--nproc={nproc}", "no_such_script.py", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == f"shardwise run: --nproc must be at least 1, got {nproc}"
