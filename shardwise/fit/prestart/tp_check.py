"""Tensor-parallel plans checked before any process starts.

A plan that does not fit the model (a pattern that matches nothing, a width
that does not divide, a module tp cannot split) used to surface only inside
the rank processes, after the group had formed; a forward that reshapes with
the full width (``view(B, T, n_head, C // n_head)`` with ``C`` read from the
input) failed there with a bare shape error. Here the plan is applied to a
meta-device copy of the model, as rank 0 of a tp group would apply it, and
the split copy runs one forward on meta tensors of the real batch's shapes:
both cost no memory and no communication.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.dims import TP
from shardwise.fit.prestart.preflight import _to_meta
from shardwise.parallel.tp.apply import apply_tp
from shardwise.parallel.tp.plans import Plan, Style
from shardwise.plan.trace import meta_copy

DOC = "docs/model_parallel.md, 'Your own model under tp'"


class MetaComm:
    """What the tensor-parallel layers need of a :class:`~shardwise.comm.Comm`, for meta tensors: the
    group's size and rank, and collectives that leave their outputs' shapes as the real ones would."""

    label = TP

    def __init__(self, size: int) -> None:
        self.size, self.rank = size, 0

    def all_reduce(self, t: torch.Tensor, **_: Any) -> None:
        pass

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, **_: Any) -> None:
        pass

    def broadcast(self, t: torch.Tensor, **_: Any) -> None:
        pass

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, **_: Any) -> None:
        pass


def check_plan(model: nn.Module, plan: Plan | dict[str, str | Style] | str | None, tp: int,
               x: Any = None, sequence_parallel: bool = False) -> None:
    """Raise what applying ``plan`` with ``tp`` ranks would raise in every rank, before any rank exists.

    With a sample input ``x``, also run the split model forward on the meta
    device: when the whole model runs there but the split one does not, the
    forward depends on a width or count that tp divides (the error says which
    operation failed and how a plan adjusts per-rank attributes).
    """
    whole = meta_copy(model)
    split = apply_tp(meta_copy(model), plan, MetaComm(tp),  # type: ignore[arg-type]
                        sequence_parallel=sequence_parallel)
    if x is None:
        return
    try:
        with torch.no_grad():
            whole(_to_meta(x))
    except Exception:  # noqa: BLE001 - the meta device cannot run this model: no verdict
        return
    try:
        with torch.no_grad():
            split(_to_meta(x))
    except Exception as e:  # noqa: BLE001 - any failure here is one every rank would meet
        if str(e).startswith("sequence parallel:"):
            raise ValueError(str(e)) from None  # already names the fix
        first = (str(e).splitlines() or [""])[0]
        raise ValueError(f"tensor parallel: {type(model).__name__} runs whole, but its forward fails once split "
                         f"over tp={tp} ranks: {type(e).__name__}: {first}. Each rank holds 1/{tp} of the heads "
                         "and of the split widths, so a forward that reshapes with a count or width of the whole "
                         "model (n_head, or C read from the input) breaks; give the plan local_attrs (e.g. "
                         "Plan(styles, local_attrs={'blocks.*.attn': ('n_head', 'n_embd')})) and reshape with "
                         f"those attributes or -1; see {DOC}") from None


__all__ = ["MetaComm", "check_plan"]
