"""benchmarks/gpu_single.py, the GPU machine's measurement, run tiny on CPU: the script must not first break on the
lent machine, whose minutes are few (its first H200 run failed at its first line of CUDA setup, issue 28)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_gpu_single_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu_single.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_single.py"), "--tiny", "--device", "cpu",
                    "--out", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=240)
    res = json.loads(out.read_text())
    strategies = ("single", "ddp", "fsdp", "zero2")
    assert res["params"] == 118_528  # the tiny GPT: 2 layers, 64 wide, 128 tokens of vocabulary, untied
    for name in ("raw", *strategies):
        assert res[name]["step_time_s"] > 0 and len(res[name]["step_times_s"]) == res["reps"]
    for name in strategies:
        # Every contender against the raw loop and against the planner's time for its own layout.
        assert res["trainer_over_raw_tokens_per_s"][name] == pytest.approx(
            res[name]["tokens_per_s"] / res["raw"]["tokens_per_s"])
        assert res[name]["predicted_step_time_s"] > 0
        assert res[name]["measured_over_predicted"] == pytest.approx(
            res[name]["step_time_s"] / res[name]["predicted_step_time_s"])
        # One repetition: the paired ratio is that repetition's raw step over the contender's.
        assert res[name]["paired_over_raw"]["median"] == pytest.approx(
            res["raw"]["step_times_s"][0] / res[name]["step_times_s"][0])
    ck = res["checkpointing"]
    assert ck["predicted_activation_bytes"]["with"] < ck["predicted_activation_bytes"]["without"]
