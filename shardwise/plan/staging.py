"""Host memory a save in the background stages (``Trainer(checkpoint_async=True)``), rank by rank.

A background save copies the rank's share of the checkpoint into host buffers kept for the whole fit
(:class:`shardwise.checkpoint.background.Stager`): exactly the tensors the rank writes
(:meth:`~shardwise.strategies.base.Strategy.checkpoint_held`), so the count follows the same rules as
:mod:`shardwise.plan.states`, on the same meta copy of the model:

* a parameter held whole (DDP, ZeRO-1/2, frozen under FSDP) is staged whole; under FSDP/ZeRO-3 a rank stages
  the real elements of its row of each trainable parameter, ``min(c, numel - place * c)`` of ``c = ceil(numel /
  n)``: the padding is not written;
* the optimizer's tensor states (``k`` per element) follow the parameter's piece (ZeRO-1/2: the rank's piece
  of the whole parameter), and its scalar states (AdamW's ``step``) are staged once per trainable parameter;
* persistent buffers are whole on every rank (under a pipeline an upper bound: a stage holds its own);
* the run state beside them (``trainer.step``, the RNG state, one float64 loss per step done) is the last
  line, counted for the fit's last save.

The validation history and the fp16 scaler are run state too (a few bytes) and not planned.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardwise.layout import RunLayout
from shardwise.plan.memory import STAGING
from shardwise.plan.states import (
    NotModelled,
    Param,
    held_elements,
    local_chunks,
    meta_copy,
    optimizer_states,
    per_rank,
    stepped_probe,
    zero_stage,
)
from shardwise.step import first_named


def scalar_state_bytes(optimizer: torch.optim.Optimizer | str) -> int:
    """Bytes of the optimizer's 0-dimensional states per parameter (AdamW's ``step``: one float32), by stepping a
    copy of the probe as :func:`~shardwise.plan.states.optimizer_states` does (names: torch's defaults)."""
    if isinstance(optimizer, str):
        return {"adamw": 4, "adam": 4}.get(optimizer, 0)
    opt, params = stepped_probe(optimizer)
    scalars = sum(t.element_size() for s in opt.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor) and not t.dim())
    return scalars // max(1, len(params))


def _param_share(q: Param, k: int, scalar: int, stage: int, n: int, place: int) -> int:
    """Staged bytes of one parameter and its optimizer states."""
    if not q.trainable:
        return q.numel * q.element_size  # frozen: whole on every rank, no state
    piece = held_elements(q.numel, n, place) * q.element_size if stage else q.numel * q.element_size
    weight = piece if stage >= 3 else q.numel * q.element_size
    return weight + k * piece + scalar


def run_state_bytes(steps: int) -> int:
    """``trainer.step`` (int64), ``trainer.rng`` (the CPU generator's state) and ``steps`` float64 losses."""
    return 8 + torch.get_rng_state().numel() + 8 * steps


def buffer_bytes(model: nn.Module) -> int:
    """The model's persistent buffers, once each (they are whole on every rank)."""
    params = {id(p) for p in model.parameters()}
    named = first_named(model.state_dict(keep_vars=True).items())
    return sum(t.numel() * t.element_size() for _, t in named if id(t) not in params)


def staging_bytes(model: nn.Module, layout: RunLayout, optimizer: torch.optim.Optimizer | str = "adamw",
                  steps: int = 0, *, tp_plan: object = None,
                  split_points: Sequence[str] | None = None) -> list[int]:
    """Host bytes every rank stages for a save in the background, in rank order (as
    :func:`~shardwise.plan.states.rank_states`): its model and optimizer share plus the run state of a save after
    ``steps`` steps. Raises :class:`~shardwise.plan.states.NotModelled` for a parameter server (whose servers
    and workers hold other things)."""
    if layout.strategy == "ps":
        raise NotModelled("the parameter server's checkpoint share is not planned")
    if layout.engine == "torch":
        raise NotModelled("the checkpoint share under engine='torch' is not planned (it follows torch's partitions)")
    chunks = local_chunks(model, layout, tp_plan, split_points)
    return [s + buffer_bytes(meta_copy(model)) + run_state_bytes(steps)
            for s in model_share(chunks, layout, optimizer)]


def model_share(chunks: list[list[list[Param]]], layout: RunLayout,
                optimizer: torch.optim.Optimizer | str) -> list[int]:
    """Every rank's staged parameter and optimizer-state bytes (no buffers, no run state)."""
    k, scalar, stage = optimizer_states(optimizer), scalar_state_bytes(optimizer), zero_stage(layout)

    def group(cs: list[list[Param]], n: int, place: int) -> int:
        return sum(_param_share(q, k, scalar, stage, n, place) for c in cs for q in c)

    return per_rank(chunks, layout, group)


__all__ = ["STAGING", "buffer_bytes", "model_share", "run_state_bytes", "scalar_state_bytes",
           "staging_bytes"]
