"""What rank 0 shows and records while a run trains: the progress bar and the per-step metrics log.

Separate from the fit loop (:mod:`shardwise.fit.steps`) because neither takes
part in the optimisation: they only read the loss, the step time and the
process's memory.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import warnings
from typing import Any

import torch

from shardwise.extras import message
from shardwise.stats import current_rss_bytes


def batch_tokens(x: Any) -> int:
    """Tokens in this rank's batch when the input is integer token ids (B, T); 0 otherwise."""
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point():
        return x.numel()
    return 0


def total_numel(shapes: dict[str, list[int]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


class StepLog:
    """Per-step metrics of rank 0: a JSONL file and/or TensorBoard scalars."""

    def __init__(self, path: str | None, tensorboard_dir: str | None, peak_flops: float | None, params: int,
                 devices: int, start: int = 0) -> None:
        self._file = None
        if path:
            # A resumed run (``start`` > 0) keeps the rows of the steps before it and drops any an
            # interrupted attempt wrote past its checkpoint (they are trained again).
            kept: list[str] = []
            if start > 0 and os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line).get("step", -1) < start]
            self._file = open(path, "w")
            self._file.writelines(kept)
        self._tb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(tensorboard_dir)
            except ImportError:
                warnings.warn(f"{message('Trainer(tensorboard_dir=)', 'tensorboard')}; logging to the JSONL file only",
                              stacklevel=2)
        self._peak = peak_flops * devices if peak_flops else None
        self._params = params

    def write(self, step: int, loss: float | None, dt: float, tokens: int, extra: dict[str, Any] | None = None) -> None:
        """One row: ``extra`` adds the step's other scalars (``lr/<group>``, ``grad_norm``, ``clipped``,
        ``comm_bytes/<group>``, and what :func:`shardwise.log` logged)."""
        row: dict[str, Any] = {"step": step, "loss": loss, "step_time_s": dt, "rss_bytes": current_rss_bytes(),
                               **(extra or {})}
        if tokens and dt > 0:
            row["tokens_per_s"] = tokens / dt
            if self._peak:
                row["mfu"] = 6.0 * self._params * tokens / dt / self._peak
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and v is not None:
                    self._tb.add_scalar(f"train/{k}", float(v), step)

    def write_validation(self, step: int, metrics: dict[str, float]) -> None:
        """One row of global validation metrics, evaluated on the weights after step ``step`` (the index of that
        step's own row); TensorBoard scalars ``val/<name>``."""
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():  # sw.log's validation values are named val/<name> already
                self._tb.add_scalar(k if k.startswith("val/") else f"val/{k}", v, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def want_progress(progress: bool | str) -> str | bool:
    """What to show: ``"bar"`` (rich, on a terminal), ``"lines"`` (plain text lines, for logs and pipes) or
    False. ``"auto"`` and True pick by whether stderr is a terminal."""
    if progress is False or progress == "off":
        return False
    if progress in ("bar", "lines"):
        return progress  # type: ignore[return-value]
    return "bar" if sys.stderr.isatty() else "lines"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class _Lines:
    """Plain progress lines on stderr: every tenth of the run, at most every ``every_s`` seconds apart
    otherwise, and the last step. A log file or a CI console reads them; a bar would stay silent there."""

    def __init__(self, total: int, every_s: float = 30.0) -> None:
        self.total, self.every_s = total, every_s
        self.done = 0
        self.stride = max(1, total // 10)
        self.start = self.last = time.perf_counter()

    def skip(self, n: int) -> None:
        self.done += n
        self.first = self.done  # a resumed run's ETA counts only the steps it trains

    def __call__(self, loss: float | None, dt: float) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.done % self.stride and self.done != self.total and now - self.last < self.every_s:
            return
        self.last = now
        elapsed = now - self.start
        trained = self.done - getattr(self, "first", 0)
        eta = elapsed / trained * (self.total - self.done) if trained else 0.0
        print(f"shardwise: step {self.done}/{self.total} ({100 * self.done // max(1, self.total)}%), loss "
              f"{'-' if loss is None else f'{loss:.4f}'}, {1e3 * dt:.1f} ms/step, RSS "
              f"{current_rss_bytes() / 2**20:.0f} MiB, elapsed {_clock(elapsed)}, ETA {_clock(eta)}",
              file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress_bar(enabled: bool | str, total: int) -> Any:
    """Yield ``advance(loss, step_time)`` (with ``.skip(n)``): a rich bar (``"bar"`` or True), plain lines
    (``"lines"``), or a no-op (False)."""
    if not enabled:
        def nothing(loss: float | None, dt: float) -> None:
            return None
        nothing.skip = lambda n: None  # type: ignore[attr-defined]
        yield nothing
        return
    if enabled == "lines":
        yield _Lines(total)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} steps/s"),
                  TextColumn("RSS {task.fields[mem]}"),
                  TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task("train", total=total, loss="-", rate="-", mem="-")

        def advance(loss: float | None, dt: float) -> None:
            bar.update(task, advance=1, loss="-" if loss is None else f"{loss:.4f}",
                       rate=f"{1.0 / dt:.1f}" if dt > 0 else "-", mem=f"{current_rss_bytes() / 2**20:.0f} MiB")

        advance.skip = lambda n: bar.update(task, advance=n)  # type: ignore[attr-defined]
        yield advance


__all__ = ["StepLog", "batch_tokens", "progress_bar", "total_numel", "want_progress"]
