"""Starting and joining process groups: spawned workers, torchrun, or one process.

From a plain ``python script.py`` the trainer spawns its workers here. The
parent process hosts the rendezvous store on an OS-chosen loopback port, so
there is no free-port race and nothing listens beyond this machine. Under
torchrun (``shardwise run``), :func:`init` joins the group torchrun describes.
"""
from __future__ import annotations

import datetime as _dt
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.topology import backend_for, pick_device, threads_per_rank


def under_torchrun() -> bool:
    """True when torchrun (or another launcher using its variables) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init(accelerator: str = "auto", timeout: _dt.timedelta = _dt.timedelta(minutes=5)) -> torch.device:
    """Join the process group torchrun describes (idempotent); returns this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(accelerator, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized() and under_torchrun():
        dist.init_process_group(backend_for(device), timeout=timeout)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return device


def _worker(rank: int, fn: Callable[..., Any], world: int, port: int, accelerator: str,
            timeout_s: float, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads_per_rank(world))
    device = pick_device(accelerator, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = _dt.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False, timeout=timeout)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        fn(rank, device, *args)
    finally:
        # Barrier then destroy; on an error path the barrier may fail, which
        # must not hide the original exception.
        try:
            dist.barrier()
        except Exception:  # pragma: no cover
            pass
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), accelerator: str = "cpu",
          timeout: _dt.timedelta = _dt.timedelta(minutes=5)) -> None:
    """Run ``fn(rank, device, *args)`` in ``nprocs`` fresh processes inside one process group.

    An exception on any rank is re-raised here with that rank's traceback
    (torch.multiprocessing terminates the other ranks).
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timeout)
    mp.start_processes(_worker, args=(fn, nprocs, store.port, accelerator, timeout.total_seconds(), args),
                       nprocs=nprocs, join=True, start_method="spawn")
    del store


def result_dir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="shardwise-")
