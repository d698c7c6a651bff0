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


def run(*args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def first_and_final(stdout: str) -> tuple[float, float]:
    first = float(re.search(r"first loss ([0-9.]+)", stdout).group(1))  # type: ignore[union-attr]
    final = float(re.search(r"final loss ([0-9.]+)", stdout).group(1))  # type: ignore[union-attr]
    return first, final


# The examples run as plain-Python scripts (each spawns its own 2 rank processes), all in one interpreter:
# tests/scripts/each_strategy.py runs each as __main__ in turn, so the script's own interpreter and its
# imports (torch, transformers) are paid once instead of once per example. --keep-going: a run that fails
# leaves its traceback in its own section and the next one still runs. case: (example, strategy, flags).
HF_FLAGS = [("--strategy", "ddp"), ("--strategy", "zero3", "--precision", "bf16-mixed", "--activation-checkpointing")]
PLAIN = {"digits": ("examples/digits.py", "ddp", ("--devices", "2", "--steps", "50", "--out", "{out}/losses.json")),
         "char_gpt": ("examples/char_gpt.py", "ddp", ("--devices", "2", "--steps", "12", "--chars", "20000",
                                                      "--sample", "10")),
         **{f"hf_gpt2{i}": ("examples/hf_gpt2.py", flags[1], (*flags[2:], "--devices", "2", "--steps", "8",
                                                               "--chars", "20000"))
            for i, flags in enumerate(HF_FLAGS)}}


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("examples")
    argv: list[str] = ["--keep-going"]
    for example, strategy, flags in PLAIN.values():
        argv += [*(["++"] if len(argv) > 1 else []), example, strategy, "--", *(f.format(out=out) for f in flags)]
    r = subprocess.run([sys.executable, "tests/scripts/each_strategy.py", *argv], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=560)
    return r, out


def ran(plain_runs, case: str) -> str:
    """What ``case``'s run printed; fails with its own traceback (or the end of the output) unless it ended well."""
    r, _ = plain_runs
    example, strategy, _ = PLAIN[case]
    begin = f"each_strategy: {example} {strategy} starts"
    assert begin in r.stdout, f"{case} never started (exit code {r.returncode}):\n" + r.stdout[-2000:] + \
        r.stderr[-3000:]
    text = r.stdout.split(begin, 1)[1].split("each_strategy: ", 1)[0]
    assert f"each_strategy: {example} {strategy} ok" in r.stdout, f"{case} failed:\n" + text[-5000:] + \
        r.stderr[-2000:]
    return text


@pytest.mark.timeout(600)
def test_digits_example(plain_runs):
    stdout = ran(plain_runs, "digits")
    losses = json.loads((plain_runs[1] / "losses.json").read_text())
    assert len(losses) == 50
    assert losses[-1] < 0.6 * losses[0]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)%", stdout).group(1))  # type: ignore[union-attr]
    assert accuracy > 50.0  # ten classes: chance is 10%


@pytest.mark.timeout(600)
def test_char_gpt_example(plain_runs):
    stdout = ran(plain_runs, "char_gpt")
    first, final = first_and_final(stdout)
    assert final < first - 0.5, stdout
    assert "held-out loss" in stdout and "tokens/s" in stdout and "sample:" in stdout


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags", HF_FLAGS)
def test_hf_gpt2_example(plain_runs, flags):
    stdout = ran(plain_runs, f"hf_gpt2{HF_FLAGS.index(flags)}")
    first, final = first_and_final(stdout)
    assert final < first - 0.2, stdout
    assert "held-out loss" in stdout


def test_setup_loop_example():
    r = run("-m", "shardwise", "run", "--nproc", "2", "examples/setup_loop.py", "--epochs", "2")
    losses = [float(v) for v in re.findall(r"epoch \d+: last loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 2, r.stdout
    assert losses[1] < losses[0], r.stdout
