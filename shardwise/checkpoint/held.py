"""TODO docstring."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from shardwise.checkpoint.pieces import Held


def first_named(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of ``named`` once, under the first name it comes with (a tied weight's saved name)."""
    seen: set[int] = set()
    out = []
    for k, v in named:
        if id(v) not in seen:
            seen.add(id(v))
            out.append((k, v))
    return out


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s state-dict tensors (parameters, persistent buffers) once each, under their first name
    (a tied weight is saved once; its other names are aliases, see :func:`shardwise.checkpoint.model_shapes`)."""
    return first_named(module.state_dict(keep_vars=True).items())


def held_state(named: Sequence[tuple[str, torch.Tensor]], wrappers: Sequence[nn.Module],
               optimizer: torch.optim.Optimizer) -> list[Held]:
    """:class:`~shardwise.pieces.Held` entries for the tensors ``named`` (names of the unsplit model).

    A data-parallel wrapper among ``wrappers`` that shards a parameter reports
    its parts (``checkpoint_parts(optimizer)``: per parameter, ``(what, start,
    1-D view)`` with ``what`` ``"param"`` or an optimizer state's name); every
    other tensor is whole on this rank, its optimizer states keyed by the
    parameter itself. Tensor-parallel slices carry their ``tp_spec``.
    """
    from shardwise.checkpoint.pieces import Held
    from shardwise.parallel.tp import tp_spec

    parts: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
    for w in wrappers:
        if hasattr(w, "checkpoint_parts"):
            parts.update({id(p): got for p, got in w.checkpoint_parts(optimizer).items()})
    out: list[Held] = []
    for name, t in named:
        spec = tp_spec(t)
        got = parts.get(id(t))
        states: list[tuple[str, int, torch.Tensor]] = got if got is not None else \
            [(k, 0, v) for k, v in optimizer.state.get(t, {}).items() if isinstance(v, torch.Tensor)]
        if not any(what == "param" for what, _, _ in states):
            out.append(Held(f"model.{name}", t.detach(), 0, spec))
        for what, start, v in states:
            key = f"model.{name}" if what == "param" else f"optim.{name}.{what}"
            out.append(Held(key, v, start, spec if v.dim() > 0 else None))
    return out
