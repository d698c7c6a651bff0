"""A logger's writes off the step: :class:`Background` hands each call to a writer thread.

A tracker's write can take tens of milliseconds (MLflow commits every batch
to its store), and while rank 0 writes, the other ranks wait for it at the
next collective. The step only puts the call in a queue; one thread per
logger makes the calls in order. The queue is flushed at the end of a run
(``finalize``), when an exception ends it (``finalize("failed")``), before a
run reference is read, and at interpreter exit. A write that fails is raised
on the step's thread at the next call, so a broken logger still stops the run.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

# Calls waiting at most: a logger slower than the steps holds the step back then instead of growing memory.
QUEUE_SIZE = 10_000
_STOP = object()
_live: weakref.WeakSet[Background] = weakref.WeakSet()


class Background:
    """``logger``'s calls made on a writer thread, in the order given (see the module doc).

    ``log_hyperparams``, ``log_metrics`` and ``log_checkpoint`` return once queued; ``finalize`` waits for every
    queued call, then finalizes the logger. ``resume`` and ``run_ref`` run on the caller's thread (after the
    queue is flushed), as does any other attribute of the logger.
    """

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self._queue: queue.Queue[Any] = queue.Queue(QUEUE_SIZE)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        _live.add(self)

    def __getattr__(self, name: str) -> Any:
        if name == "logger":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.logger, name)

    def resume(self, step: int, ref: dict[str, Any] | None) -> None:
        self.flush()
        self.logger.resume(step, ref)

    def run_ref(self) -> dict[str, Any]:
        self.flush()
        return self.logger.run_ref()  # type: ignore[no-any-return]

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._put(self.logger.log_hyperparams, dict(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._put(self.logger.log_metrics, dict(metrics), step)  # a copy: the caller may reuse its dict

    def log_checkpoint(self, path: str, step: int) -> None:
        if callable(getattr(self.logger, "log_checkpoint", None)):
            self._put(self.logger.log_checkpoint, path, step)

    def finalize(self, status: str) -> None:
        """Every queued call made, then the logger's ``finalize(status)``; the thread ends. A write that failed
        is raised here (after the logger is finalized)."""
        try:
            self.flush(stop=True)
        finally:
            self.logger.finalize(status)

    def flush(self, stop: bool = False) -> None:
        """Wait until every queued call is made (``stop``: and end the writer thread); raise a failed write."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._queue.put(_STOP if stop else None)
            self._queue.join()
            if stop:
                thread.join()
                self._thread = None
        self._raise()

    def _put(self, call: Callable[..., Any], *args: Any) -> None:
        self._raise()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._write, name=f"shardwise-logger-{type(self.logger).__name__}",
                                            daemon=True)
            self._thread.start()
        self._queue.put((call, args))

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if item is not None and self._error is None:  # after a failure, later calls are dropped
                    call, args = item
                    call(*args)
            except BaseException as e:  # raised on the step's thread at its next call
                self._error = e
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"logger {type(self.logger).__name__} failed writing: {error}") from error

    def __getstate__(self) -> dict[str, Any]:
        return {"logger": self.logger}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["logger"])  # type: ignore[misc]


@atexit.register
def _flush_at_exit() -> None:
    """A run the interpreter leaves without finalizing (an interrupted script) still writes what it queued."""
    for writer in list(_live):
        try:
            writer.flush()
        except Exception:  # the process is ending: a logger's error is not the exit's
            pass


__all__ = ["Background", "QUEUE_SIZE"]
