"""Differentiable collectives: communication that autograd can see through.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3) needs two
conjugate operators on the tensor-parallel group:

* ``f`` (:class:`CopyToParallel`): identity in forward, all-reduce in backward.
  It sits where a replicated activation enters a column-parallel layer: each
  rank only sees the gradient of its own slice of the output, and the input's
  full gradient is the sum of those partial gradients.
* ``g`` (:class:`ReduceFromParallel`): all-reduce in forward, identity in
  backward. It sits where the partial outputs of a row-parallel layer (or of a
  vocabulary-parallel embedding) become one replicated activation.

Two more pairs move between a replicated tensor and one split along its last
dimension (the output of a column-parallel layer whose consumer needs all of
it, such as the logits fed to the loss):

* :class:`GatherFromParallel`: all-gather in forward, keep own slice in backward;
* :class:`ScatterToParallel`: keep own slice in forward, all-gather in backward.

Every function takes the :class:`~shardwise.comm.Comm` it talks through as an
argument (no global group), and names its traffic so the bytes are counted
under ``name``'s prefix (``"tp"`` by default).
"""
from __future__ import annotations

from typing import Any

import torch

from shardwise.comm.collectives import Comm


def _all_reduce(t: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
    # c10d reduces in place and needs a contiguous tensor we own: never reduce
    # into an autograd input or a gradient another node may still read.
    out = t.contiguous().clone() if comm.size > 1 else t
    comm.all_reduce(out, name=name)
    return out


def _gather_last(t: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
    """Concatenate every rank's ``t`` along the last dimension (rank order)."""
    if comm.size == 1:
        return t
    # Comm.all_gather concatenates along dim 0, so gather the slices stacked
    # in front and move that axis next to the last one before flattening.
    shard = t.contiguous()
    flat = torch.empty((comm.size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    comm.all_gather(flat, shard, name=name)
    out = flat.view(comm.size, *shard.shape)
    return out.movedim(0, -2).reshape(*shard.shape[:-1], comm.size * shard.shape[-1])


def _split_last(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's equal slice of ``t`` along the last dimension."""
    if comm.size == 1:
        return t
    n = t.shape[-1]
    if n % comm.size:
        raise ValueError(f"cannot split a last dimension of {n} into {comm.size} equal tensor-parallel slices")
    w = n // comm.size
    return t[..., comm.rank * w:(comm.rank + 1) * w].contiguous()


class CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.name = comm, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _all_reduce(grad, ctx.comm, ctx.name), None, None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str,  # type: ignore[override]
                inplace: bool = False) -> torch.Tensor:
        if inplace:
            # The caller's own fresh partial sum (a row-parallel matmul's output): reduce it where it is,
            # instead of a copy of every row-parallel output (1 MiB a layer in the fsdp-tp benchmark).
            ctx.mark_dirty(x)
            comm.all_reduce(x, name=name)
            return x
        return _all_reduce(x, comm, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return grad, None, None, None


class GatherFromParallel(torch.autograd.Function):
    """All-gather along the last dimension forward; this rank's slice of the gradient backward.

    The gradient of the gathered tensor is the same on every rank (everything
    downstream is replicated), so keeping one's own slice needs no communication.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return _gather_last(x, comm, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _split_last(grad, ctx.comm), None, None


class ScatterToParallel(torch.autograd.Function):
    """This rank's slice along the last dimension forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.name = comm, name
        return _split_last(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _gather_last(grad, ctx.comm, ctx.name), None, None


def copy_to_parallel(x: torch.Tensor, comm: Comm, name: str = "tp.f") -> torch.Tensor:
    """Megatron ``f`` on ``comm``'s group (see :class:`CopyToParallel`)."""
    return x if comm.size == 1 else CopyToParallel.apply(x, comm, name)  # type: ignore[no-any-return]


def reduce_from_parallel(x: torch.Tensor, comm: Comm, name: str = "tp.g", fresh: bool = False) -> torch.Tensor:
    """Megatron ``g`` on ``comm``'s group (see :class:`ReduceFromParallel`).

    ``fresh``: ``x`` is an intermediate the caller just made and nobody else holds (no autograd node saved
    it), so it is reduced in place; a view or a non-contiguous tensor is still copied first.
    """
    if comm.size == 1:
        return x
    inplace = fresh and x.is_contiguous() and not x._is_view() and not (x.is_leaf and x.requires_grad)
    return ReduceFromParallel.apply(x, comm, name, inplace)  # type: ignore[no-any-return]


def gather_from_parallel(x: torch.Tensor, comm: Comm, name: str = "tp.gather") -> torch.Tensor:
    """All-gather the last dimension (see :class:`GatherFromParallel`)."""
    return x if comm.size == 1 else GatherFromParallel.apply(x, comm, name)  # type: ignore[no-any-return]


def scatter_to_parallel(x: torch.Tensor, comm: Comm, name: str = "tp.scatter") -> torch.Tensor:
    """Keep this rank's slice of the last dimension (see :class:`ScatterToParallel`)."""
    return x if comm.size == 1 else ScatterToParallel.apply(x, comm, name)  # type: ignore[no-any-return]


__all__ = ["CopyToParallel", "ReduceFromParallel", "GatherFromParallel", "ScatterToParallel",
           "copy_to_parallel", "reduce_from_parallel", "gather_from_parallel", "scatter_to_parallel"]
