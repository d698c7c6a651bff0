"""Ranks end with the process that started them.

The launcher (a plain `python script.py` calling Trainer(devices=2).fit) is
killed with SIGKILL, which it cannot catch or clean up after: its ranks must
be gone within 10 s, and write no checkpoint after the kill.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from shardwise.checkpoint import store as checkpoint

pytestmark = [pytest.mark.timeout(120), pytest.mark.fresh_processes]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_long.py")


def ranks_of(pid: int) -> list[int]:
    """The rank processes ``pid`` started: its children started by multiprocessing's spawn, and the workers its
    fork server forked (a Trainer's kept ranks, shardwise.pool.KeptRanks), not the fork server itself nor the
    resource tracker."""
    parent, cmdline = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmdline[int(d)] = f.read()
        except OSError:
            continue
    servers = {p for p, pp in parent.items() if pp == pid and b"forkserver" in cmdline.get(p, b"")}
    return [p for p, pp in parent.items()
            if (pp == pid and b"spawn_main" in cmdline.get(p, b"")) or pp in servers]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")
def test_sigkill_of_the_launcher_leaves_no_rank_and_no_later_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ck")
    p = subprocess.Popen([sys.executable, SCRIPT, ckpt], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while len(checkpoint.checkpoints(ckpt)) < 3:  # training, and checkpointing, for real
            assert p.poll() is None and time.monotonic() < deadline, "the run did not start checkpointing"
            time.sleep(0.2)
        ranks = ranks_of(p.pid)
        assert len(ranks) == 2
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        killed_at = time.time()
        # Every rank gone within 10 s. Once they are all gone none can write, so the check for later
        # checkpoints need not wait out the rest of the 10 s.
        while any(alive(r) for r in ranks) and time.time() < killed_at + 10:
            time.sleep(0.1)
        assert [r for r in ranks if alive(r)] == []
        newer = [c for c in checkpoint.checkpoints(ckpt) if os.stat(c).st_mtime > killed_at]
        assert newer == []
    finally:
        if p.poll() is None:
            p.kill()
