"""What a rank holds of every tensor of the layout-free checkpoint, named as in the unsplit model.

:func:`held_state` turns a rank's tensors (whole, tp slices, or dp shards
reported by a wrapper's ``checkpoint_parts``) into
:class:`Held` entries; :func:`named_state` and
:func:`first_named` name each tensor once (a tied weight under its first name).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.parallel.ep import expert_spec
from shardwise.parallel.tp.apply import tp_spec
from shardwise.step import first_named


@dataclass(frozen=True)
class Held:
    """What this rank holds of one checkpoint tensor.

    ``key``: ``model.<fqn>`` or ``optim.<fqn>.<state>`` (names of the unsplit model);
    ``data``: the tensor itself when the rank holds its whole tensor-parallel slice
    (``start == 0`` and the slice's shape), else a 1-D view of elements
    ``[start, start + data.numel())`` of the slice flattened;
    ``tp``: ``(dim, parts)`` of a tensor-parallel slice, None when not split by tp;
    ``ep``: ``(ep rank, ep size)`` of an expert-parallel parameter (its rank's rows of dim 0), None otherwise.

    Defined here, not beside the DCP planners of :mod:`shardwise.checkpoint.pieces` (which re-exports it), so
    that a strategy describes its state without loading torch.distributed.checkpoint.
    """

    key: str
    data: torch.Tensor
    start: int = 0
    tp: tuple[int, int] | None = None
    ep: tuple[int, int] | None = None


def scoped(scope: str, key: str) -> str:
    """``key`` under ``scope``: ``"<scope>/<key>"`` (a DiLoCo replica's own weights and states, ``replica1/model.w``,
    beside the global ``model.w``); the empty scope is the key itself. No module name holds a ``/``."""
    return f"{scope}/{key}" if scope else key


def scope_of(key: str) -> str:
    """The scope of a checkpoint key (:func:`scoped`): ``""`` for a plain ``model.`` or ``optim.`` key."""
    return key.partition("/")[0] if "/" in key else ""


def unscoped(key: str) -> str:
    """The key without its scope: ``replica1/optim.w.exp_avg`` -> ``optim.w.exp_avg``."""
    return key.partition("/")[2] if "/" in key else key


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s state-dict tensors (parameters, persistent buffers) once each, under their first name
    (a tied weight is saved once; its other names are aliases, see :func:`shardwise.checkpoint.model_shapes`)."""
    return first_named(module.state_dict(keep_vars=True).items())


def held_state(named: Sequence[tuple[str, torch.Tensor]], wrappers: Sequence[nn.Module],
               optimizer: torch.optim.Optimizer) -> list[Held]:
    """:class:`Held` entries for the tensors ``named`` (names of the unsplit model).

    A data-parallel wrapper among ``wrappers`` that shards a parameter reports
    its parts (``checkpoint_parts(optimizer)``: per parameter, ``(what, start,
    1-D view)`` with ``what`` ``"param"`` or an optimizer state's name); every
    other tensor is whole on this rank, its optimizer states keyed by the
    parameter itself. Tensor-parallel slices carry their ``tp_spec``.
    """
    parts: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
    for w in wrappers:
        if hasattr(w, "checkpoint_parts"):
            parts.update({id(p): got for p, got in w.checkpoint_parts(optimizer).items()})  # type: ignore[operator]
    out: list[Held] = []
    for name, t in named:
        spec, ep = tp_spec(t), expert_spec(t)
        got = parts.get(id(t))
        states: list[tuple[str, int, torch.Tensor]] = got if got is not None else \
            [(k, 0, v) for k, v in optimizer.state.get(t, {}).items() if isinstance(v, torch.Tensor)]
        if not any(what == "param" for what, _, _ in states):
            out.append(Held(f"model.{name}", t.detach(), 0, spec, ep))
        for what, start, v in states:
            key = f"model.{name}" if what == "param" else f"optim.{name}.{what}"
            out.append(Held(key, v, start, spec if v.dim() > 0 else None, ep if v.dim() > 0 else None))
    return out
