"""The Trainer's options as one frozen value: what every rank of a fit needs to know about the run.

``Trainer(...)`` validates its arguments into a :class:`FitOptions` (the checks
below are the Trainer's, in one place); the rank job (:class:`~shardwise.fit.job.Job`)
carries this value into every process, not the Trainer object. The strategy's
:class:`~shardwise.layout.RunLayout` for the device count is part of it, so
every rank builds the same :class:`~shardwise.comm.topology.Topology`.
"""
from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise import launch
from shardwise import precision as precision_mod
from shardwise.data import loader_options
from shardwise.fit.callbacks import check_callbacks
from shardwise.layout import RunLayout
from shardwise.strategies.base import Strategy
from shardwise.strategies.registry import resolve

# Builds the run's learning-rate schedule from its optimizer, e.g. partial(lr_scheduler.OneCycleLR, ...).
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass(frozen=True)
class FitOptions:
    """Every option of :class:`~shardwise.fit.trainer.Trainer`, validated (see its docstring for each)."""

    strategy: Strategy
    devices: int
    layout: RunLayout
    accelerator: str
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    seed: int
    progress: bool | str
    metrics_path: str | None
    timeout: _dt.timedelta
    checkpoint_dir: str | None
    checkpoint_every: int | None
    checkpoint_keep: int | None
    resume: bool
    debug: bool
    on_nonfinite: str
    memory_check: str
    device_memory: int | None
    precision: str
    activation_checkpointing: bool | tuple[type[nn.Module], ...]
    tensorboard_dir: str | None
    peak_flops: float | None
    max_processes_per_core: int | None
    sync_batchnorm: bool
    callbacks: tuple[Any, ...]
    dataloader_kwargs: dict[str, Any]

    @property
    def sizes(self) -> dict[str, int]:
        """``{"pp", "dp", "tp"}`` of the run (see :meth:`shardwise.dims.ParallelDims.sizes`)."""
        return self.layout.dims.sizes()

    @classmethod
    def build(cls, strategy: str | Strategy = "single", devices: int | str = "auto", accelerator: str = "auto", *,
              accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None, seed: int = 0,
              progress: bool | str = "auto", metrics_path: str | os.PathLike[str] | None = None,
              timeout_s: float = 300.0, checkpoint_dir: str | os.PathLike[str] | None = None,
              checkpoint_every: int | None = None, resume: bool = True, debug: bool = False,
              on_nonfinite: str = "error", checkpoint_keep: int | None = 3, memory_check: str = "error",
              device_memory: int | None = None, precision: str = "32",
              activation_checkpointing: bool | tuple[type[nn.Module], ...] = False,
              tensorboard_dir: str | os.PathLike[str] | None = None, peak_flops: float | None = None,
              max_processes_per_core: int | None = 8, sync_batchnorm: bool = False,
              callbacks: list[Any] | None = None, dataloader_kwargs: dict[str, Any] | None = None) -> FitOptions:
        """The Trainer's arguments, checked (a ValueError names the first one that is wrong)."""
        strat = resolve(strategy)
        callbacks = check_callbacks(callbacks)
        dataloader_kwargs = dict(dataloader_kwargs or {})
        loader_options(dataloader_kwargs)  # an unknown or refused option fails here
        if accelerator not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown accelerator {accelerator!r}; valid: 'auto', 'cpu', 'cuda'")
        if max_processes_per_core is not None and max_processes_per_core < 1:
            raise ValueError(f"max_processes_per_core must be >= 1 (or None for no bound), "
                             f"got {max_processes_per_core}")
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every was given without checkpoint_dir: say where checkpoints go")
        if checkpoint_keep is not None and checkpoint_keep < 1:
            raise ValueError(f"checkpoint_keep must be >= 1 (or None to keep all), got {checkpoint_keep}")
        if memory_check not in ("error", "warn", "off"):
            raise ValueError(f"memory_check must be 'error', 'warn' or 'off', got {memory_check!r}")
        precision = precision_mod.check(precision)
        if on_nonfinite not in ("error", "skip"):
            raise ValueError(f"on_nonfinite must be 'error' or 'skip', got {on_nonfinite!r}")
        if devices == "auto":
            devices = auto_devices(strat, accelerator)
        elif not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise ValueError(f"devices must be a positive integer or 'auto', got {devices!r}")
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}")
        return cls(strategy=strat, devices=devices, layout=strat.layout(devices), accelerator=accelerator,
                   accumulate_grad_batches=accumulate_grad_batches, gradient_clip_val=gradient_clip_val, seed=seed,
                   progress=progress, metrics_path=str(metrics_path) if metrics_path is not None else None,
                   timeout=_dt.timedelta(seconds=timeout_s),
                   checkpoint_dir=os.fspath(checkpoint_dir) if checkpoint_dir is not None else None,
                   checkpoint_every=checkpoint_every, checkpoint_keep=checkpoint_keep, resume=resume, debug=debug,
                   on_nonfinite=on_nonfinite, memory_check=memory_check, device_memory=device_memory,
                   precision=precision, activation_checkpointing=activation_checkpointing,
                   tensorboard_dir=os.fspath(tensorboard_dir) if tensorboard_dir is not None else None,
                   peak_flops=peak_flops, max_processes_per_core=max_processes_per_core,
                   sync_batchnorm=sync_batchnorm, callbacks=tuple(callbacks), dataloader_kwargs=dataloader_kwargs)


def auto_devices(strategy: Strategy, accelerator: str) -> int:
    """What ``devices="auto"`` means for this strategy (see :class:`~shardwise.fit.trainer.Trainer`)."""
    if launch.under_torchrun():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return next((d for d in range(1, world + 1) if strategy.processes(d) == world), world)
    cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
    first = torch.cuda.device_count() if cuda else 1
    for d in [first, *range(1, 65)]:
        try:
            strategy.layout(d)
        except ValueError:
            continue
        return d
    return first


__all__ = ["FitOptions", "SchedulerFactory", "auto_devices"]
