"""Rank functions for :func:`shardwise.ft.supervise.run_replicas` in tests: a module of their own, light to import
(each spawned rank imports it to find its function)."""
from __future__ import annotations

import os
import signal
import time
from typing import Any


def die_or_raise(rank: int, device: Any, quorum: Any, how: str) -> None:
    """Rank 1 dies by SIGKILL (``how="kill"``) or raises (``"raise"``); rank 0 waits to be stopped."""
    if rank == 1 and how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        raise ValueError("a bug in the step")
    time.sleep(120)
