"""The fit's periodic checkpoints, written in the foreground or beside training (``Trainer(checkpoint_async=True)``).

A :class:`Saver` writes each checkpoint :func:`~shardwise.checkpoint.store.write` describes. In the
background, training stops only while the rank's share of the state is copied to host memory (pinned on
CUDA, the buffers kept from one save to the next: the staging memory is the rank's checkpoint share, once);
a thread of its own then writes the files, hashes them and has rank 0 write the manifest last. Its
collectives (DCP's plan exchange, the barriers, the checksums' gather) run on a gloo group created once for
it, so they never interleave with the step's on the training groups. One save at most is in flight: the next
save, the end of the fit and SIGTERM wait for it, and ``checkpoint_keep``'s pruning is the write's last act.

The saver also times what a save costs training: the time each save blocked the loop and the step times with
and without a write in flight (``FitResult.stats``).
"""
from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint.store import Pending, write
from shardwise.comm.collectives import Comm, CommStats
from shardwise.comm.topology import Topology


@dataclass(frozen=True)
class Finished:
    """A checkpoint whose write completed: the step it holds, its path, and why it was saved."""

    step: int
    path: str
    kind: str


class Stager:
    """Host copies of a rank's checkpoint state, in buffers kept from one save to the next (pinned on CUDA, so
    the copies run at the link's speed): after the first save, staging allocates nothing."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def model_nbytes(self) -> int:
        """The buffers of the model's and the optimizer's tensors (``model.*``, ``optim.*``), the run state apart:
        what :func:`shardwise.plan.staging.model_share` plans."""
        return sum(b.numel() * b.element_size() for (key, _), b in self.buffers.items()
                   if key.startswith(("model.", "optim.")))

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with every tensor (and every :class:`~shardwise.checkpoint.pieces.Pieces` view) replaced by
        its host copy."""
        from shardwise.checkpoint.pieces import Pieces  # imports DCP (seconds): only once a save is staged

        out: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, Pieces):
                out[key] = Pieces(value.shape, [(o, self._copy((key, i), v)) for i, (o, v) in enumerate(value.parts)])
            else:
                out[key] = self._copy((key, -1), value)
        if self.pin and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies have landed before training changes the tensors
        return out

    def _copy(self, slot: tuple[str, int], t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(slot)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin and t.device.type == "cuda")
            self.buffers[slot] = buf
        return buf.copy_(t.detach(), non_blocking=buf.is_pinned())


class Saver:
    """Writes the fit's checkpoints and times them, in the foreground, or in the background with ``background``.

    Every rank builds one at the same point of the run (the background's group is created here, a collective).
    """

    def __init__(self, topo: Topology, background: bool) -> None:
        self.background = background
        self.comm = topo.comm("world") if not background else _own_comm(topo)
        self.stager = Stager(pin=topo.device.type == "cuda")
        self.blocked: list[float] = []  # per save: how long the loop waited (a save in flight, staging, writing)
        self.written: list[float] = []  # per save: how long its write took
        self.steps: list[tuple[float, bool]] = []  # per step: its time, whether it started with a write in flight
        self._thread: threading.Thread | None = None
        self._outcome: tuple[Finished | None, BaseException | None] = (None, None)
        self._mark: float | None = None
        self._busy = False  # whether a write was in flight when the current step started
        self._previous_sigterm: Any = None
        self._guarded = False  # whether SIGTERM is ours (the handler before may be None: set outside Python)

    def save(self, pending: Pending, kind: str) -> list[Finished]:
        """Write ``pending`` (at once, or start its write in the background); returns the saves this call saw
        complete: this one in the foreground, the one before it (which it waited for) in the background."""
        start = time.perf_counter()
        if not self.background:
            done = [self._write(pending, kind)]
        else:
            done = self.finish()
            self._start(replace(pending, state=self.stager.stage(pending.state)), kind)
        self.blocked.append(time.perf_counter() - start)
        return done

    def finish(self) -> list[Finished]:
        """Wait for the save in flight, if any; its error, if it failed, is raised here."""
        if self._thread is None:
            return []
        self._thread.join()
        self._thread = None
        finished, error = self._outcome
        self._outcome = (None, None)
        if error is not None:
            raise error
        return [finished] if finished is not None else []

    def _start(self, pending: Pending, kind: str) -> None:
        self._guard_sigterm()
        self._thread = threading.Thread(target=self._run, args=(pending, kind), name="shardwise-checkpoint",
                                        daemon=True)  # a rank that fails must not hang its exit on a dead peer
        self._thread.start()

    def _run(self, pending: Pending, kind: str) -> None:
        try:
            self._outcome = (self._write(pending, kind), None)
        except BaseException as e:  # handed to the loop, which raises it at its next wait
            self._outcome = (None, e)

    def _write(self, pending: Pending, kind: str) -> Finished:
        start = time.perf_counter()
        path = write(pending, self.comm)
        self.written.append(time.perf_counter() - start)
        return Finished(pending.step, path, kind)

    def step_ended(self) -> None:
        """The loop finished a step (called before anything else it does after the step)."""
        if self._mark is not None:
            self.steps.append((time.perf_counter() - self._mark, self._busy))

    def step_starts(self) -> None:
        """The loop is about to start the next step (called after the step's checkpoint, validation...)."""
        self._mark = time.perf_counter()
        self._busy = self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Give SIGTERM back to the handler it had before the first save in the background."""
        if self._guarded:
            signal.signal(signal.SIGTERM, self._previous_sigterm or signal.SIG_DFL)
            self._guarded = False

    def stats(self) -> dict[str, Any]:
        """``FitResult.stats`` entries: blocked and write seconds per save, and the step times beside a write
        against the others (their ratio is the slowdown a write in flight causes; None without both)."""
        beside = [s for s, busy in self.steps if busy]
        alone = [s for s, busy in self.steps if not busy]
        with_write = statistics.median(beside) if beside else None
        without = statistics.median(alone) if alone else None
        return {"checkpoint_async": self.background, "checkpoint_blocked_s": list(self.blocked),
                "checkpoint_write_s": list(self.written), "checkpoint_staged_bytes": self.stager.nbytes,
                "checkpoint_staged_model_bytes": self.stager.model_nbytes,
                "checkpoint_steps_beside_write": len(beside), "step_time_beside_write_s": with_write,
                "step_time_without_write_s": without,
                "checkpoint_step_slowdown": with_write / without if with_write and without else None}

    def _guard_sigterm(self) -> None:
        """SIGTERM (a scheduler's preemption, torchrun stopping the job) waits for the write in flight, so the
        checkpoint it started is complete before the process ends. Only the main thread may set handlers."""
        if self._guarded or threading.current_thread() is not threading.main_thread():
            return
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._guarded = True

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._thread is not None:
            self._thread.join()
        previous = self._previous_sigterm or signal.SIG_DFL
        signal.signal(signal.SIGTERM, previous)
        self._guarded = False
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)  # the handler it had (the default: end the process) takes it now


def _own_comm(topo: Topology) -> Comm:
    """A communicator on a new gloo group of every rank: the background write's, apart from the training's
    groups (and host tensors only, also on CUDA). Its bytes are counted apart, not in the step's statistics."""
    group = dist.new_group(backend="gloo") if topo.world_size > 1 else None
    return Comm(group, CommStats(), topo.timeout, label="checkpoint")
