"""The background writer: calls made in order on another thread, flushed by finalize and run_ref, a failed write
raised on the caller's thread, and what is queued written at interpreter exit."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from shardwise.loggers import Background

pytestmark = pytest.mark.timeout(60)


class Slow:
    """Records each call and the thread that made it; each write takes ``delay`` seconds."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.delay, self.fail_at = delay, fail_at
        self.calls: list[tuple] = []
        self.threads: set[str] = set()

    def log_hyperparams(self, params):
        self.calls.append(("hparams", params))

    def log_metrics(self, metrics, step):
        time.sleep(self.delay)
        if step == self.fail_at:
            raise OSError("disk full")
        self.threads.add(threading.current_thread().name)
        self.calls.append(("metrics", metrics, step))

    def run_ref(self):
        return {"calls": len(self.calls)}

    def finalize(self, status):
        self.calls.append(("finalize", status))


def test_calls_are_made_in_order_off_the_callers_thread_and_flushed():
    slow = Slow(delay=0.02)
    bg = Background(slow)
    bg.log_hyperparams({"lr": 1})
    row = {"train/loss": 1.0}
    start = time.perf_counter()
    for step in range(5):
        bg.log_metrics(row, step)
    queued = time.perf_counter() - start
    row["train/loss"] = 2.0  # the caller reuses its dict: what was queued is a copy
    assert queued < 0.05  # five writes of 20 ms each did not run on this thread
    assert bg.run_ref() == {"calls": 6}  # run_ref waits for what is queued
    bg.finalize("success")
    assert slow.calls == [("hparams", {"lr": 1})] + [("metrics", {"train/loss": 1.0}, s) for s in range(5)] + [
        ("finalize", "success")]
    assert slow.threads == {"shardwise-logger-Slow"}


def test_a_failed_write_is_raised_on_the_callers_thread_after_finalizing():
    slow = Slow(fail_at=1)
    bg = Background(slow)
    for step in range(3):
        bg.log_metrics({"x": 1.0}, step)
    with pytest.raises(RuntimeError, match="^logger Slow failed writing: disk full$"):
        bg.finalize("success")
    assert slow.calls == [("metrics", {"x": 1.0}, 0), ("finalize", "success")]  # steps after the failure dropped


def test_what_is_queued_is_written_at_exit():
    code = ("import time, sys\nfrom shardwise.loggers import Background\n"
            "class L:\n"
            "    def log_metrics(self, m, step): time.sleep(0.05); print('row', step, flush=True)\n"
            "bg = Background(L())\n"
            "for s in range(3): bg.log_metrics({}, s)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n") == ["row 0", "row 1", "row 2", ""]
