"""A main script the ranks would run again is refused before any process starts; one they cannot
re-import (stdin, a notebook) gets forked ranks."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.fresh_processes]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BODY = """import functools, torch
import shardwise as sw
from shardwise.workloads import digits
work = digits()
def train():
    sw.Trainer("ddp", 2, accelerator="cpu", progress=False).fit(
        work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3),
        batch_size=64, max_steps=2)
    print("trained")
"""


def python(args, stdin=None):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, input=stdin,
                          capture_output=True, text=True, timeout=100)


def test_a_script_that_trains_at_top_level_is_refused(tmp_path, monkeypatch):
    # Run as the main script in this process (runpy makes it ``__main__``, with its file, as `python noguard.py`
    # does): the refusal is raised before any process starts, so no interpreter is needed to see it. The real
    # `python script.py` runs are the two tests below.
    script = tmp_path / "noguard.py"
    script.write_text(BODY + "train()\n")
    monkeypatch.setattr(sys, "argv", [str(script)])
    with pytest.raises(RuntimeError) as e:
        runpy.run_path(str(script), run_name="__main__")
    assert str(e.value) == (
        f"{script}, line 10, starts rank processes from the top level of the script: each rank imports "
        "the script again (the 'spawn' start method) and would run this code too. Put it under "
        "`if __name__ == \"__main__\":` (or launch with `shardwise run`)")


def test_the_guarded_script_trains(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(BODY + "if __name__ == '__main__':\n    train()\n")
    r = python([str(script)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "trained"


def test_a_script_from_stdin_trains_in_forked_ranks():
    # No file to re-import (stdin, like a notebook): the ranks are forked, and a model class defined in
    # the script itself reaches them.
    body = BODY.replace("work.make_model()", "Net()").replace("def train():", """from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)
    def forward(self, x):
        return self.fc(x)
def train():""")
    r = python(["-"], stdin=body + "train()\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "trained"
