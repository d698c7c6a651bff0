"""The worker pool the suite runs its ranks on: reuse, isolation between jobs, failures read as from fresh processes."""
from __future__ import annotations

import functools
import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise import launch
from shardwise.launch import WorkerFailed
from shardwise.launch import (
    spawn as fresh_spawn,  # bound before the suite routes launch.spawn to the pool
)
from shardwise.pool import WorkerPool
from shardwise.workloads import digits

pytestmark = pytest.mark.timeout(180)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _sum_ranks(rank: int, device: torch.device, offset: int, path: str) -> None:
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    if rank == 0:
        torch.save({"sum": t.item(), "pid": os.getpid(), "env": os.environ.get("SW_POOL_PROBE"),
                    "cwd": os.getcwd(), "rand": torch.rand(3), "dtype": str(torch.get_default_dtype())}, path)


def _leaves_state_behind(rank: int, device: torch.device) -> None:
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)


def _raises_on_1(rank: int, device: torch.device) -> None:
    if rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()


def _dies_on_1(rank: int, device: torch.device) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_jobs_reuse_processes_and_see_a_fresh_start(tmp_path, monkeypatch, worker_pool):
    path = str(tmp_path / "out.pt")
    monkeypatch.setenv("SW_POOL_PROBE", "seen")
    monkeypatch.chdir(tmp_path)
    worker_pool.spawn(_sum_ranks, 3, args=(4, path))  # starts any of the 3 workers not running yet
    started = worker_pool.started
    pids, rands = set(), []
    for offset in (5, 6):
        worker_pool.spawn(_sum_ranks, 3, args=(offset, path))
        got = torch.load(path)
        assert got["sum"] == 3 * offset + 0 + 1 + 2
        pids.add(got["pid"]), rands.append(got["rand"])
        worker_pool.spawn(_leaves_state_behind, 3)  # a seed and a default dtype the next job must not inherit
    assert len(pids) == 1 and worker_pool.started == started  # the same processes served every job
    assert got["env"] == "seen" and got["cwd"] == str(tmp_path)
    assert got["dtype"] == "torch.float32"
    # Seeded afresh per job, as a new process is: neither the previous job's seed nor a fixed one.
    torch.manual_seed(1234)
    after_1234 = torch.rand(3)
    assert not any(torch.equal(r, after_1234) for r in rands) and not torch.equal(*rands)


@pytest.mark.parametrize("job,reason,first", [
    (_raises_on_1, "ValueError: rank one cannot go on", "rank 1 raised ValueError: rank one cannot go on"),
    (_dies_on_1, "--- rank 1 died: exit code 3", "rank 1 died: exit code 3")])
def test_a_failed_job_reads_as_with_fresh_processes_and_its_workers_are_replaced(tmp_path, job, reason, first,
                                                                                 worker_pool):
    """The cause comes first (rank 0's "connection closed" is a consequence), then every rank's story."""
    expected = "^" + re.escape(first) + r"\nrank\(s\) \[(0, )?1\] failed\n"
    path = str(tmp_path / "out.pt")
    worker_pool.spawn(_sum_ranks, 2, args=(0, path))
    first, started = torch.load(path)["pid"], worker_pool.started
    with pytest.raises(WorkerFailed, match=expected) as pooled:
        worker_pool.spawn(job, 2)
    assert reason in str(pooled.value)
    worker_pool.spawn(_sum_ranks, 2, args=(1, path))
    assert torch.load(path)["sum"] == 3.0 and torch.load(path)["pid"] != first
    assert worker_pool.started == started + 2  # both workers of the failed job were replaced
    with pytest.raises(WorkerFailed, match=expected) as fresh:
        fresh_spawn(job, 2)
    assert reason in str(fresh.value)


def test_a_job_larger_than_the_pool_is_refused():
    with WorkerPool(2) as pool, pytest.raises(ValueError, match="a job of 3 ranks does not fit a WorkerPool of size 2"):
        pool.spawn(_sum_ranks, 3, args=(0, "unused"))


def _hangs_on_rank_1(flag: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if dist.get_rank() == 1:
        open(flag, "w").close()
        time.sleep(120)
    return F.cross_entropy(out, y)


def test_a_job_interrupted_while_a_rank_hangs_says_where_every_rank_was(tmp_path, worker_pool, monkeypatch):
    """What a test's timeout shows: the interrupt carries every rank's position (rank 0 waits in DDP's all-reduce)."""
    monkeypatch.setattr(launch, "spawn", worker_pool.spawn)
    flag = str(tmp_path / "hanging")

    def interrupt_once_rank_1_hangs() -> None:
        while not os.path.exists(flag):
            time.sleep(0.05)
        time.sleep(2.0)  # rank 0 reaches the all-reduce and its heartbeat publishes it
        os.kill(os.getpid(), signal.SIGALRM)

    def on_alarm(signum, frame):
        raise TimeoutError("the test's time is up")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    threading.Thread(target=interrupt_once_rank_1_hangs, daemon=True).start()
    work = digits()
    try:
        with pytest.raises(TimeoutError) as e:
            sw.Trainer("ddp", 2, accelerator="cpu", progress=False, timeout_s=100).fit(
                work.make_model(), work.train, functools.partial(_hangs_on_rank_1, flag), ADAMW,
                batch_size=64, max_steps=3)
    finally:
        signal.signal(signal.SIGALRM, previous)
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "where every rank is:" in notes
    assert re.search(r"rank 0: waiting in all_reduce 'ddp\.bucket0'", notes), notes
