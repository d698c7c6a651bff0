"""Thin wrappers over c10d collectives.

Every strategy issues its communication through a :class:`Comm` bound to one
process group. The wrapper adds three things c10d does not give us:

* a name per call (``"ddp.bucket3"``), so that stats and diagnostics say *what*
  was being communicated, not just which primitive;
* byte accounting per rank and per name. Point-to-point bytes are exact. For
  the backend's own collectives we cannot see the wire, so we count what the
  bandwidth-optimal ring algorithm sends (the "bus bandwidth" factors that
  nccl-tests documents): all-reduce 2(N-1)/N x S, all-gather and
  reduce-scatter (N-1)/N x S of the full tensor, broadcast S from the root;
* a timeout on every wait, so a missing peer surfaces as an error that names
  the operation instead of an indefinite hang.

Only APIs present in both torch 2.11 and 2.13 are used.
"""
from __future__ import annotations

import datetime as _dt
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes sent and received by this rank, total and per operation name."""

    sent: int = 0
    received: int = 0
    calls: int = 0
    by_name: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, name: str, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received
        self.calls += 1
        # Group per-call names like "ddp.bucket3" under their prefix "ddp".
        self.by_name[name.split(".", 1)[0]] += sent

    def snapshot(self) -> dict[str, Any]:
        return {"sent": self.sent, "received": self.received, "calls": self.calls, "by_name": dict(self.by_name)}

    def reset(self) -> None:
        self.sent = self.received = self.calls = 0
        self.by_name = defaultdict(int)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Handle:
    """An in-flight operation; :meth:`wait` enforces the communicator's timeout."""

    def __init__(self, work: Any, name: str, timeout: _dt.timedelta) -> None:
        self._work = work
        self.name = name
        self._timeout = timeout

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            self._work.wait(self._timeout)
        except RuntimeError as e:  # gloo and NCCL both raise RuntimeError on timeout/abort
            raise RuntimeError(f"collective '{self.name}' failed or timed out after {self._timeout}: {e}") from e
        self._work = None


class Comm:
    """Collectives on one process group, with names, byte counts and a timeout.

    ``group=None`` means the default (world) group. A world size of 1 turns
    every collective into a no-op that sends zero bytes, so single-device code
    runs the same path.
    """

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats,
                 timeout: _dt.timedelta = _dt.timedelta(minutes=5)) -> None:
        self.group = group
        self.stats = stats
        self.timeout = timeout
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    # ---- helpers -----------------------------------------------------
    def global_rank(self, group_rank: int) -> int:
        """The world rank of ``group_rank`` in this communicator's group."""
        if self.group is None or not dist.is_initialized():
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _done(self, work: Any, name: str, async_op: bool) -> Handle | None:
        h = Handle(work, name, self.timeout)
        if async_op:
            return h
        h.wait()
        return None

    # ---- collectives -------------------------------------------------
    def all_reduce(self, t: torch.Tensor, name: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = False) -> Handle | None:
        if self.size == 1:
            return Handle(None, name, self.timeout) if async_op else None
        n, s = self.size, _nbytes(t)
        self.stats.add(name, 2 * (n - 1) * s // n, 2 * (n - 1) * s // n)
        return self._done(dist.all_reduce(t, op=op, group=self.group, async_op=True), name, async_op)

    def broadcast(self, t: torch.Tensor, src: int, name: str, async_op: bool = False) -> Handle | None:
        """Broadcast from group rank ``src``."""
        if self.size == 1:
            return Handle(None, name, self.timeout) if async_op else None
        s = _nbytes(t)
        self.stats.add(name, s if self.rank == src else 0, 0 if self.rank == src else s)
        work = dist.broadcast(t, src=self.global_rank(src), group=self.group, async_op=True)
        return self._done(work, name, async_op)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, name: str, async_op: bool = False) -> Handle | None:
        """Concatenate every rank's ``shard`` (equal sizes) into ``out`` along dim 0."""
        if self.size == 1:
            out.copy_(shard.reshape(out.shape))
            return Handle(None, name, self.timeout) if async_op else None
        s = _nbytes(shard)
        self.stats.add(name, (self.size - 1) * s, (self.size - 1) * s)
        work = dist.all_gather_into_tensor(out, shard, group=self.group, async_op=True)
        return self._done(work, name, async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, name: str,
                       op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False) -> Handle | None:
        """Reduce ``full`` over ranks and leave rank r's 1/N slice in ``out``."""
        if self.size == 1:
            out.copy_(full.reshape(out.shape))
            return Handle(None, name, self.timeout) if async_op else None
        s = _nbytes(out)
        self.stats.add(name, (self.size - 1) * s, (self.size - 1) * s)
        work = dist.reduce_scatter_tensor(out, full, op=op, group=self.group, async_op=True)
        return self._done(work, name, async_op)

    def send(self, t: torch.Tensor, dst: int, name: str) -> None:
        """Blocking send to group rank ``dst`` (exact bytes)."""
        self.stats.add(name, _nbytes(t), 0)
        dist.send(t, dst=self.global_rank(dst), group=self.group)

    def recv(self, t: torch.Tensor, src: int, name: str) -> None:
        """Blocking receive from group rank ``src`` (exact bytes)."""
        self.stats.add(name, 0, _nbytes(t))
        dist.recv(t, src=self.global_rank(src), group=self.group)

    def isend(self, t: torch.Tensor, dst: int, name: str) -> Handle:
        self.stats.add(name, _nbytes(t), 0)
        return Handle(dist.isend(t, dst=self.global_rank(dst), group=self.group), name, self.timeout)

    def irecv(self, t: torch.Tensor, src: int, name: str) -> Handle:
        self.stats.add(name, 0, _nbytes(t))
        return Handle(dist.irecv(t, src=self.global_rank(src), group=self.group), name, self.timeout)

    def all_gather_object(self, obj: Any, name: str) -> list[Any]:
        """Small Python objects (metadata checks, stats); not counted as training traffic."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self, name: str = "barrier") -> None:
        if self.size > 1:
            dist.barrier(group=self.group)
