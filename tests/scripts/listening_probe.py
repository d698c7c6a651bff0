"""Under `shardwise run`: rank 0 lists the listening sockets of every rank and of the launcher (their parent)."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "system"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # conftest, which it imports
from test_listening import listening  # noqa: E402

if __name__ == "__main__":
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is formed and its connections are up
    pids = torch.tensor([os.getpid()])
    everyone = [torch.zeros_like(pids) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, pids)
    if dist.get_rank() == 0:
        for pid, addr in listening([int(p) for p in everyone] + [os.getppid()]):
            print(f"LISTEN {pid} {addr}")
    dist.barrier()
    dist.destroy_process_group()
