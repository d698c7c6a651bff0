"""The ``sw.*`` functions a hand-written loop calls on the model ``sw.setup`` returned: clipping, ``sw.save`` and
``sw.load`` (the Trainer's layout-free checkpoints, with what a resume needs: :mod:`shardwise.loop.state`),
``sw.no_sync``. Each takes that model (:class:`~shardwise.loop.prepared.Prepared`) and asks its strategy.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from shardwise.checkpoint import store as checkpoint
from shardwise.loop.prepared import as_prepared
from shardwise.optim.param_groups import apply_hyper


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of a model from :func:`setup` to ``max_norm`` under any strategy (every
    shard and tensor-parallel slice counted once); returns the norm before clipping, as torch's does."""
    return as_prepared(model).clip_grad_norm_(max_norm)


def clip_grad_value_(model: nn.Module, clip_value: float) -> None:
    """Clamp every gradient of a model from :func:`setup` to ``[-clip_value, clip_value]`` under any strategy
    (each rank clamps the reduced pieces it steps: torch's clamp of the averaged gradients)."""
    as_prepared(model).clip_grad_value_(clip_value)


def save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | os.PathLike[str], step: int,
         losses: list[float] | None = None, keep: int | None = None) -> str:
    """Write the layout-free checkpoint of step ``step`` under ``directory`` (``step_<N>``; a collective), the
    format the Trainer writes: any strategy and device count can :func:`load` it, and a Trainer can resume from
    it. ``losses``: the loss of each step so far, if the loop kept them (NaN otherwise). Returns its path.

    Beside the model and optimizer it keeps what a resume needs (:mod:`shardwise.loop.state`): the objects
    :func:`register_for_checkpointing` names (schedulers, your own), the position of each loader
    ``sw.prepare_dataloader`` made for this model, every rank's RNGs, the fp16 loss scaler, and where each
    logger's run is."""
    m = as_prepared(model)
    history = list(losses) if losses is not None else [float("nan")] * step
    if len(history) != step:
        raise ValueError(f"losses has {len(history)} entries for step={step}: one per step taken")
    state, shared, own = m.kept.capture(m.topo.rank)
    extra = {**({"scaler": m.scaled.scaler.as_tensor()} if m.scaled is not None else {}), **shared}
    refs = m.log.refs() if m.log is not None else None
    return checkpoint.save(os.fspath(directory), step, history, m.strategy, m.module, optimizer, m.topo,
                           m.shapes, keep=keep, aliases=m.aliases, extra=extra, loggers=refs, loop=state, own=own)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike[str]) -> int:
    """Restore model and optimizer in place from a checkpoint (a ``step_<N>`` directory, or the newest intact
    one under a checkpoint directory), written under any layout; returns its step (a collective). What
    :func:`save` kept beside them comes back too: the registered objects, the prepared loaders' positions,
    every rank's RNGs, the loss scaler, and the loggers' runs (continued after the checkpoint's step)."""
    m = as_prepared(model)
    p = os.fspath(path)
    if not os.path.exists(os.path.join(p, checkpoint.MANIFEST)):
        newest = checkpoint.latest_valid(p)
        if newest is None:
            raise FileNotFoundError(f"no intact checkpoint under {p}")
        p = newest
    restored = checkpoint.load(p, m.strategy, m.module, optimizer, m.topo, m.shapes)
    if restored.groups:  # each group's lr and settings as saved (torch's load_state_dict does the same)
        apply_hyper(optimizer, restored.groups)
    if m.scaled is not None and "scaler" in restored.extra:
        m.scaled.scaler.load_tensor(restored.extra["scaler"])
    m.kept.restore(p, restored.loop, restored.extra, restored.own, m.topo.rank)
    if m.log is not None:
        m.log.resume(restored.step, restored.loggers)
    return restored.step


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without communication (for all but the last micro-batch of a step)."""
    m = as_prepared(model)
    with m.strategy.no_sync(m.module):
        yield


__all__ = ["clip_grad_norm_", "clip_grad_value_", "load", "no_sync", "save"]
