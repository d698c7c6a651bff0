"""The run's learning-rate schedule: when it steps, and how a resumed run gets it back.

``fit(lr_scheduler=)`` is a factory called with each rank's optimizer. It returns
a scheduler, or Lightning's dict ``{"scheduler": ..., "interval": ..., "frequency":
..., "monitor": ...}``:

* ``interval="step"`` (the default; Lightning's is ``"epoch"``) steps the
  scheduler after every ``frequency``-th optimizer step, ``"epoch"`` after every
  ``frequency``-th epoch (``len(dataset) // batch_size`` steps, or the steps
  ``limit_train_batches`` leaves in one);
* a ``ReduceLROnPlateau`` steps after every validation on the metric named by
  ``monitor`` (default ``"val_loss"``), with the value every rank agreed on;
  ``interval`` does not apply to it.

Nothing of the schedule is stored in checkpoints: its state is a function of
facts they already hold, so a resumed run replays it exactly — the count of
steps (or epochs) for a per-step schedule, the validation history (kept in
every checkpoint, in float64) for ``ReduceLROnPlateau``.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

# Builds the run's learning-rate schedule from its optimizer, e.g. partial(lr_scheduler.OneCycleLR, ...).
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
KEYS = ("scheduler", "interval", "frequency", "monitor")  # Lightning's lr_scheduler dict, as far as it applies
INTERVALS = ("step", "epoch")


@dataclass(frozen=True)
class When:
    """When a schedule steps: every ``frequency`` ``interval``\\ s, or after each validation on ``monitor``
    (a ``ReduceLROnPlateau``: ``monitor`` is set)."""

    interval: str = "step"
    frequency: int = 1
    monitor: str | None = None


def unpack(made: Any) -> tuple[Any, When]:
    """A factory's product, a scheduler or Lightning's dict, as (the scheduler, when it steps); checked."""
    given = dict(made) if isinstance(made, Mapping) else {"scheduler": made}
    unknown = [k for k in given if k not in KEYS]
    if unknown or "scheduler" not in given:
        raise ValueError(f"lr_scheduler's dict takes the keys {', '.join(map(repr, KEYS))} ('scheduler' needed), "
                         f"got {', '.join(map(repr, given))}")
    sched, plateau = given["scheduler"], isinstance(given["scheduler"], ReduceLROnPlateau)
    if not plateau and not isinstance(sched, LRScheduler):
        raise TypeError(f"lr_scheduler must build a torch.optim.lr_scheduler.LRScheduler or ReduceLROnPlateau "
                        f"(or Lightning's dict holding one), got {type(sched).__name__}")
    interval, frequency = given.get("interval", "step"), given.get("frequency", 1)
    if interval not in INTERVALS:
        raise ValueError(f"lr_scheduler's interval must be 'step' or 'epoch', got {interval!r}")
    if not isinstance(frequency, int) or isinstance(frequency, bool) or frequency < 1:
        raise ValueError(f"lr_scheduler's frequency must be a positive integer, got {frequency!r}")
    monitor = given.get("monitor")
    if plateau:
        if frequency != 1:
            raise ValueError(f"lr_scheduler's frequency={frequency} does not apply to ReduceLROnPlateau: it steps "
                             "after every validation (set how often with fit(val_every=))")
        return sched, When(interval, 1, "val_loss" if monitor is None else monitor)
    if monitor is not None:
        raise ValueError(f"lr_scheduler's monitor={monitor!r} is for ReduceLROnPlateau, which steps on a validation "
                         f"metric; {type(sched).__name__} steps by the count of {interval}s")
    return sched, When(interval, frequency)


def check_schedule(when: When | None, metrics: list[str] | None, epoch_len: int | None) -> None:
    """What a run's schedule needs of it (``when`` None: no schedule): its monitored metric and its epoch."""
    if when is not None:
        check_monitor(when, metrics)
        check_epochs(when, epoch_len)


def check_monitor(when: When, metrics: list[str] | None) -> None:
    """A ReduceLROnPlateau's metric is one validation computes (``metrics``; None: the run does not validate)."""
    if when.monitor is None:
        return
    if metrics is None:
        raise ValueError(f"lr_scheduler ReduceLROnPlateau steps on a validation metric (monitor={when.monitor!r}): "
                         "pass val_dataset= (and val_every= to validate during training)")
    if when.monitor not in metrics:
        raise ValueError(f"lr_scheduler's monitor names {when.monitor!r}, which validation does not compute; it "
                         f"computes {', '.join(metrics)}")


def check_epochs(when: When, epoch_len: int | None) -> None:
    """A per-epoch schedule needs the epoch's length."""
    if when.interval == "epoch" and when.monitor is None and epoch_len is None:
        raise ValueError("lr_scheduler's interval='epoch' needs the epoch's length, and the dataset has no __len__: "
                         "give it one (its samples per pass), or step the schedule per optimizer step")


class Schedule:
    """The schedule of one rank: built from the factory, replayed to where a resumed run stands, then stepped."""

    def __init__(self, factory: SchedulerFactory, opt: torch.optim.Optimizer, epoch_len: int | None) -> None:
        self.scheduler, self.when = unpack(factory(opt))
        unit = (epoch_len or 1) if self.when.interval == "epoch" else 1
        self.every = unit * self.when.frequency  # optimizer steps between two steps of a per-step schedule

    @property
    def monitor(self) -> str | None:
        return self.when.monitor

    def restore(self, done: int, history: list[dict[str, float]]) -> None:
        """Where the uninterrupted run's schedule stood after ``done`` steps: that many steps of it replayed, or
        for ReduceLROnPlateau every validation of the history (``done`` steps' worth), in order."""
        if self.monitor is None:
            quiet_steps(self.scheduler, done // self.every)
            return
        for h in history:
            if h["step"] <= done and self.monitor in h:
                self.validated(h[self.monitor])

    def stepped(self, done: int) -> None:
        """After optimizer step ``done`` (1-based), a skipped one included: the schedule's step when it is due."""
        if self.monitor is None and done % self.every == 0:
            quiet_steps(self.scheduler, 1)

    def validated(self, value: float) -> None:
        """After a validation: ReduceLROnPlateau's step on the monitored value (every rank passes the same)."""
        if self.monitor is not None:
            self.scheduler.step(value)


def quiet_steps(sched: Any, steps: int) -> None:
    """``steps`` steps of the schedule. torch warns when the first one comes before an optimizer step;
    here that is meant (a replay on resume, or a step skipped for an fp16 overflow is a step all the same)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
        for _ in range(steps):
            sched.step()


__all__ = ["Schedule", "SchedulerFactory", "When", "check_epochs", "check_monitor", "unpack"]
