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

With ``sequence_parallel`` (Korthikanti et al. 2022) the activations between
the pairs are split along the sequence and each all-reduce becomes a
reduce-scatter plus an all-gather (:mod:`shardwise.parallel.tp.sequence_parallel`).

Built-in plans exist for :class:`shardwise.models.GPT` and for Hugging Face
GPT-2 and Llama models. Sharded parameters keep their original names (with a
shard's shape), so :func:`full_state_dict` restores the original keys.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from shardwise.comm import Comm
from shardwise.parallel.clip import clip_global_norm
from shardwise.parallel.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _Shared,
    gather_tensor,
    tp_spec,
)
from shardwise.parallel.tp.plans import (
    STYLES,
    Plan,
    SequenceLayout,
    Style,
    as_style,
    gpt2_plan,
    gpt_plan,
    llama_plan,
    mlp_plan,
    module_pattern,
    plan_for,
    resolve_plan,
)
from shardwise.parallel.tp.sequence_parallel import apply_sequence_parallel, sequence_layout


# ---- applying a plan -----------------------------------------------------------
def apply_tp(model: nn.Module, plan: Plan | dict[str, str | Style] | str | None, comm: Comm,
                keep: Callable[[str], bool] | None = None, sequence_parallel: bool = False) -> nn.Module:
    """Replace the modules ``plan`` names by their tensor-parallel versions, in place.

    ``keep(name)`` limits the change to some modules (a pipeline stage's own);
    every pattern must match at least one module of the whole model.
    ``sequence_parallel``: Megatron sequence parallelism (Korthikanti et al. 2022), where the plan's
    :class:`SequenceLayout` says (see :mod:`shardwise.parallel.tp.sequence_parallel`). The sequence length
    must divide by tp; that is checked at the first forward, where the length is known.
    """
    p = resolve_plan(plan, model)
    layout = sequence_layout(p) if sequence_parallel else None
    if p.check is not None:
        p.check(model, comm.size)
    pats = [(k, module_pattern(k), as_style(v)) for k, v in p.styles.items()]
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
        sp = layout is not None
        if style.kind == "colwise":
            new = ColumnParallelLinear(mod, comm, shared, name, style.gather_output, style.parts, sp)
        elif style.kind == "rowwise":
            new = RowParallelLinear(mod, comm, shared, name, sp)
        else:
            starts_region = layout is not None and any(module_pattern(e).match(name) for e in layout.embeddings)
            new = VocabParallelEmbedding(mod, comm, shared, name, starts_region)  # type: ignore[arg-type]
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
    if layout is not None:
        apply_sequence_parallel(model, layout, comm, keep)
    return model


def _divide_local_attrs(model: nn.Module, local_attrs: dict[str, tuple[str, ...]], tp: int) -> None:
    """Each rank's module attributes that count what tp splits (heads, widths) become the local counts."""
    for pattern, attrs in local_attrs.items():
        rx = module_pattern(pattern)
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
    counts (``elsewhere``), and a tp-replicated parameter only on tp rank 0 (tp slices on every rank).

    Under sequence parallelism a norm weight sees S/t tokens per rank, but its gradient is summed over tp in
    backward (:func:`~shardwise.comm.autograd.all_reduce_grad`), so it is replicated by the time the norm is
    taken and this same rule counts it once."""
    return id(p) not in elsewhere and (tp is None or tp_spec(p) is not None or tp.rank == 0)


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, tp: Comm | None = None,
                    pp: Comm | None = None, count_elsewhere: set[int] | None = None) -> torch.Tensor:
    """Clip by the norm of the gradient of the whole (unsplit) model, the same on every rank.

    tp shards are summed over the tp group; replicated parameters count once
    (tp rank 0); parameters in ``count_elsewhere`` (a tied copy counted on
    another pipeline stage) are scaled but not counted; stages are summed over
    ``pp``. The coefficient is torch's: ``max_norm / (norm + 1e-6)``, at most 1.
    """
    every = list(params)
    ps = [p for p in every if p.grad is not None]
    skip = count_elsewhere or set()
    counted = [p.grad for p in ps if counts_in_norm(p, tp, skip)]
    device = every[0].device if every else torch.device("cpu")
    return clip_global_norm(
        counted,  # type: ignore[arg-type]
        [p.grad for p in ps],  # type: ignore[misc]
        max_norm,
        [(tp, "tp.clip"), (pp, "pp.clip")],
        device,
    )


__all__ = ["Plan", "SequenceLayout", "Style", "STYLES", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "apply_tp", "plan_for", "gpt_plan", "gpt2_plan", "llama_plan", "mlp_plan",
           "gather_state", "clip_grad_norm_", "counts_in_norm", "gather_tensor", "tp_spec"]
