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
import json
import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.diagnostics import CollectiveTimeout, Diagnostics, Record


def _quiet_deprecation(start: Callable[[], Any]) -> Callable[[], Any]:
    """``start`` with torch 2.13's deprecation warning of the *_tensor collectives silenced for that call only.

    2.13 prefers *_single names that torch 2.11 (the GPU machines' version)
    does not have; we keep the names both have, without a process-wide filter.
    """
    def run() -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).* is "
                                    "deprecated", category=FutureWarning)
            return start()
    return run


@dataclass
class CommStats:
    """Bytes sent and received by this rank, total and per operation name."""

    sent: int = 0
    received: int = 0
    calls: int = 0
    by_name: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_group: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Events that are not bytes but belong beside them (tokens an expert layer dispatched or dropped).
    counters: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # With ``timing`` on (a profiler's window), seconds per name as by_name groups them: from issue until the
    # wait completed ("in_flight", overlapping compute for an async op) and blocked inside the wait ("waited").
    timing: bool = False
    in_flight: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    waited: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def count(self, name: str, n: int) -> None:
        self.counters[name] += int(n)

    def add(self, name: str, sent: int, received: int, group: str = "world") -> None:
        self.sent += sent
        self.received += received
        self.calls += 1
        # Group per-call names like "ddp.bucket3" under their prefix "ddp".
        self.by_name[name.split(".", 1)[0]] += sent
        # And by the mesh group it crossed ("dp", "tp", "pp", "dp_shard", ...): what the planner predicts.
        self.by_group[group] += sent

    def timed(self, name: str, in_flight: float, waited: float) -> None:
        key = name.split(".", 1)[0]
        self.in_flight[key] += in_flight
        self.waited[key] += waited

    def snapshot(self) -> dict[str, Any]:
        return {"sent": self.sent, "received": self.received, "calls": self.calls, "by_name": dict(self.by_name),
                "by_group": dict(self.by_group), "counters": dict(self.counters)}

    def reset(self) -> None:
        self.sent = self.received = self.calls = 0
        self.by_name = defaultdict(int)
        self.by_group = defaultdict(int)
        self.counters = defaultdict(int)
        self.in_flight = defaultdict(float)
        self.waited = defaultdict(float)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# What gloo and NCCL say when the other end of a connection went away.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed")


class Handle:
    """An in-flight operation; :meth:`wait` enforces the timeout and explains a failure."""

    def __init__(self, work: Any, name: str, timeout: _dt.timedelta, diag: Diagnostics | None = None,
                 rec: Record | None = None, timed: tuple[CommStats, float] | None = None) -> None:
        self._work = work
        self.name = name
        self._timeout = timeout
        self._diag = diag
        self._rec = rec
        self._timed = timed  # (the stats to add its times to, when it was issued): only while timing is on

    def wait(self) -> None:
        if self._work is None:
            return
        if self._diag is not None and self._rec is not None:
            self._diag.wait_on(self._rec)
        start = time.monotonic()
        try:
            self._work.wait(self._timeout)
        except RuntimeError as e:  # gloo and NCCL raise RuntimeError on timeout, abort or a dead peer
            what = self._rec.describe() if self._rec is not None else f"'{self.name}'"
            rank = self._rec.rank if self._rec is not None else "?"
            detail = self._diag.explain(self._rec) if (self._diag and self._rec) else ""
            cause = str(e).splitlines()[0] if str(e) else type(e).__name__
            waited = time.monotonic() - start
            # A closed connection is a peer that died, seconds in: not a timeout, and it must not read as one.
            if any(m in cause for m in _LOST_PEER):
                head = f"rank {rank}: {what} lost its connection to a peer after {waited:.1f} s (the peer died?)"
            else:
                head = f"rank {rank}: {what} did not complete within {self._timeout}"
            raise CollectiveTimeout(f"{head} ({cause})\n{detail}") from e
        self._work = None
        if self._timed is not None:
            stats, issued = self._timed
            done = time.monotonic()
            stats.timed(self.name, done - issued, done - start)
        if self._diag is not None and self._rec is not None:
            self._diag.end(self._rec)

    def poll(self) -> bool:
        """Whether the operation has finished (then finished as by :meth:`wait`); never blocks."""
        if self._work is not None and not self._work.is_completed():
            return False
        self.wait()
        return True


class Comm:
    """Collectives on one process group, with names, byte counts, a timeout and diagnostics.

    ``group=None`` means the default (world) group. A world size of 1 turns
    every collective into a no-op that sends zero bytes, so single-device code
    runs the same path. ``label`` names the group in diagnostics ("dp", "tp").
    """

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats,
                 timeout: _dt.timedelta = _dt.timedelta(minutes=5), diag: Diagnostics | None = None,
                 label: str = "world") -> None:
        self.group = group
        self.stats = stats
        self.timeout = timeout
        self.diag = diag
        self.label = label
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.ranks = dist.get_process_group_ranks(group) if (dist.is_initialized() and group is not None) \
            else list(range(self.size))

    # ---- helpers -----------------------------------------------------
    def global_rank(self, group_rank: int) -> int:
        """The world rank of ``group_rank`` in this communicator's group."""
        return self.ranks[group_rank]

    def _issue(self, op: str, name: str, tensors: list[torch.Tensor], start: Callable[[], Any],
               async_op: bool, ranks: list[int] | None = None) -> Handle | None:
        rec = None
        if self.diag is not None:
            rec = self.diag.begin(op, name, self.label, ranks or self.ranks, [list(t.shape) for t in tensors])
        timed = (self.stats, time.monotonic()) if self.stats.timing else None  # one flag test when off
        h = Handle(start(), name, self.timeout, self.diag, rec, timed)
        if async_op:
            return h
        h.wait()
        return None

    def _noop(self, name: str, async_op: bool) -> Handle | None:
        return Handle(None, name, self.timeout) if async_op else None

    # ---- collectives -------------------------------------------------
    def all_reduce(self, t: torch.Tensor, name: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = False) -> Handle | None:
        if self.size == 1:
            return self._noop(name, async_op)
        n, s = self.size, _nbytes(t)
        self.stats.add(name, 2 * (n - 1) * s // n, 2 * (n - 1) * s // n, self.label)
        return self._issue("all_reduce", name, [t],
                           lambda: dist.all_reduce(t, op=op, group=self.group, async_op=True), async_op)

    def broadcast(self, t: torch.Tensor, src: int, name: str, async_op: bool = False) -> Handle | None:
        """Broadcast from group rank ``src``."""
        if self.size == 1:
            return self._noop(name, async_op)
        s = _nbytes(t)
        self.stats.add(name, s if self.rank == src else 0, 0 if self.rank == src else s, self.label)
        return self._issue("broadcast", name, [t], lambda: dist.broadcast(
            t, src=self.global_rank(src), group=self.group, async_op=True), async_op)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, name: str, async_op: bool = False) -> Handle | None:
        """Concatenate every rank's ``shard`` (equal sizes) into ``out`` along dim 0."""
        if self.size == 1:
            out.copy_(shard.reshape(out.shape))
            return self._noop(name, async_op)
        s = _nbytes(shard)
        self.stats.add(name, (self.size - 1) * s, (self.size - 1) * s, self.label)
        return self._issue("all_gather", name, [shard], _quiet_deprecation(lambda: dist.all_gather_into_tensor(
            out, shard, group=self.group, async_op=True)), async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, name: str,
                       op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False) -> Handle | None:
        """Reduce ``full`` over ranks and leave rank r's 1/N slice in ``out``."""
        if self.size == 1:
            out.copy_(full.reshape(out.shape))
            return self._noop(name, async_op)
        s = _nbytes(out)
        self.stats.add(name, (self.size - 1) * s, (self.size - 1) * s, self.label)
        return self._issue("reduce_scatter", name, [full], _quiet_deprecation(lambda: dist.reduce_scatter_tensor(
            out, full, op=op, group=self.group, async_op=True)), async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, name: str, async_op: bool = False) -> Handle | None:
        """Rank r's i-th equal slice of ``inp`` along dim 0 becomes rank i's r-th slice of ``out``.

        Each rank keeps 1/n of its tensor and sends the rest: (n-1)/n of its bytes out, as many in.
        """
        if self.size == 1:
            out.copy_(inp)
            return self._noop(name, async_op)
        s = _nbytes(inp) * (self.size - 1) // self.size
        self.stats.add(name, s, s, self.label)
        return self._issue("all_to_all", name, [inp], lambda: dist.all_to_all_single(
            out, inp, group=self.group, async_op=True), async_op)

    def all_to_all_v(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                     name: str) -> None:
        """Rows ``in_splits[i]`` of ``inp`` (in rank order along dim 0) go to rank i; ``out`` gets
        ``out_splits[j]`` rows from rank j. Counted exactly: only the rows that leave this rank are sent."""
        if self.size == 1:
            out.copy_(inp)
            return
        row = inp.element_size() * math.prod(inp.shape[1:])  # bytes of one row (token)
        me = self.rank
        sent = row * (sum(in_splits) - in_splits[me])
        received = row * (sum(out_splits) - out_splits[me])
        self.stats.add(name, sent, received, self.label)
        self._issue("all_to_all", name, [inp], lambda: dist.all_to_all_single(
            out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group,
            async_op=True), False)

    def isend(self, t: torch.Tensor, dst: int, name: str, tag: int = 0) -> Handle:
        """Send to group rank ``dst`` (exact bytes); wait on the handle. Messages between two ranks are matched
        in order per ``tag`` (gloo keeps one ordered channel per tag; NCCL ignores tags: one channel)."""
        self.stats.add(name, _nbytes(t), 0, self.label)
        peer = self.global_rank(dst)
        h = self._issue("send", name, [t], lambda: dist.isend(t, dst=peer, group=self.group, tag=tag), True,
                        ranks=[self.global_rank(self.rank), peer])
        assert h is not None
        return h

    def irecv(self, t: torch.Tensor, src: int, name: str, tag: int = 0) -> Handle:
        """Receive from group rank ``src`` (exact bytes); wait on the handle. ``tag``: as in :meth:`isend`."""
        self.stats.add(name, 0, _nbytes(t), self.label)
        peer = self.global_rank(src)
        h = self._issue("recv", name, [t], lambda: dist.irecv(t, src=peer, group=self.group, tag=tag), True,
                        ranks=[self.global_rank(self.rank), peer])
        assert h is not None
        return h

    def send(self, t: torch.Tensor, dst: int, name: str) -> None:
        self.isend(t, dst, name).wait()

    def recv(self, t: torch.Tensor, src: int, name: str) -> None:
        self.irecv(t, src, name).wait()

    def all_gather_object(self, obj: Any, name: str) -> list[Any]:
        """Small JSON values (metadata checks, stats, a checkpoint's path) from every rank; not training traffic.

        Exchanged as JSON text in byte tensors, never as pickles: unpickling
        what another process sends runs whatever that process put in it, and
        a rank must not trust more than the data. Tuples come back as lists,
        also with one process (the same values on every path).
        """
        data = json.dumps(obj).encode()
        if self.size == 1:
            return [json.loads(data)]
        rec = self.diag.begin("all_gather_object", name, self.label, self.ranks, []) if self.diag else None
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        dist.all_gather(sizes, n, group=self.group)
        longest = max(int(k) for k in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(self.size)]
        dist.all_gather(parts, mine.to(dev), group=self.group)
        if self.diag is not None and rec is not None:
            self.diag.end(rec)
        return [json.loads(bytes(p[:int(k)].cpu().numpy())) for p, k in zip(parts, sizes)]

    def barrier(self, name: str = "barrier") -> None:
        if self.size > 1:
            self._issue("barrier", name, [], lambda: dist.barrier(group=self.group, async_op=True), False)
