"""Tensor-parallel layers: a Linear or an Embedding whose weight is a slice of the full one.

:class:`ColumnParallelLinear` keeps a slice of the output features,
:class:`RowParallelLinear` a slice of the input features (its partial outputs
are summed over the tp group), :class:`VocabParallelEmbedding` a slice of the
vocabulary (Shoeybi et al. 2019, "Megatron-LM", section 3). Each sliced
tensor carries its split (:func:`tp_spec`), so checkpoints, clipping and
gathering know which tensors are slices. :mod:`shardwise.parallel.tp.apply` applies
a plan with these layers; :mod:`shardwise.parallel.tp.plans` names which
modules become which.

With ``sequence_parallel`` (Korthikanti et al. 2022) the activations around
these layers are split along the sequence: a column-parallel layer reads an
input already all-gathered along the sequence (by
:mod:`shardwise.parallel.tp.sequence_parallel`, whose backward reduce-scatter
replaces ``f``), a row-parallel layer reduce-scatters its partial sums along
the sequence instead of all-reducing them, and a vocabulary-parallel
embedding may do the same.
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from shardwise.comm import Comm
from shardwise.comm.autograd import (
    all_reduce_grad,
    copy_to_parallel,
    gather_from_parallel,
    is_sequence_gathered,
    reduce_from_parallel,
    reduce_scatter_to_sequence,
)

# A sharded parameter carries (dim, parts): split along ``dim``, where the
# full tensor is ``parts`` equal pieces (fused q|k|v) each split separately.
SPEC_ATTR = "_shardwise_tp"


# ---- sharding and gathering of one tensor ---------------------------------
def shard_tensor(full: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim`` (of each of ``parts`` pieces)."""
    t = full.movedim(dim, 0)
    n, rest = t.shape[0], t.shape[1:]
    t = t.reshape(parts, size, n // (parts * size), *rest)[:, rank]
    # A copy, not .contiguous(): a slice of whole rows is already contiguous, and
    # .contiguous() would return a view that keeps the full tensor's storage alive.
    return t.reshape(n // size, *rest).movedim(0, dim).clone(memory_format=torch.contiguous_format)


def gather_tensor(shard: torch.Tensor, dim: int, parts: int, comm: Comm, name: str = "tp.state") -> torch.Tensor:
    """Inverse of :func:`shard_tensor`, a collective on ``comm``'s group."""
    if comm.size == 1:
        return shard
    t = shard.movedim(dim, 0).contiguous()
    n, rest = t.shape[0], t.shape[1:]
    out = torch.empty((comm.size * n, *rest), dtype=t.dtype, device=t.device)
    comm.all_gather(out, t, name=name)
    out = out.reshape(comm.size, parts, n // parts, *rest).transpose(0, 1)
    return out.reshape(comm.size * n, *rest).movedim(0, dim)


def _mark(p: nn.Parameter, dim: int, parts: int) -> nn.Parameter:
    setattr(p, SPEC_ATTR, (dim, parts))
    return p


def tp_spec(t: torch.Tensor) -> tuple[int, int] | None:
    """(dim, parts) of a tensor-parallel shard, None for a replicated tensor."""
    return getattr(t, SPEC_ATTR, None)


# ---- the parallel layers ----------------------------------------------------
class _FOnce:
    """One Megatron ``f`` per input tensor, shared by the column-parallel layers that read it.

    q, k and v (or Llama's gate and up projections) read the same normalised
    activation. Megatron fuses them into one GEMM behind one ``f``; with
    separate modules, reusing the first layer's ``f`` output gives the same
    single all-reduce in backward (autograd sums the three gradients before
    ``f``'s backward runs) instead of three. The input is held weakly; the
    ``f`` output (a view of it) only until the input is gone or the next
    input arrives.
    """

    def __init__(self) -> None:
        self._x: weakref.ref[torch.Tensor] | None = None
        self._y: torch.Tensor | None = None

    def _drop(self, ref: Any) -> None:
        if ref is self._x:
            self._x, self._y = None, None

    def __call__(self, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        if self._x is not None and self._y is not None and self._x() is x:
            return self._y
        y = copy_to_parallel(x, comm, "tp.f")
        self._x, self._y = weakref.ref(x, self._drop), y
        return y


class _Shared:
    """Shards already made, by the id of the original parameter: tied weights stay tied."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[tuple[int, int], nn.Parameter, str]] = {}
        self.f = _FOnce()

    def shard(self, p: nn.Parameter, dim: int, parts: int, comm: Comm, where: str) -> nn.Parameter:
        got = self.made.get(id(p))
        if got is not None:
            if got[0] != (dim, parts):
                raise ValueError(f"tensor parallel: '{where}' shares its weight with '{got[2]}' but the plan "
                                 f"splits them differently ({(dim, parts)} vs {got[0]}); tied weights must be "
                                 "split the same way (vocab embedding + colwise head)")
            return got[1]
        s = _mark(nn.Parameter(shard_tensor(p.detach(), dim, parts, comm.rank, comm.size),
                               requires_grad=p.requires_grad), dim, parts)
        self.made[id(p)] = ((dim, parts), s, where)
        return s


def _linear_shape(mod: nn.Module) -> tuple[int, int, bool]:
    """(in, out, transposed) of an nn.Linear or a GPT-2 style Conv1D (weight stored (in, out))."""
    if isinstance(mod, nn.Linear):
        return mod.in_features, mod.out_features, False
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "nx"):
        return mod.nx, mod.nf, True  # type: ignore[return-value]
    raise TypeError(f"tensor parallel: cannot split a {type(mod).__name__}; colwise/rowwise need nn.Linear "
                    "(or a transformers Conv1D)")


def _check_split(n: int, size: int, parts: int, where: str, what: str, why: str) -> None:
    if n % (size * parts):
        unit = f"{parts} x tp = {parts * size}" if parts > 1 else f"tp={size}"
        raise ValueError(f"tensor parallel: {what} of '{where}' is {n}, not divisible by {unit} "
                         f"({n} % {parts * size} = {n % (parts * size)}): {why}")


class _TPLinear(nn.Module):
    """Shared state of the column- and row-parallel layers."""

    def __init__(self, comm: Comm, transposed: bool) -> None:
        super().__init__()
        self.comm = comm
        self.transposed = transposed

    def _mm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, bias)  # type: ignore[arg-type]
        # Conv1D's own arithmetic (addmm on the flattened input), so the
        # unsplit case reproduces it bit for bit.
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.addmm(bias, x2, self.weight) if bias is not None else x2 @ self.weight  # type: ignore[arg-type,operator]
        return y.view(*x.shape[:-1], y.shape[-1])


class ColumnParallelLinear(_TPLinear):
    """Output features split over the tp group; input replicated (Megatron's ``f`` in front).

    With ``gather_output`` the output is all-gathered back to full width.
    """

    def __init__(self, mod: nn.Module, comm: Comm, shared: _Shared, where: str, gather_output: bool = False,
                 parts: int = 1, sequence_parallel: bool = False) -> None:
        n_in, n_out, transposed = _linear_shape(mod)
        super().__init__(comm, transposed)
        _check_split(n_out, comm.size, parts, where, "the output size",
                     "a column-parallel layer gives every rank an equal slice of the output features")
        if gather_output and parts > 1:
            raise ValueError(f"tensor parallel: '{where}': gather_output with a fused ({parts}-part) "
                             "projection would interleave the parts")
        self.in_features, self.out_features = n_in, n_out // comm.size
        self.gather_output = gather_output
        self.where = where
        # Under sequence parallelism the input comes gathered along the sequence, and the gather's backward
        # reduce-scatter sums the input gradient over tp: ``f`` would sum it a second time.
        self.sequence_parallel = sequence_parallel
        self.f = shared.f
        self.weight = shared.shard(mod.weight, 1 if transposed else 0, parts, comm, where)  # type: ignore[arg-type]
        self.bias = (shared.shard(mod.bias, 0, parts, comm, where)  # type: ignore[arg-type]
                     if getattr(mod, "bias", None) is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            if self.comm.size > 1 and not is_sequence_gathered(x):
                raise RuntimeError(f"sequence parallel: the input of the column-parallel layer '{self.where}' was "
                                   "not all-gathered along the sequence; every column-parallel layer must read "
                                   "the output of a module the plan's SequenceLayout lists in 'gather' (or its "
                                   "'exit' feeding a column-parallel head)")
            y = self._mm(x, self.bias)
        else:
            y = self._mm(self.f(x, self.comm), self.bias)
        return gather_from_parallel(y, self.comm, "tp.gather") if self.gather_output else y


class RowParallelLinear(_TPLinear):
    """Input features split over the tp group; partial outputs summed by Megatron's ``g``.

    The bias is replicated and added after the sum (adding it on every rank
    before the all-reduce would count it tp times).
    """

    def __init__(self, mod: nn.Module, comm: Comm, shared: _Shared, where: str,
                 sequence_parallel: bool = False) -> None:
        n_in, n_out, transposed = _linear_shape(mod)
        super().__init__(comm, transposed)
        _check_split(n_in, comm.size, 1, where, "the input size",
                     "a row-parallel layer gives every rank an equal slice of the input features")
        self.in_features, self.out_features = n_in // comm.size, n_out
        self.weight = shared.shard(mod.weight, 0 if transposed else 1, 1, comm, where)  # type: ignore[arg-type]
        self.bias = mod.bias if getattr(mod, "bias", None) is not None else None
        # Under sequence parallelism the sum is reduce-scattered along the sequence (dim 1): the bias is then
        # added to this rank's tokens only, so its gradient is summed over tp, as Megatron does.
        self.sequence_parallel = sequence_parallel
        if sequence_parallel and self.bias is not None and self.bias.requires_grad:
            all_reduce_grad(self.bias, comm, f"sp_grads.{where}.bias")  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(self._mm(x, None), self.comm, "tp.sp_reduce_scatter")
        else:
            y = reduce_from_parallel(self._mm(x, None), self.comm, "tp.g", fresh=True)
        if self.bias is None:
            return y
        # In place where no type promotion is involved (bf16 autocast output + fp32 bias promotes): g saved
        # nothing and the sum is ours alone, so one activation less is allocated per layer.
        return y.add_(self.bias) if y.dtype == self.bias.dtype else y + self.bias  # type: ignore[arg-type,operator]


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding table split over the tp group (Megatron section 3).

    Each rank looks up the ids in its own row range, writes zeros for the
    others, and ``g`` sums the partial lookups into the full embedding.
    """

    def __init__(self, mod: nn.Embedding, comm: Comm, shared: _Shared, where: str,
                 reduce_scatter: bool = False) -> None:
        super().__init__()
        if not isinstance(mod, nn.Embedding):
            raise TypeError(f"tensor parallel: 'vocab' applies to nn.Embedding, '{where}' is {type(mod).__name__}")
        if mod.max_norm is not None or mod.sparse:
            raise ValueError(f"tensor parallel: '{where}': max_norm and sparse embeddings are not supported")
        v = mod.num_embeddings
        if v % comm.size:
            up = math.ceil(v / comm.size) * comm.size
            raise ValueError(f"tensor parallel: the vocabulary size of '{where}' is {v}, not divisible by "
                             f"tp={comm.size} ({v} % {comm.size} = {v % comm.size}): a vocabulary-parallel "
                             f"embedding gives every rank an equal range of rows; pad the vocabulary to {up}")
        self.comm = comm
        self.num_embeddings, self.embedding_dim = v // comm.size, mod.embedding_dim
        self.start = comm.rank * self.num_embeddings
        pad = mod.padding_idx
        self.padding_idx = pad - self.start if pad is not None and 0 <= pad - self.start < self.num_embeddings \
            else None
        self.weight = shared.shard(mod.weight, 0, 1, comm, where)  # type: ignore[arg-type]
        # Sequence parallelism starting here: the partial lookups are reduce-scattered along the sequence
        # (dim 1 of the (B, S, H) output), half the bytes of the all-reduce forward, the other half backward.
        self.reduce_scatter = reduce_scatter

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.start + self.num_embeddings)
        local = (idx - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter:
            return reduce_scatter_to_sequence(out, self.comm, "tp.sp_reduce_scatter")
        return reduce_from_parallel(out, self.comm, "tp.g", fresh=True)
