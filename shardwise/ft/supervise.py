"""The launcher's side: start the ranks, keep the survivors alive, decide who is live, write the ledger.

The store that holds the quorum lives here, in the launching process, so it
outlives any rank. :class:`Watch` is the only writer of the membership:

* a rank that dies by a signal (SIGKILL, the OOM killer) takes its replica
  group out: the group's other ranks are killed, and the next epoch's
  membership is written for the survivors;
* a rank that sends no heartbeat for ``timeout_s`` (a hang, SIGSTOP) is killed
  first (a stopped process must not wake up in a quorum that moved on), then
  leaves the same way;
* a rank that raises is a bug, not a fault: the job ends with its traceback,
  as without fault tolerance;
* fewer than ``min_replicas`` live groups end the job with one error naming
  the dead groups, and no rank is left behind.

The ledger (``sample_ledger=``) is written here too, one JSON line per
committed step, from what the members put in the store at commit.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise import launch
from shardwise.comm.topology import backend_for, pick_device, threads_per_rank
from shardwise.ft import keys
from shardwise.ft.options import ReplicaPlan
from shardwise.ft.quorum import Heartbeat, Quorum
from shardwise.precision import default_dtype_name

POLL_S = 0.02  # how often the launcher looks at exits, heartbeats and commits

# A rank's function: fn(rank, device, quorum, *args).
RankFn = Callable[..., Any]


class ReplicasLost(launch.WorkerFailed):
    """Fewer than ``min_replicas`` replica groups are left: the run cannot continue."""


def run_replicas(fn: RankFn, plan: ReplicaPlan, args: tuple[Any, ...] = (), accelerator: str = "cpu",
                 timeout: _dt.timedelta = _dt.timedelta(minutes=5), ledger: str | None = None) -> list[int]:
    """Run ``fn(rank, device, quorum, *args)`` in ``replicas x group_size`` fresh processes that survive the death
    of replica groups; returns the ranks that finished (exit 0). Raises :class:`ReplicasLost` below
    ``min_replicas``, :class:`shardwise.launch.WorkerFailed` when a rank raises."""
    launch.check_main_module()
    store = launch.job_store(timeout)
    store.set(keys.members(0), keys.encode(list(range(plan.replicas))))
    ctx = rank_context()
    world = plan.replicas * plan.group_size
    procs = [ctx.Process(target=_rank, name=f"shardwise-rank{r}",  # type: ignore[attr-defined]
                         args=(r, fn, plan, world, store.port, accelerator, timeout.total_seconds(), args,
                               default_dtype_name()))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        with open(ledger, "w") if ledger is not None else contextlib.nullcontext() as out:
            return Watch(procs, store, plan, out).run()
    finally:
        launch.stop_processes(procs)


def rank_context() -> BaseContext:
    """How the ranks start: fresh processes, by :func:`shardwise.launch.start_method`. A caller that keeps a fork
    server with torch imported (:attr:`shardwise.pool.WorkerPool.context`) may point this at it: the ranks are then
    still new processes, but none imports torch again."""
    return mp.get_context(launch.start_method())


def _rank(rank: int, fn: RankFn, plan: ReplicaPlan, world: int, port: int, accelerator: str, timeout_s: float,
          args: tuple[Any, ...], default_dtype: str) -> None:
    """One rank: beat, join the quorum, run ``fn``; a raised error goes to the store for the launcher."""
    launch.die_with_parent()
    torch.set_default_dtype(getattr(torch, default_dtype))
    torch.set_num_threads(threads_per_rank(world))
    lo = launch.loopback_interface()
    if lo is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = lo  # every rank is on this machine: gloo listens on loopback only
    timeout = _dt.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    beat = Heartbeat("127.0.0.1", port, rank, timeout)
    try:
        device = pick_device(accelerator, rank)
        if plan.group_size > 1:
            _join_group(store, plan, rank, device, timeout)
        quorum = Quorum(store, plan.group_of(rank), timeout, rank % plan.group_size, plan.group_size)
        fn(rank, device, quorum, *args)
    except BaseException:
        store.set(f"shardwise/error/{rank}", traceback.format_exc())
        beat.close()
        raise SystemExit(1) from None  # the traceback went to the store, where the launcher reads it
    # Done: leave at once. The interpreter's teardown would destroy reduction groups whose peers may be dead,
    # which can block without a heartbeat (seen on torch 2.13: survivors then looked hung to the launcher).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _join_group(store: dist.Store, plan: ReplicaPlan, rank: int, device: torch.device,
                timeout: _dt.timedelta) -> None:
    """This rank's replica group as the default process group: the group's strategy (its shards) runs on it as
    on a job of its own, and a dead group's sockets are no other group's."""
    group = plan.group_of(rank)
    dist.init_process_group(backend_for(device), store=dist.PrefixStore(keys.replica_group(group), store),
                            rank=rank % plan.group_size, world_size=plan.group_size, timeout=timeout)


class Watch:
    """The launcher's loop over one fault-tolerant job (see the module docstring)."""

    def __init__(self, procs: list[BaseProcess], store: dist.TCPStore, plan: ReplicaPlan,
                 ledger: TextIO | None) -> None:
        self.procs, self.store, self.plan, self.ledger = procs, store, plan, ledger
        self.members = list(range(plan.replicas))
        self.epoch = 0
        self.dead: dict[int, str] = {}  # group -> why it left
        self.killed: dict[int, str] = {}  # rank -> why the launcher killed it (no heartbeat)
        self.beats: dict[int, tuple[int, float]] = {}  # rank -> (last count seen, when it changed)
        self.next_line = 0
        self.looked = time.monotonic()  # when the heartbeats were last looked at

    def run(self) -> list[int]:
        while True:
            running = [p for p in self.procs if p.exitcode is None]
            for r, p in enumerate(self.procs):
                if p.exitcode not in (None, 0) and self.plan.group_of(r) not in self.dead:
                    self._failed(r, p.exitcode)
            self._write_ledger()
            if not running:
                break
            self._check_heartbeats()
            mp_connection.wait([p.sentinel for p in running], timeout=POLL_S)
        self._write_ledger()
        return [r for r, p in enumerate(self.procs) if p.exitcode == 0]

    def _failed(self, rank: int, code: int) -> None:
        """A rank of a live group ended badly: a fault takes its group out; an exception ends the job."""
        if code > 0 and rank not in self.killed:
            error = self.store.get(f"shardwise/error/{rank}").decode().rstrip() \
                if self.store.check([f"shardwise/error/{rank}"]) else f"exit code {code}"
            raise launch.WorkerFailed(f"rank {rank} raised {launch._error_line(error)}\n"
                                      f"--- rank {rank} raised:\n{error}")
        group = self.plan.group_of(rank)
        why = self.killed.get(rank) or f"rank {rank} {launch._exit_reason(code)}"
        for r in self.plan.ranks_of(group):
            if self.procs[r].exitcode is None:
                os.kill(self.procs[r].pid, signal.SIGKILL)  # type: ignore[arg-type]  # a group is whole or out
        self.dead[group] = why
        self.members.remove(group)
        print(f"shardwise: replica group {group} left: {why}; {len(self.members)} of {self.plan.replicas} groups "
              "continue", file=sys.stderr, flush=True)
        if len(self.members) < self.plan.ft.min_replicas:
            raise ReplicasLost(
                f"fault tolerance: {len(self.members)} replica group{'s' if len(self.members) != 1 else ''} left, "
                f"fewer than min_replicas={self.plan.ft.min_replicas}; dead: "
                + "; ".join(f"group {g} ({w})" for g, w in sorted(self.dead.items())))
        self.store.set(keys.left(group), why)  # before the membership that reads it
        self.epoch += 1
        self.store.set(keys.members(self.epoch), keys.encode(self.members))

    def _check_heartbeats(self) -> None:
        """Kill a rank of a live group whose heartbeat stopped for ``timeout_s`` (its exit then takes the group
        out). A rank is judged only once it has beaten: start-up is the collective timeout's."""
        now = time.monotonic()
        if now - self.looked > self.plan.ft.timeout_s / 2:
            # This loop itself was held up (a loaded machine): a gap in every rank's beats is then the launcher's
            # own, so each rank's silence counts from now.
            self.beats = {r: (seen, now) for r, (seen, _) in self.beats.items()}
        self.looked = now
        for r, p in enumerate(self.procs):
            if p.exitcode is not None or self.plan.group_of(r) in self.dead or r in self.killed:
                continue
            count = int(self.store.add(keys.heartbeat(r), 0))
            seen, since = self.beats.get(r, (0, now))
            if count != seen:
                self.beats[r] = (count, now)
            elif count > 0 and now - since > self.plan.ft.timeout_s:
                self.killed[r] = f"rank {r} sent no heartbeat for {self.plan.ft.timeout_s:g} s (stopped or hung) " \
                                 "and was killed"
                os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]

    def _write_ledger(self) -> None:
        """Append the lines of the steps committed since the last look, in step order."""
        while self.store.check([keys.committed(self.next_line)]):
            line = json.loads(self.store.get(keys.committed(self.next_line)))
            if self.ledger is not None:
                self.ledger.write(json.dumps({"step": self.next_line, **line}) + "\n")
                self.ledger.flush()
            self.store.delete_key(keys.committed(self.next_line))
            self.next_line += 1

