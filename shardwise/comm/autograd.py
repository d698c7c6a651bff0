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

Megatron's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2) splits the
activations between the tensor-parallel layers along the sequence (dim 1 of
(B, S, H)) and replaces each all-reduce by a reduce-scatter plus an all-gather
of the same bytes. Three more operators move between the two layouts:

* :class:`GatherFromSequence`: all-gather along the sequence forward; backward
  reduce-scatters the gradient (``g-bar``: the gathered tensor feeds
  column-parallel layers, so each rank holds a partial sum of its gradient),
  or keeps this rank's slice when the gathered tensor is consumed replicated;
* :class:`ReduceScatterToSequence`: reduce-scatter along the sequence forward
  (a row-parallel layer's partial sums, or a vocabulary-parallel embedding's),
  all-gather of the gradient backward;
* :class:`ScatterToSequence`: this rank's slice of the sequence forward (a
  replicated tensor entering the sequence region), all-gather backward.

:func:`all_reduce_grad` sums a replicated parameter's gradient over the group
in every backward: a parameter used inside the sequence region (a norm's
weight) sees only this rank's tokens.

Every function takes the :class:`~shardwise.comm.Comm` it talks through as an
argument (no global group), and names its traffic so the bytes are counted
under ``name``'s prefix (``"tp"`` by default).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from shardwise.comm.collectives import Comm

# Set on the output of a sequence gather whose backward reduce-scatters: the column-parallel layers that read it
# under sequence parallelism drop Megatron's ``f`` (that reduce-scatter sums their partial input gradients
# instead), and they check this mark so a plan that forgot a gather fails instead of training on wrong gradients.
SEQUENCE_GATHERED = "_shardwise_sequence_gathered"


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
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
        ctx.comm, ctx.name = comm, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.comm, ctx.name), None, None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str,
                inplace: bool = False) -> torch.Tensor:
        if inplace:
            # The caller's own fresh partial sum (a row-parallel matmul's output): reduce it where it is,
            # instead of a copy of every row-parallel output (1 MiB a layer in the fsdp-tp benchmark).
            ctx.mark_dirty(x)
            comm.all_reduce(x, name=name)
            return x
        return _all_reduce(x, comm, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad, None, None, None


class GatherFromParallel(torch.autograd.Function):
    """All-gather along the last dimension forward; this rank's slice of the gradient backward.

    The gradient of the gathered tensor is the same on every rank (everything
    downstream is replicated), so keeping one's own slice needs no communication.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
        ctx.comm = comm
        return _gather_last(x, comm, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split_last(grad, ctx.comm), None, None


class ScatterToParallel(torch.autograd.Function):
    """This rank's slice along the last dimension forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
        ctx.comm, ctx.name = comm, name
        return _split_last(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_last(grad, ctx.comm, ctx.name), None, None


# ---- along the sequence dimension (sequence parallelism) ---------------------------------------------
def check_sequence_split(n: int, comm: Comm) -> None:
    """Refuse a sequence of ``n`` tokens that does not split into ``comm.size`` equal parts."""
    t = comm.size
    if n % t:
        raise ValueError(f"sequence parallel: the sequence length is {n}, not divisible by tp={t} ({n} % {t} = "
                         f"{n % t}): outside the tensor-parallel layers each tp rank holds an equal 1/{t} of the "
                         f"sequence; use a sequence length that is a multiple of {t} (e.g. {n + t - n % t}), or "
                         "sequence_parallel=False")


def _gather_dim(t: torch.Tensor, comm: Comm, name: str, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (rank order), contiguous."""
    if comm.size == 1:
        return t
    d = dim % t.dim()
    # Comm.all_gather concatenates along dim 0. The result is made contiguous: the linear layers that read it
    # would otherwise each copy it to fold (B, S) into one dimension, and save that copy for backward.
    shard = t.movedim(d, 0).contiguous()
    flat = torch.empty((comm.size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    comm.all_gather(flat, shard, name=name)
    return flat.movedim(0, d).contiguous()


def _reduce_scatter_dim(t: torch.Tensor, comm: Comm, name: str, dim: int) -> torch.Tensor:
    """The sum over ranks of ``t``, of which this rank keeps its equal slice along ``dim``."""
    d = dim % t.dim()
    check_sequence_split(t.shape[d], comm)
    if comm.size == 1:
        return t
    full = t.movedim(d, 0).contiguous()
    out = torch.empty((full.shape[0] // comm.size, *full.shape[1:]), dtype=full.dtype, device=full.device)
    comm.reduce_scatter(out, full, name=name)
    return out.movedim(0, d).contiguous()


def _split_dim(t: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """This rank's equal slice of ``t`` along ``dim`` (no communication)."""
    d = dim % t.dim()
    check_sequence_split(t.shape[d], comm)
    if comm.size == 1:
        return t
    w = t.shape[d] // comm.size
    return t.narrow(d, comm.rank * w, w).contiguous()


class GatherFromSequence(torch.autograd.Function):
    """All-gather along ``dim`` forward; backward reduce-scatters the gradient (``reduce_grad``: the consumers are
    column-parallel, each rank's gradient is a partial sum) or keeps this rank's slice (replicated consumers)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str, dim: int,
                reduce_grad: bool) -> torch.Tensor:
        ctx.comm, ctx.name, ctx.dim, ctx.reduce_grad = comm, name, dim, reduce_grad
        return _gather_dim(x, comm, name, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.reduce_grad:
            return _reduce_scatter_dim(grad, ctx.comm, ctx.name, ctx.dim), None, None, None, None
        return _split_dim(grad, ctx.comm, ctx.dim), None, None, None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward (partial sums in, this rank's tokens of the sum out); all-gather of
    the gradient backward (every token's gradient, which the partial sums all need)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str, dim: int) -> torch.Tensor:
        ctx.comm, ctx.name, ctx.dim = comm, name, dim
        return _reduce_scatter_dim(x, comm, name, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather_dim(grad, ctx.comm, ctx.name, ctx.dim), None, None, None


class ScatterToSequence(torch.autograd.Function):
    """This rank's slice along ``dim`` forward (a replicated tensor enters the sequence region); all-gather of
    the gradient backward, so the replicated producer gets its whole gradient on every rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str, dim: int) -> torch.Tensor:
        ctx.comm, ctx.name, ctx.dim = comm, name, dim
        return _split_dim(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather_dim(grad, ctx.comm, ctx.name, ctx.dim), None, None, None


def gather_from_sequence(x: torch.Tensor, comm: Comm, name: str = "tp.sp_gather", dim: int = 1,
                         reduce_grad: bool = True) -> torch.Tensor:
    """All-gather ``x`` along the sequence ``dim`` (see :class:`GatherFromSequence`).

    With ``reduce_grad`` the output is marked (:data:`SEQUENCE_GATHERED`) as fit for column-parallel layers
    without ``f``.
    """
    if comm.size == 1:
        return x
    y: torch.Tensor = GatherFromSequence.apply(x, comm, name, dim, reduce_grad)
    if reduce_grad:
        # On the tensor and on the storage's owner: the consumers may read a view (a reshape, a slice).
        for t in (y, y._base):
            if t is not None:
                setattr(t, SEQUENCE_GATHERED, True)
    return y


def is_sequence_gathered(x: torch.Tensor) -> bool:
    """Whether ``x`` is (a view of) the output of :func:`gather_from_sequence` with ``reduce_grad``."""
    return any(bool(getattr(t, SEQUENCE_GATHERED, False)) for t in (x, x._base) if t is not None)


def reduce_scatter_to_sequence(x: torch.Tensor, comm: Comm, name: str = "tp.sp_reduce_scatter",
                               dim: int = 1) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's part of the sequence ``dim``
    (see :class:`ReduceScatterToSequence`); refuses a sequence that does not split evenly."""
    if comm.size == 1:
        return x
    return ReduceScatterToSequence.apply(x, comm, name, dim)  # type: ignore[no-any-return]


def scatter_to_sequence(x: torch.Tensor, comm: Comm, name: str = "tp.sp_scatter", dim: int = 1) -> torch.Tensor:
    """This rank's part of the sequence ``dim`` of replicated ``x`` (see :class:`ScatterToSequence`);
    refuses a sequence that does not split evenly."""
    if comm.size == 1:
        return x
    return ScatterToSequence.apply(x, comm, name, dim)  # type: ignore[no-any-return]


def all_reduce_grad(p: torch.Tensor, comm: Comm, name: str) -> RemovableHandle:
    """Sum ``p``'s gradient over ``comm``'s group in every backward, before it is accumulated into ``p.grad``.

    For a replicated parameter that each rank applies to a different part of the data (a norm inside the
    sequence region sees S/t tokens): the full gradient is the sum of the parts. The hook runs before
    accumulation, so with gradient accumulation each micro-batch's part is summed once, and the
    data-parallel wrappers' post-accumulate hooks see the summed gradient.
    """
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, comm, name)

    return p.register_hook(hook)  # type: ignore[no-any-return]


def copy_to_parallel(x: torch.Tensor, comm: Comm, name: str = "tp.f") -> torch.Tensor:
    """Megatron ``f`` on ``comm``'s group (see :class:`CopyToParallel`)."""
    return x if comm.size == 1 else CopyToParallel.apply(x, comm, name)


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
    return x if comm.size == 1 else GatherFromParallel.apply(x, comm, name)


def scatter_to_parallel(x: torch.Tensor, comm: Comm, name: str = "tp.scatter") -> torch.Tensor:
    """Keep this rank's slice of the last dimension (see :class:`ScatterToParallel`)."""
    return x if comm.size == 1 else ScatterToParallel.apply(x, comm, name)


class AllToAllV(torch.autograd.Function):
    """Rows exchanged by an all-to-all with uneven split sizes (expert parallelism's dispatch and combine).

    Backward sends each row's gradient back where the row came from: the same
    exchange with the split sizes swapped, counted under ``grad_name``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int],
                name: str, grad_name: str) -> torch.Tensor:
        ctx.comm, ctx.splits, ctx.grad_name = comm, (out_splits, in_splits), grad_name
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_v(out, x.contiguous(), out_splits, in_splits, name)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all_v(back, grad.contiguous(), in_splits, out_splits, ctx.grad_name)
        return back, None, None, None, None, None


def all_to_all_v(x: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int], name: str,
                 grad_name: str) -> torch.Tensor:
    """Differentiable :meth:`Comm.all_to_all_v`: ``in_splits[i]`` rows of ``x`` to rank i, ``out_splits[j]``
    rows from rank j."""
    return AllToAllV.apply(x, comm, out_splits, in_splits, name, grad_name)  # type: ignore[no-any-return]


__all__ = ["AllToAllV", "all_to_all_v", "CopyToParallel", "ReduceFromParallel", "GatherFromParallel",
           "ScatterToParallel",
           "copy_to_parallel", "reduce_from_parallel", "gather_from_parallel", "scatter_to_parallel",
           "GatherFromSequence", "ReduceScatterToSequence", "ScatterToSequence", "SEQUENCE_GATHERED",
           "all_reduce_grad", "check_sequence_split", "gather_from_sequence", "is_sequence_gathered",
           "reduce_scatter_to_sequence", "scatter_to_sequence"]
