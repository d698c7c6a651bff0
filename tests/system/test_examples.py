"""Every example runs end to end at a reduced size, and training actually lowers its loss."""
from __future__ import annotations

import importlib
import json
import os
import re
import sys

import pytest
from conftest import section

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def first_and_final(stdout: str) -> tuple[float, float]:
    first = float(re.search(r"first loss ([0-9.]+)", stdout).group(1))  # type: ignore[union-attr]
    final = float(re.search(r"final loss ([0-9.]+)", stdout).group(1))  # type: ignore[union-attr]
    return first, final


def run_example(name: str, argv: list[str], monkeypatch, capsys) -> str:
    """``python examples/NAME.py ARGV`` as the example's own ``main()`` in this process, its ranks on the session's
    worker pool: what the script does, without paying two fresh interpreters (torch, transformers) per example.
    The examples as scripts, under `shardwise run` and every strategy, are
    tests/system/test_examples_everywhere.py's."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))  # the ranks import the example's module by name
    monkeypatch.setattr(sys, "argv", [f"examples/{name}.py", *argv])
    importlib.import_module(name).main()
    return capsys.readouterr().out


def test_digits_example(tmp_path, monkeypatch, capsys):
    out = tmp_path / "losses.json"
    stdout = run_example("digits", ["--strategy", "ddp", "--devices", "2", "--steps", "50", "--out", str(out)],
                         monkeypatch, capsys)
    losses = json.loads(out.read_text())
    assert len(losses) == 50
    assert losses[-1] < 0.6 * losses[0]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)%", stdout).group(1))  # type: ignore[union-attr]
    assert accuracy > 50.0  # ten classes: chance is 10%


def test_char_gpt_example(monkeypatch, capsys):
    stdout = run_example("char_gpt", ["--strategy", "ddp", "--devices", "2", "--steps", "12", "--chars", "20000",
                                      "--sample", "10"], monkeypatch, capsys)
    first, final = first_and_final(stdout)
    assert final < first - 0.5, stdout
    assert "held-out loss" in stdout and "tokens/s" in stdout and "sample:" in stdout


@pytest.mark.parametrize("flags", [("--strategy", "ddp"),
                                   ("--strategy", "zero3", "--precision", "bf16-mixed", "--activation-checkpointing")])
def test_hf_gpt2_example(flags, monkeypatch, capsys):
    stdout = run_example("hf_gpt2", [*flags, "--devices", "2", "--steps", "8", "--chars", "20000"], monkeypatch,
                         capsys)
    first, final = first_and_final(stdout)
    assert final < first - 0.2, stdout
    assert "held-out loss" in stdout


@pytest.mark.fresh_processes  # its ranks are started by a command (torchrun), never the pool
def test_setup_loop_example(under_run):
    # examples/setup_loop.py --epochs 2 in the session's shared `shardwise run --nproc 2` (tests/conftest.py).
    r, _ = under_run
    text = section(r, "examples/setup_loop.py")
    losses = [float(v) for v in re.findall(r"epoch \d+: last loss ([0-9.]+)", text)]
    assert len(losses) == 2, text
    assert losses[1] < losses[0], text
