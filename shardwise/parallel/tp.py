"""Tensor parallelism: every large matrix multiply split across the ranks of the tp group.

The layout is Megatron-LM's (Shoeybi et al. 2019, section 3): in each
transformer block the first linear layer of a pair is *column-parallel* (each
rank owns a slice of the output features, so an elementwise nonlinearity or
whole attention heads can follow without communication) and the second is
*row-parallel* (each rank owns the matching slice of the input features and
produces a partial sum). One all-reduce joins the pair in forward (``g``) and
one in backward (``f``), so a block with attention and an MLP costs two
all-reduces forward and two backward. The embedding is split over the
vocabulary (section 3, "input embedding"), and the output head is
column-parallel with its logits gathered for the loss.

A *plan* says which submodule becomes what, by name pattern (``*`` matches one
path segment)::

    {"blocks.*.attn.q": "colwise", "blocks.*.attn.proj": "rowwise", "tok_emb": "vocab"}

Built-in plans exist for :class:`shardwise.models.GPT` and for Hugging Face
GPT-2 and Llama models. Sharded parameters keep their original names (with a
shard's shape), so :func:`full_state_dict` restores the original keys.
"""
from __future__ import annotations

import math
import re
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from shardwise.comm import Comm
from shardwise.comm.autograd import (
    copy_to_parallel,
    gather_from_parallel,
    reduce_from_parallel,
)
from shardwise.parallel.tp_plans import (
    STYLES,
    Plan,
    Style,
    as_style,
    gpt2_plan,
    gpt_plan,
    llama_plan,
    mlp_plan,
    plan_for,
    resolve_plan,
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
        return mod.nx, mod.nf, True
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
            return F.linear(x, self.weight, bias)
        # Conv1D's own arithmetic (addmm on the flattened input), so the
        # unsplit case reproduces it bit for bit.
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.addmm(bias, x2, self.weight) if bias is not None else x2 @ self.weight
        return y.view(*x.shape[:-1], y.shape[-1])


class ColumnParallelLinear(_TPLinear):
    """Output features split over the tp group; input replicated (Megatron's ``f`` in front).

    With ``gather_output`` the output is all-gathered back to full width.
    """

    def __init__(self, mod: nn.Module, comm: Comm, shared: _Shared, where: str, gather_output: bool = False,
                 parts: int = 1) -> None:
        n_in, n_out, transposed = _linear_shape(mod)
        super().__init__(comm, transposed)
        _check_split(n_out, comm.size, parts, where, "the output size",
                     "a column-parallel layer gives every rank an equal slice of the output features")
        if gather_output and parts > 1:
            raise ValueError(f"tensor parallel: '{where}': gather_output with a fused ({parts}-part) "
                             "projection would interleave the parts")
        self.in_features, self.out_features = n_in, n_out // comm.size
        self.gather_output = gather_output
        self.f = shared.f
        self.weight = shared.shard(mod.weight, 1 if transposed else 0, parts, comm, where)
        self.bias = shared.shard(mod.bias, 0, parts, comm, where) if getattr(mod, "bias", None) is not None \
            else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(self.f(x, self.comm), self.bias)
        return gather_from_parallel(y, self.comm, "tp.gather") if self.gather_output else y


class RowParallelLinear(_TPLinear):
    """Input features split over the tp group; partial outputs summed by Megatron's ``g``.

    The bias is replicated and added after the sum (adding it on every rank
    before the all-reduce would count it tp times).
    """

    def __init__(self, mod: nn.Module, comm: Comm, shared: _Shared, where: str) -> None:
        n_in, n_out, transposed = _linear_shape(mod)
        super().__init__(comm, transposed)
        _check_split(n_in, comm.size, 1, where, "the input size",
                     "a row-parallel layer gives every rank an equal slice of the input features")
        self.in_features, self.out_features = n_in // comm.size, n_out
        self.weight = shared.shard(mod.weight, 0 if transposed else 1, 1, comm, where)
        self.bias = mod.bias if getattr(mod, "bias", None) is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_parallel(self._mm(x, None), self.comm, "tp.g", fresh=True)
        if self.bias is None:
            return y
        # In place where no type promotion is involved (bf16 autocast output + fp32 bias promotes): g saved
        # nothing and the sum is ours alone, so one activation less is allocated per layer.
        return y.add_(self.bias) if y.dtype == self.bias.dtype else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding table split over the tp group (Megatron section 3).

    Each rank looks up the ids in its own row range, writes zeros for the
    others, and ``g`` sums the partial lookups into the full embedding.
    """

    def __init__(self, mod: nn.Embedding, comm: Comm, shared: _Shared, where: str) -> None:
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
        self.weight = shared.shard(mod.weight, 0, 1, comm, where)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.start + self.num_embeddings)
        local = (idx - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_parallel(out, self.comm, "tp.g", fresh=True)


# ---- applying a plan -----------------------------------------------------------
def _pattern(p: str) -> re.Pattern[str]:
    return re.compile("^" + ".".join("[^.]+" if s == "*" else re.escape(s) for s in p.split(".")) + "$")


def parallelize(model: nn.Module, plan: Plan | dict[str, str | Style] | str | None, comm: Comm,
                keep: Callable[[str], bool] | None = None) -> nn.Module:
    """Replace the modules ``plan`` names by their tensor-parallel versions, in place.

    ``keep(name)`` limits the change to some modules (a pipeline stage's own);
    every pattern must match at least one module of the whole model.
    """
    p = resolve_plan(plan, model)
    if p.check is not None:
        p.check(model, comm.size)
    pats = [(k, _pattern(k), as_style(v)) for k, v in p.styles.items()]
    found: dict[str, tuple[nn.Module, Style]] = {}
    hits = {k: 0 for k, _, _ in pats}
    for name, mod in model.named_modules():
        for k, rx, style in pats:
            if rx.match(name):
                if name in found:
                    raise ValueError(f"tensor parallel: module '{name}' matches more than one plan pattern")
                found[name] = (mod, style)
                hits[k] += 1
    missing = [k for k, n in hits.items() if n == 0]
    if missing:
        raise ValueError(f"tensor parallel: plan pattern(s) {missing} match no module of {type(model).__name__}")
    # Every (module, attribute) that holds each parameter, before any module is replaced: a weight
    # tied under another name (a Hugging Face MLM head's decoder bias is also ``predictions.bias``)
    # must become the same shard there too, or that name keeps the full, never-updated tensor.
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for attr, prm in m.named_parameters(recurse=False):
            holders.setdefault(id(prm), []).append((m, attr))
    shared = _Shared()
    for name, (mod, style) in found.items():
        if keep is not None and not keep(name):
            continue
        new: nn.Module
        if style.kind == "colwise":
            new = ColumnParallelLinear(mod, comm, shared, name, style.gather_output, style.parts)
        elif style.kind == "rowwise":
            new = RowParallelLinear(mod, comm, shared, name)
        else:
            new = VocabParallelEmbedding(mod, comm, shared, name)  # type: ignore[arg-type]
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    replaced = {id(mod) for mod, _ in found.values()}
    for pid, (_, shard, _) in shared.made.items():
        for m, attr in holders.get(pid, []):
            if id(m) not in replaced:  # a module left as it was, holding the unsplit tied tensor
                setattr(m, attr, shard)
    _divide_local_attrs(model, p.local_attrs, comm.size)
    if p.fixup is not None:
        p.fixup(model, comm.size)
    return model


def _divide_local_attrs(model: nn.Module, local_attrs: dict[str, tuple[str, ...]], tp: int) -> None:
    """Each rank's module attributes that count what tp splits (heads, widths) become the local counts."""
    for pattern, attrs in local_attrs.items():
        rx = _pattern(pattern)
        mods = [(n, m) for n, m in model.named_modules() if rx.match(n)]
        if not mods:
            raise ValueError(f"tensor parallel: local_attrs pattern '{pattern}' matches no module of "
                             f"{type(model).__name__}")
        for name, mod in mods:
            for attr in attrs:
                value = getattr(mod, attr, None)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"tensor parallel: local_attrs names '{name}.{attr}', which is "
                                     f"{'missing' if value is None else repr(value)}, not an integer count")
                if value % tp:
                    raise ValueError(f"tensor parallel: '{name}.{attr}' is {value}, not divisible by tp={tp} "
                                     f"({value} % {tp} = {value % tp}): every rank must hold an equal share")
                setattr(mod, attr, value // tp)


# ---- whole-model helpers shared with pipeline and composition ---------------------
def gather_state(module: nn.Module, comm: Comm) -> dict[str, torch.Tensor]:
    """``module``'s state dict with every tp shard gathered to full size, on CPU (a collective)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in module.state_dict(keep_vars=True).items():
        spec = tp_spec(v)
        t = gather_tensor(v.detach(), spec[0], spec[1], comm) if spec is not None else v.detach()
        out[k] = t.cpu().clone()
    return out


def counts_in_norm(p: torch.Tensor, tp: Comm | None, elsewhere: set[int]) -> bool:
    """Whether this rank counts ``p``'s gradient in the global norm: not a tied copy another pipeline stage
    counts (``elsewhere``), and a tp-replicated parameter only on tp rank 0 (tp slices on every rank)."""
    return id(p) not in elsewhere and (tp is None or tp_spec(p) is not None or tp.rank == 0)


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, tp: Comm | None = None,
                    pp: Comm | None = None, count_elsewhere: set[int] | None = None) -> torch.Tensor:
    """Clip by the norm of the gradient of the whole (unsplit) model, the same on every rank.

    tp shards are summed over the tp group; replicated parameters count once
    (tp rank 0); parameters in ``count_elsewhere`` (a tied copy counted on
    another pipeline stage) are scaled but not counted; stages are summed over
    ``pp``. The coefficient is torch's: ``max_norm / (norm + 1e-6)``, at most 1.
    """
    from shardwise.parallel.sharding import clip_global_norm

    every = list(params)
    ps = [p for p in every if p.grad is not None]
    skip = count_elsewhere or set()
    counted = [p.grad for p in ps if counts_in_norm(p, tp, skip)]
    device = every[0].device if every else torch.device("cpu")
    return clip_global_norm(counted, [p.grad for p in ps], max_norm,  # type: ignore[misc]
                            [(tp, "tp.clip"), (pp, "pp.clip")], device)


__all__ = ["TP", "Plan", "Style", "STYLES", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "parallelize", "plan_for", "gpt_plan", "gpt2_plan", "llama_plan", "mlp_plan", "gather_state",
           "clip_grad_norm_", "counts_in_norm", "shard_tensor", "gather_tensor", "tp_spec"]
