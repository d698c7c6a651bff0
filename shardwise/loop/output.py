"""What a hand-written loop records and shows: ``sw.log`` through its loggers, and output from rank 0.

* ``sw.setup(..., logger=...)`` (a name, a logger of :mod:`shardwise.loggers` or a list of them, as the
  Trainer's ``logger=``): :func:`shardwise.log` anywhere in the loop records its value, and each
  ``optimizer.step()`` of the optimizer ``sw.setup`` returned ends a row: the values reduced over the ranks as
  the Trainer reduces them (:class:`shardwise.loggers.scalars.Reducer`; every rank steps its optimizer, so every rank
  joins), written by rank 0 as ``train/<name>`` at step ``k`` for the ``k``-th step (counted from 0, as the
  Trainer's rows). Names the Trainer's row holds (``loss``, ...) are free here: the row holds only yours.
  ``sw.save`` keeps where each logger's run is and ``sw.load`` reopens it (a file drops the rows an
  interrupted attempt wrote past the checkpoint); :func:`end_training` writes what was logged after the last
  step and closes the runs.
* :func:`is_main_process`, :func:`print` (rank 0 only) and :func:`main_process_first` (rank 0 runs the block
  first, the other ranks after it: a download or a preprocessing cache made once).
"""
from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist

from shardwise.comm.topology import Topology
from shardwise.loggers import FAILED, SUCCESS, Resumable, keys
from shardwise.loggers.scalars import Reducer, Scalars, recording
from shardwise.loop.state import rng_state, set_rng_state


@contextlib.contextmanager
def _rngs_untouched() -> Iterator[None]:
    """A logger's library may draw from the global RNGs (MLflow names a new run with Python's ``random``): the
    loop's draws must not depend on whether it logs."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


class LoopLog:
    """The rows of one prepared model's loop: ``sw.log``'s values of each optimizer step, reduced over the
    ranks, through rank 0's loggers (opened at their first row). Without loggers (the same on every rank) a
    step's values are dropped, with no collective."""

    def __init__(self, loggers: list[Any], topo: Topology, hyper: Mapping[str, Any]) -> None:
        self._scalars = Scalars(reserved=())
        self._reducer = Reducer(topo)
        self._writes = bool(loggers)
        self._loggers = dict(zip(keys(loggers), loggers)) if topo.rank == 0 else {}
        self._hyper = dict(hyper)
        self._opened = False
        self._refs: dict[str, Any] = {}
        self.step = 0  # the row the next optimizer step writes
        self._recording = contextlib.ExitStack()
        self._recording.enter_context(recording(self._scalars))

    def row(self) -> None:
        """End the step: every rank's values reduced (a collective), rank 0 writes them at this step."""
        values = self._reducer.reduce(self._scalars) if self._writes else {}
        self._scalars.clear()
        if values and self._loggers:
            with _rngs_untouched():
                self._open()
                for lg in self._loggers.values():
                    lg.log_metrics({f"train/{k}": v for k, v in values.items()}, self.step)
        self.step += 1

    def refs(self) -> dict[str, Any]:
        """Where each logger's run is (rank 0; opened first, so that a tracker's run has its id)."""
        if self._loggers:
            with _rngs_untouched():
                self._open()
        return {k: lg.run_ref() for k, lg in self._loggers.items() if isinstance(lg, Resumable)}

    def resume(self, step: int, refs: dict[str, Any]) -> None:
        """Continue after ``step`` steps in the runs ``refs`` names (a checkpoint's)."""
        self.step, self._refs = step, refs
        if self._opened:  # rows were written before the load: the runs are open, nothing to reopen
            return
        for key, lg in self._loggers.items():
            if isinstance(lg, Resumable) and step > 0:
                lg.resume(step, refs.get(key))

    def _open(self) -> None:
        if not self._opened:
            self._opened = True
            for lg in self._loggers.values():
                lg.log_hyperparams(self._hyper)

    def close(self, failed: bool = False) -> None:
        """Stop recording and finish each logger's run (idempotent)."""
        self._recording.close()
        loggers, self._loggers, self._writes = self._loggers, {}, False
        if self._opened:
            with _rngs_untouched():
                for lg in loggers.values():
                    lg.finalize(FAILED if failed else SUCCESS)


def is_main_process() -> bool:
    """Whether this process is rank 0 of the run (True without a process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print(*args: Any, **kwargs: Any) -> None:  # noqa: A001 - Accelerate's name, as sw.print
    """The built-in ``print`` on rank 0 only (flushed, so that a launcher's interleaved output keeps order)."""
    if is_main_process():
        builtins.print(*args, **{"flush": True, **kwargs})


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block first; the other ranks wait for it (a barrier of the world) and run it after, at
    the same time: a dataset downloaded or a cache written once, then read by every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    main = dist.get_rank() == 0
    if not main:
        dist.barrier()
    try:
        yield
    finally:
        if main:
            dist.barrier()


__all__ = ["LoopLog", "is_main_process", "main_process_first", "print"]
