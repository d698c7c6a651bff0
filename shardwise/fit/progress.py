"""What rank 0 shows and records while a run trains: the progress bar and the per-step metrics log.

Separate from the fit loop (:mod:`shardwise.fit.steps`) because neither takes
part in the optimisation: they only read the loss, the step time and the
process's memory.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from shardwise.fit.options import FitOptions
from shardwise.loggers import SUCCESS, Logger, Resumable, keys
from shardwise.loggers.background import Background
from shardwise.stats import cuda_peak_bytes, current_rss_bytes, peak_rss_bytes


def batch_tokens(x: Any) -> int:
    """Tokens in this rank's batch when the input is integer token ids (B, T); 0 otherwise."""
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point():
        return x.numel()
    return 0


def total_numel(shapes: dict[str, list[int]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def logged_step(step: int, last: int, every: int) -> bool:
    """Whether step ``step`` is logged: every ``every``-th (``log_every_n_steps``, counting from 1), and the
    ``last``. Every rank can ask (the ranks reduce ``sw.log``'s values only for the steps that are logged)."""
    return (step + 1) % every == 0 or step == last


class StepLog:
    """Per-step metrics of rank 0, written through the run's loggers (:mod:`shardwise.loggers`).

    Opening it opens each logger's run: a resumed run (``start`` > 0) first hands each logger what the
    checkpoint kept of its run (``refs``), then every logger gets the run's hyperparameters. Each logger writes
    on a thread of its own (:class:`~shardwise.loggers.background.Background`): the step does not wait for it.
    """

    def __init__(self, loggers: Sequence[Logger], peak_flops: float | None, params: int, devices: int,
                 start: int = 0, refs: dict[str, dict[str, Any]] | None = None,
                 hyper: dict[str, Any] | None = None, samples: int = 0,
                 device: torch.device | None = None) -> None:
        self._loggers = dict(zip(keys(list(loggers)), loggers))
        for key, lg in self._loggers.items():
            if start > 0 and isinstance(lg, Resumable):
                lg.resume(start, (refs or {}).get(key))
        self._loggers = {k: Background(lg) for k, lg in self._loggers.items()}
        for lg in self._loggers.values():
            lg.log_hyperparams(hyper or {})
        self._peak = peak_flops * devices if peak_flops else None
        self._params = params
        self._samples = samples  # the global batch: samples_per_s
        self._device = device  # its peak memory (CUDA), beside the process's peak resident memory

    def refs(self) -> dict[str, dict[str, Any]]:
        """Where each logger's run is (its ``run_ref()``), by logger key: for checkpoints and the result."""
        return {k: lg.run_ref() for k, lg in self._loggers.items() if isinstance(lg.logger, Resumable)}  # type: ignore[attr-defined]

    def write(self, step: int, loss: float | None, dt: float, tokens: int, extra: dict[str, Any] | None = None) -> None:
        """One step's scalars, ``train/<name>``: the loss, step time, samples (and tokens) per second, the
        process's resident and peak resident memory (and the device's peak on CUDA); ``extra`` adds the step's
        others (``lr/<group>``, ``grad_norm``, ``clipped``, ``comm_bytes/<group>``, ``sw.log``'s)."""
        row: dict[str, Any] = {"loss": loss, "step_time_s": dt, "rss_bytes": current_rss_bytes(),
                               "peak_rss_bytes": peak_rss_bytes(), **(extra or {})}
        if self._device is not None:
            row.update(cuda_peak_bytes(self._device))  # since the run started (the stats' peak too); CUDA only
        if self._samples and dt > 0:
            row["samples_per_s"] = self._samples / dt
        if tokens and dt > 0:
            row["tokens_per_s"] = tokens / dt
            if self._peak:
                row["mfu"] = 6.0 * self._params * tokens / dt / self._peak
        self._log({f"train/{k}": v for k, v in row.items() if v is not None}, step)

    def write_validation(self, step: int, metrics: dict[str, float]) -> None:
        """Global validation metrics, ``val/<name>``, evaluated on the weights after step ``step`` (the index of
        that step's own row); what :func:`shardwise.log` logged during validation comes named ``val/<name>``
        already."""
        self._log({k if k.startswith("val/") else f"val/{k}": v for k, v in metrics.items()}, step)

    def checkpoint(self, path: str, step: int) -> None:
        """A complete checkpoint after ``step`` steps: the loggers that keep artifacts (``log_checkpoint``) get it."""
        for lg in self._loggers.values():
            lg.log_checkpoint(path, step)  # type: ignore[attr-defined]

    def close(self, status: str = SUCCESS) -> None:
        """Every logger's queued writes made and its run finalized (each, even when one fails; the first failure
        is raised)."""
        errors = []
        for lg in self._loggers.values():
            try:
                lg.finalize(status)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _log(self, metrics: dict[str, Any], step: int) -> None:
        for lg in self._loggers.values():
            lg.log_metrics(metrics, step)


def hyperparameters(options: FitOptions, info: dict[str, Any], max_steps: int) -> dict[str, Any]:
    """What the loggers record about a run: strategy, sizes, global batch, precision, the optimizer and each
    of its groups' hyperparameters (and size), seed, steps (``info``: the run record of checkpoints)."""
    optimizer = info.get("optimizer", {})
    groups = [{**g["hyper"], "params": len(g["params"])} for g in optimizer.get("groups", [])]
    return {"strategy": options.strategy.name, "devices": options.devices, "processes": options.layout.processes,
            "sizes": options.sizes, "batch_size": info.get("batch_size"),
            "accumulate_grad_batches": options.accumulate_grad_batches, "precision": options.precision,
            "optimizer": {"class": optimizer.get("class"), "groups": groups}, "seed": options.seed,
            "max_steps": max_steps, "gradient_clip_val": options.gradient_clip_val,
            **({"config": options.config} if options.config else {})}


def want_progress(progress: bool | str) -> str | bool:
    """What to show: ``"bar"`` (rich, on a terminal), ``"lines"`` (plain text lines, for logs and pipes) or
    False. ``"auto"`` and True pick by whether stderr is a terminal."""
    if progress is False or progress == "off":
        return False
    if progress in ("bar", "lines"):
        return progress
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


__all__ = ["StepLog", "batch_tokens", "hyperparameters", "progress_bar", "total_numel", "want_progress"]
