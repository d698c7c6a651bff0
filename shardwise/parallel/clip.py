"""The global-norm clip: one clipper for every way the gradients are split.

Whatever the layout, the norm is the unsplit gradient's: each rank contributes the squares of the pieces it
counts (a ZeRO/FSDP shard over its shard group, a tensor-parallel slice over tp, a pipeline stage over pp, a
replicated piece by one rank only), the sums meet in one all-reduce per group, and every gradient is scaled by
torch's coefficient. Our engine's strategies (ZeRO, FSDP, tp, pp, their compositions, experts) and torch's (FSDP2,
DTensor tp) all clip here.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.comm import Comm
from shardwise.precision import widened


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor: ``max_norm / (norm + 1e-6)`` clamped to at most 1."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def sum_of_squares(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The float64 sum of the squares of ``grads``: each piece's squares summed in its own dtype (half widened
    to float32), the pieces in float64, so a float64 model's norm is not rounded to float32 and every rank
    reduces the same dtype."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        sq += widened(g.detach()).pow(2).sum().to(device=device, dtype=torch.float64)
    return sq


def clip_global_norm(counted: Sequence[torch.Tensor], every: Sequence[torch.Tensor], max_norm: float,
                     groups: Sequence[tuple[Comm | None, str]], device: torch.device,
                     reduced: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Clip gradients by the norm of the whole model's gradient, however it is split.

    The one clipper of every layout. ``counted`` are the gradient pieces whose
    squares this rank contributes: together, over the ranks of ``groups``,
    they cover every element of the unsplit gradient exactly once (a ZeRO or
    FSDP shard over its shard group, a tensor-parallel slice over tp, a
    pipeline stage over pp; a piece replicated over a group is counted by one
    of its ranks only, and not summed over a group where every rank holds the
    same values, such as DDP's dp or HSDP's replicas); each group comes with the
name its all-reduce is counted under. ``every`` are all the
    gradients this rank holds, scaled by the common coefficient. Returns the
    total norm, the same on every rank. The coefficient is torch's
    (``max_norm / (norm + 1e-6)``, at most 1). ``reduced`` are further sums of
    squares (:func:`sum_of_squares`) that their caller has already summed over
    a group of their own; they join the rest before ``groups``' all-reduces.
    """
    sq = sum_of_squares(counted, device)
    for part in reduced:  # sums of squares already reduced over a group of their own (experts over ep)
        sq += part
    for comm, name in groups:
        if comm is not None and comm.size > 1:
            comm.all_reduce(sq, name=name)
    total = sq.sqrt()
    coef = clip_coefficient(total, max_norm)
    for g in every:
        g.detach().mul_(coef.to(device=g.device, dtype=g.dtype))
    return total


__all__ = ["clip_coefficient", "clip_global_norm", "sum_of_squares"]
