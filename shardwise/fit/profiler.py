"""Where a step's time goes: ``Trainer(profiler="simple" | "pytorch", profile_steps=...)``.

``"simple"`` cuts each profiled step of every rank into contiguous parts,
timed on the host (after a device synchronisation on CUDA, so the time is the
device's): ``data`` (the batch, read and moved), ``forward`` (the model's
outermost calls and the loss; a forward that activation checkpointing re-runs
in backward is backward's), ``backward`` (the rest of the forward-backward
pass: for a pipeline also the waits for the neighbouring stages),
``optimizer`` (clipping, the step, zeroing the gradients) and ``other``
(agreement checks, the schedule, logging, callbacks, validation and checkpoints).
Beside them, each collective by name (as :class:`~shardwise.comm.CommStats`
groups names) with the bytes the counter adds in the window and the time the
comm layer measured: ``in_flight_s`` from issue until its wait completed
(overlapping compute when it runs asynchronously) and ``waited_s`` blocked in
that wait. Collective times happen inside the parts and are not added to them.
Rank 0 prints one table for every rank at the end, and ``FitResult.profile``
holds each rank's figures (plain data).

``"pytorch"`` records the window with :mod:`torch.profiler` and writes one
Chrome trace per rank, ``<profiler_dir>/rank<r>.json`` (open it in Perfetto,
https://ui.perfetto.dev), each step a ``shardwise.step#<n>`` range.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.comm.collectives import CommStats
from shardwise.step import LossFn
from shardwise.torch_private import in_backward

PROFILERS = ("simple", "pytorch")
PARTS = ("data", "forward", "backward", "optimizer", "other")


def window(kind: str, steps: tuple[int, int] | None, max_steps: int) -> tuple[int, int]:
    """The steps ``[start, stop)`` to profile: those asked for, else every step for ``"simple"`` and steps 1
    and 2 for ``"pytorch"`` (a trace of the first step shows its one-off costs), within the run."""
    if steps is None:
        steps = (0, max_steps) if kind == "simple" or max_steps < 3 else (1, 3)
    return steps[0], min(steps[1], max_steps)


class Profiler:
    """No profiling: every call does nothing (``profiler=None``). A context manager: leaving the block (at the
    end of the loop, or on an error) stops it, removes its hooks and keeps its figures in :attr:`figures`."""

    figures: dict[str, Any] | None = None

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.figures = self.close()

    def step_start(self, step: int) -> None: ...

    def mark(self, part: str) -> None: ...

    def compute(self) -> None: ...

    def step_end(self, step: int) -> None: ...

    def loss(self, fn: LossFn) -> LossFn:
        return fn

    def close(self) -> dict[str, Any] | None:
        """Stop, and return this rank's figures (None when nothing was profiled)."""
        return None


def make(kind: str | None, steps: tuple[int, int] | None, max_steps: int, stats: CommStats,
         device: torch.device, directory: str, rank: int) -> Profiler:
    if kind == "simple":
        return Simple(window(kind, steps, max_steps), stats, device)
    if kind == "pytorch":
        return Trace(window(kind, steps, max_steps), device, directory, rank)
    return Profiler()


class _ForwardClock:
    """Seconds inside forward passes: from entering the outermost module call (or loss call) to leaving it.

    Global module hooks, installed for the profiled steps only. Calls made inside a backward pass (activation
    checkpointing's recompute) are not counted: they are backward's time.
    """

    def __init__(self, sync: Callable[[], None]) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._since = 0.0
        self._sync = sync
        self._handles: list[Any] = []

    def enter(self, *_: Any) -> None:
        if in_backward():
            return
        if self._depth == 0:
            self._sync()
            self._since = time.perf_counter()
        self._depth += 1

    def leave(self, *_: Any) -> None:
        if in_backward():
            return
        self._depth -= 1
        if self._depth == 0:
            self._sync()
            self.seconds += time.perf_counter() - self._since

    def install(self) -> None:
        self._handles = [nn.modules.module.register_module_forward_pre_hook(self.enter),
                         nn.modules.module.register_module_forward_hook(self.leave, always_call=True)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class Simple(Profiler):
    """``profiler="simple"``: contiguous parts of each step in ``window``, and the collectives beside them."""

    def __init__(self, steps: tuple[int, int], stats: CommStats, device: torch.device) -> None:
        self.steps = steps
        self.stats = stats
        self._sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" \
            else (lambda: None)
        self.forward = _ForwardClock(self._sync)
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.total = 0.0
        self.count = 0
        self.first = steps[0]  # the first step profiled (a resumed run starts later)
        self._on = False
        self._start = self._last = 0.0
        self._before: dict[str, Any] | None = None  # the counters when the window opened
        self._after: dict[str, Any] = {}  # and when it closed

    def step_start(self, step: int) -> None:
        self._on = self.steps[0] <= step < self.steps[1]
        if not self._on:
            return
        if self._before is None:
            self.first = step
            self._open()
        self._sync()
        self._start = self._last = time.perf_counter()

    def _open(self) -> None:
        self._before = {"bytes": dict(self.stats.by_name), "in_flight": dict(self.stats.in_flight),
                        "waited": dict(self.stats.waited)}
        self.stats.timing = True
        self.forward.install()

    def mark(self, part: str) -> None:
        """The time since the previous mark was ``part``'s."""
        if self._on:
            self._sync()
            now = time.perf_counter()
            self.parts[part] += now - self._last
            self._last = now
            if part == "data":
                self.forward.take()  # a forward run before the step (a validation's) is not this step's

    def compute(self) -> None:
        """The forward-backward pass since the previous mark: its forward calls' time, and backward the rest."""
        if self._on:
            self._sync()
            now = time.perf_counter()
            span, fwd = now - self._last, self.forward.take()
            self.parts["forward"] += min(fwd, span)
            self.parts["backward"] += span - min(fwd, span)
            self._last = now

    def step_end(self, step: int) -> None:
        if not self._on:
            return
        self.mark("other")
        self.total += self._last - self._start
        self.count += 1
        self._on = False
        if step == self.steps[1] - 1:
            self._shut()

    def loss(self, fn: LossFn) -> LossFn:
        clock = self.forward

        def timed(out: Any, target: Any) -> torch.Tensor:
            clock.enter()
            try:
                return fn(out, target)
            finally:
                clock.leave()
        return timed

    def _shut(self) -> None:
        if self.stats.timing and self._before is not None:
            self.stats.timing = False
            self.forward.remove()
            self._after = {"bytes": dict(self.stats.by_name), "in_flight": dict(self.stats.in_flight),
                           "waited": dict(self.stats.waited)}

    def close(self) -> dict[str, Any] | None:
        self._shut()
        if self._before is None:
            return None
        return {"profiler": "simple", "steps": [self.first, self.first + self.count], "profiled_steps": self.count,
                "step_s": self.total, "parts_s": dict(self.parts),
                "collectives": collectives(self._before, self._after)}


def collectives(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per collective name, what the window added: bytes sent, seconds in flight, seconds waited."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(set(after["bytes"]) | set(after["in_flight"])):
        row = {"bytes": after["bytes"].get(name, 0) - before["bytes"].get(name, 0),
               "in_flight_s": after["in_flight"].get(name, 0.0) - before["in_flight"].get(name, 0.0),
               "waited_s": after["waited"].get(name, 0.0) - before["waited"].get(name, 0.0)}
        if row["bytes"] or row["in_flight_s"]:
            out[name] = row
    return out


class Trace(Profiler):
    """``profiler="pytorch"``: a torch.profiler Chrome trace of the steps in ``window``, one file per rank."""

    def __init__(self, steps: tuple[int, int], device: torch.device, directory: str, rank: int) -> None:
        self.steps = steps
        self.path = os.path.join(directory, f"rank{rank}.json")
        self._activities = [torch.profiler.ProfilerActivity.CPU] + \
            ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof: torch.profiler.profile | None = None
        self._range: Any = None
        self._written = False

    def step_start(self, step: int) -> None:
        if not self.steps[0] <= step < self.steps[1]:
            return
        if self._prof is None:
            self._prof = torch.profiler.profile(activities=self._activities)
            self._prof.start()
        self._range = torch.profiler.record_function(f"shardwise.step#{step}")
        self._range.__enter__()

    def step_end(self, step: int) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if step == self.steps[1] - 1:
            self._write()

    def _write(self) -> None:
        if self._prof is None or self._written:
            return
        self._prof.stop()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._prof.export_chrome_trace(self.path)
        self._written = True

    def close(self) -> dict[str, Any] | None:
        if self._range is not None:  # the run ended inside a step (an error): close its range
            self._range.__exit__(None, None, None)
            self._range = None
        self._write()
        return {"profiler": "pytorch", "steps": list(self.steps), "trace": self.path} if self._written else None


def table(profiles: list[dict[str, Any] | None]) -> str:
    """What rank 0 prints for ``"simple"``: each rank's parts per step, then its collectives per step."""
    first = next(p for p in profiles if p)
    n = max(1, first["profiled_steps"])
    lines = [f"shardwise profiler: {first['profiled_steps']} steps ({first['steps'][0]}..{first['steps'][1] - 1}), "
             f"mean per step, ms",
             f"{'rank':>4} {'step':>9}" + "".join(f" {p:>9}" for p in PARTS)]
    for r, p in enumerate(profiles):
        if p:
            lines.append(f"{r:>4} {1e3 * p['step_s'] / n:9.2f}" + "".join(f" {1e3 * p['parts_s'][k] / n:9.2f}"
                                                                          for k in PARTS))
    lines.append(f"{'rank':>4} {'collective':<20} {'waited':>9} {'in flight':>9} {'sent':>12}")
    for r, p in enumerate(profiles):
        for name, c in (p or {}).get("collectives", {}).items():
            lines.append(f"{r:>4} {name:<20} {1e3 * c['waited_s'] / n:9.2f} {1e3 * c['in_flight_s'] / n:9.2f} "
                         f"{_size(c['bytes'] / n):>12}")
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


__all__ = ["PARTS", "PROFILERS", "Profiler", "Simple", "Trace", "make", "table", "window"]
