"""On one machine a job listens on loopback only, read from the kernel's socket table."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from conftest import section

from shardwise import launch

pytestmark = pytest.mark.timeout(120)

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def listening(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, hex local address) of every listening TCP socket the processes ``pids`` hold."""
    inodes: dict[str, int] = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN
                    out.append((inodes[cols[9]], cols[1].split(":")[0]))
    return out


def _inspect(rank, device, out, host):
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is formed and its connections are up
    pids = torch.tensor([os.getpid()])
    everyone = [torch.zeros_like(pids) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, pids)
    if rank == 0:
        job = [int(p) for p in everyone] + [host]  # the ranks and the process hosting the store
        found = listening(job)
        with open(out, "w") as f:
            f.write("\n".join(f"{pid} {addr}" for pid, addr in found))
    dist.barrier()


@pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads the socket table from /proc")
def test_a_two_rank_job_listens_on_nothing_but_loopback(tmp_path):
    # launch.spawn's ranks: the session's pool (the same run_rank joins the group, and this process hosts the
    # job's store, as for fresh ranks), or fresh processes with SHARDWISE_TEST_POOL=0.
    out = str(tmp_path / "listening.txt")
    launch.spawn(_inspect, 2, args=(out, os.getpid()))
    rows = [line.split() for line in open(out).read().splitlines()]
    assert len(rows) >= 2  # the store, and gloo's listening sockets: really looked at
    assert [r for r in rows if r[1] not in LOOPBACK] == []


@pytest.mark.fresh_processes
@pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads the socket table from /proc")
def test_shardwise_run_on_one_machine_listens_on_nothing_but_loopback(under_run):
    # tests/scripts/listening_probe.py in the session's shared `shardwise run --nproc 2` (tests/conftest.py).
    r, _ = under_run
    text = section(r, "tests/scripts/listening_probe.py")
    rows = [line.split()[1:] for line in text.splitlines() if line.startswith("LISTEN ")]
    assert len(rows) >= 3  # the launcher's stores and the ranks' gloo sockets: really looked at
    assert [row for row in rows if row[1] not in LOOPBACK] == []
