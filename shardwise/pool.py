"""A pool of rank processes kept alive across many short jobs (test suites, notebooks).

:func:`shardwise.launch.spawn` starts fresh processes for every job; each of
them imports torch (and, for a Hugging Face model, transformers) before the
first line of training runs, which costs seconds per rank on a small machine.
A :class:`WorkerPool` pays that once: its workers wait for jobs, and each job
gets a fresh rendezvous store, a fresh process group, this process's
environment and working directory, and a new random seed, so ``fn`` runs
as it would in a fresh process. A failed job retires every worker it used
(its peers may be stuck in a collective or hold half-finished state); the next
job starts new ones.

Errors read exactly as with fresh processes: both paths share
:func:`shardwise.launch.supervise` (every rank's traceback, how a silent death
ended, where each rank was).
"""
from __future__ import annotations

import datetime as _dt
import gc
import os
import pickle
import sys
import threading
from collections.abc import Callable
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection
from multiprocessing.reduction import (
    ForkingPickler,  # torch.multiprocessing registers its tensor reductions here
)
from typing import Any

import torch
import torch.multiprocessing as mp

from shardwise import launch
from shardwise.precision import default_dtype_name


def _serve(conn: Connection, lifeline: Connection) -> None:
    """A pooled worker: run one rank of each job it is sent, until told to stop, or until the process that made
    the pool ends (``lifeline`` then reads end-of-file)."""
    launch.die_with_parent()
    _die_with_owner(lifeline)
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:  # the pool's owner is gone
            return
        if not message:
            return
        header, payload = pickle.loads(message)
        os.environ.clear()
        os.environ.update(header["env"])
        os.chdir(header["cwd"])
        sys.path[:] = header["path"]  # the caller's, as a spawned process gets it: its modules import here too
        torch.seed()  # a fresh process starts from a random seed too (torch >= 2.12), never the last job's
        torch.set_default_dtype(getattr(torch, header["default_dtype"]))  # the caller's, as launch.spawn passes it
        torch.set_grad_enabled(True)
        ok = launch.run_rank(header["rank"], _Unpickled(payload), header["world"], header["port"],
                             header["accelerator"], header["timeout_s"], ())
        # The job's cyclic garbage (its model, its process group) is freed before the next job. Then
        # everything that survived is frozen out of later collections: a full collection scans every
        # object alive, and with torch and transformers imported that took 175 ms per job and rank; after
        # a freeze it scans only what the next job creates. (A survivor that later turns into cyclic
        # garbage would stay: modules, caches and the pool's own state, which live as long as the worker.)
        gc.collect()
        gc.freeze()
        conn.send_bytes(b"1" if ok else b"0")


def _die_with_owner(lifeline: Connection) -> None:
    """End this worker the moment the pool's owner ends, whatever killed it (SIGKILL included).

    The worker's parent is multiprocessing's fork server, not the owner, and the fork server outlives a killed
    owner as long as any of its workers lives: without this, the kept ranks of a SIGKILLed script would keep
    training and writing checkpoints. Only the owner holds the other end of ``lifeline``, so end-of-file there means
    it is gone; a daemon thread waits for it."""
    def watch() -> None:
        try:
            while True:
                lifeline.recv_bytes()
        except (EOFError, OSError):
            os._exit(1)

    threading.Thread(target=watch, name="shardwise-owner-watch", daemon=True).start()


class _Unpickled:
    """Unpickles ``(fn, args)`` inside the rank, so an import error is reported like any other error."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __call__(self, rank: int, device: torch.device) -> None:
        fn, args = pickle.loads(self.payload)
        fn(rank, device, *args)


class _Worker:
    def __init__(self, ctx: Any, index: int) -> None:
        self.conn, child = ctx.Pipe()
        # The worker reads its end of the lifeline; this process alone holds the writing end (_die_with_owner).
        lifeline, self.lifeline = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_serve, args=(child, lifeline), name=f"shardwise-pool{index}")
        self.proc.start()
        child.close()
        lifeline.close()

    def alive(self) -> bool:
        return self.proc.exitcode is None


class _PooledRank:
    """One rank of one job on a pooled worker, seen as :func:`launch.supervise` sees a process."""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.result: int | None = None

    @property
    def exitcode(self) -> int | None:
        if self.result is None and self.worker.conn.poll():
            try:
                self.result = 0 if self.worker.conn.recv_bytes() == b"1" else 1
            except (EOFError, OSError):
                pass
        if self.result is not None:
            return self.result
        return self.worker.proc.exitcode  # type: ignore[no-any-return]

    @property
    def sentinel(self) -> Any:
        return self.worker.conn if self.result is None and self.worker.proc.exitcode is None else \
            self.worker.proc.sentinel


def _retire(workers: list[_Worker | None], indices: range, ask_first: bool = False) -> None:
    """Stop the workers at ``indices`` and forget them; ``ask_first``: let idle ones leave their loop."""
    leaving = [w for i in indices if (w := workers[i]) is not None]
    if ask_first:
        for w in leaving:
            if w.alive():
                try:
                    w.conn.send_bytes(b"")  # asks the worker to leave its loop
                except OSError:
                    pass
        for w in leaving:
            w.proc.join(5)
    launch.stop_processes([w.proc for w in leaving])  # whoever did not leave: stuck in a job
    for i in indices:
        w = workers[i]
        if w is not None:
            w.conn.close()
            w.lifeline.close()
            workers[i] = None


def _stop_all(workers: list[_Worker | None]) -> None:
    _retire(workers, range(len(workers)), ask_first=True)


# What the pool's fork server imports once, before it forks each worker: torch, its distributed package and
# dynamo (which the first optimizer a rank builds imports, about 1 s) and the rank's side of shardwise.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "shardwise.pool", "shardwise.fit.trainer")


class WorkerPool:
    """Up to ``size`` rank processes, started when first needed and reused by every later job.

    ``pool.spawn`` has the signature and the failure reporting of
    :func:`shardwise.launch.spawn`; a job of ``n`` ranks runs on workers
    ``0..n-1``. Not for jobs that must start from a clean interpreter (a module
    global a job changes stays changed for the next job on that worker).

    Workers are forked from a fork server that imported ``preload`` once
    (``multiprocessing``'s "forkserver" start method, where the platform has
    it; "spawn" elsewhere): a worker that replaces a retired one starts in a
    fraction of a second instead of importing torch again. The fork server is
    a clean process that imports modules and runs nothing else, so nothing
    CUDA or thread-related is inherited.
    """

    def __init__(self, size: int = 8, preload: tuple[str, ...] = PRELOAD) -> None:
        if size < 1:
            raise ValueError(f"WorkerPool needs size >= 1, got {size}")
        self.size = size
        if "forkserver" in mp.get_all_start_methods():
            self._ctx = mp.get_context("forkserver")
            self._ctx.set_forkserver_preload(list(preload))
        else:
            self._ctx = mp.get_context("spawn")  # type: ignore[assignment]
        self._workers: list[_Worker | None] = [None] * size
        self.started = 0  # processes started over the pool's life (for tests and reports)
        # Workers are not daemons (a rank may start DataLoader workers of its own), so they must be
        # stopped before multiprocessing joins its children at exit, or that join waits forever.
        mp_util.Finalize(self, _stop_all, args=(self._workers,), exitpriority=10)

    @property
    def context(self) -> Any:
        """How the workers start (the fork server, where the platform has one), for jobs that start processes of
        their own and may see them killed, such as a fault-tolerant run's ranks: each is a new process, forked
        with ``preload`` already imported."""
        return self._ctx

    def _worker(self, index: int) -> _Worker:
        w = self._workers[index]
        if w is None or not w.alive():
            _retire(self._workers, range(index, index + 1))
            w = self._workers[index] = _Worker(self._ctx, index)
            self.started += 1
        return w

    def spawn(self, fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), accelerator: str = "cpu",
              timeout: _dt.timedelta = _dt.timedelta(minutes=5), grace_s: float = 2.0) -> None:
        """Run ``fn(rank, device, *args)`` on ``nprocs`` pooled workers inside one fresh process group."""
        if nprocs > self.size:
            raise ValueError(f"a job of {nprocs} ranks does not fit a WorkerPool of size {self.size}")
        launch.check_main_module()
        store = launch.job_store(timeout)
        job = {"world": nprocs, "port": store.port, "accelerator": accelerator,
               "timeout_s": timeout.total_seconds(), "env": dict(os.environ), "cwd": os.getcwd(),
               "path": list(sys.path), "default_dtype": default_dtype_name()}
        ranks = []
        for r in range(nprocs):
            w = self._worker(r)
            # torch's pickler, once per rank, as each spawned Process's arguments get: a tensor
            # shared through a file descriptor can be received once only.
            payload = bytes(ForkingPickler.dumps((fn, args)))
            w.conn.send_bytes(pickle.dumps(({**job, "rank": r}, payload)))
            ranks.append(_PooledRank(w))
        ok = False
        try:
            launch.supervise(ranks, store, grace_s, timeout.total_seconds())
            ok = True
        finally:
            if not ok:  # failed, timed out or interrupted: none of these workers is trusted again
                _retire(self._workers, range(nprocs))

    def close(self) -> None:
        """Stop every worker (they also exit on their own when this process goes away)."""
        _stop_all(self._workers)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KeptRanks:
    """The rank processes one owner (a :class:`~shardwise.Trainer`) keeps between its calls.

    A script that calls ``fit``, then ``validate``, ``test`` or ``predict``, starts its ranks once: the first call
    starts a :class:`WorkerPool` of its size, and every later call of as many ranks or fewer runs on the same
    processes, each in a fresh process group. A call that needs more ranks replaces the pool; a failed call
    retires the workers it used, as in any pool. Where ranks are forked from the calling process (a notebook,
    stdin: :func:`shardwise.launch.start_method`), they see its objects only as they are at that call, so each
    call starts fresh ones. The workers stop when :meth:`close` is called, when the owner is garbage-collected,
    or at exit.
    """

    def __init__(self) -> None:
        self._pool: WorkerPool | None = None

    def spawn(self, fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), accelerator: str = "cpu",
              timeout: _dt.timedelta = _dt.timedelta(minutes=5)) -> None:
        """Run ``fn(rank, device, *args)`` on ``nprocs`` ranks, as :func:`shardwise.launch.spawn` does."""
        if launch.start_method() != "spawn":
            launch.spawn(fn, nprocs, args, accelerator, timeout)
            return
        if self._pool is None or self._pool.size < nprocs:
            self.close()
            self._pool = WorkerPool(nprocs)
        self._pool.spawn(fn, nprocs, args, accelerator, timeout)

    def close(self) -> None:
        """Stop the kept processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
