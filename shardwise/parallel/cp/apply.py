"""Context parallelism on a model: its attention across the cp ranks, its tokens' real positions, its batches cut.

Each of the C ranks of a cp group holds the same parameters and ``S / C``
tokens of every sequence, the head-tail chunks of
:mod:`shardwise.parallel.cp.attention`. Three things change on the model,
and nothing else does (no parameter is added, removed or split, so the
data-parallel wrappers and the checkpoints see the same tensors):

* **attention** (:func:`apply_context_parallel`): shardwise's
  :class:`~shardwise.models.Attention` gets the cp attention as its
  ``attend``; a Hugging Face model's attention modules are switched, through
  transformers' own attention-function registry (``AttentionInterface``), to
  a function that calls it. The projections, the rotary embedding, the
  norms and the MLP run unchanged on the local tokens.
* **positions**: the outermost modules whose forward takes ``position_ids``
  (the whole model, or the pipeline's embedding and block adapters) get a
  forward pre-hook that passes this rank's real positions (the head chunk's
  and then the tail chunk's), so learned position embeddings and RoPE see
  the places the tokens have in the whole sequence.
* **the batch** (:func:`shard_batch`): inputs and targets are cut at the
  same places along the sequence dimension, after the micro-batches are cut.
  Each rank's loss is the mean over its tokens; with equal token counts the
  average over dp x cp (what the data-parallel wrappers do to gradients and
  :func:`~shardwise.fit.steps.global_losses` to losses) is the mean over
  every token of the global batch.

:func:`check_context_parallel` refuses, before any process starts, what
cannot work (no attention it can replace, no way to pass positions, a
sequence that does not split into ``2C`` chunks, heads Ulysses cannot share).
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.data import Kwargs, leaves
from shardwise.models import Attention
from shardwise.parallel.cp.attention import (
    MODES,
    ULYSSES,
    RingWork,
    attention,
    check_sequence,
    check_ulysses_heads,
    local_positions,
    shard_sequence,
)

HF_ATTENTION = "shardwise_cp"  # the name the cp attention is registered under in transformers' registries


@dataclass
class ContextParallel:
    """The cp group and mode one rank's attention modules share, and the work its ring attention counted."""

    comm: Comm
    mode: str
    work: RingWork = field(default_factory=RingWork)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return attention(self.mode, q, k, v, self.comm, scale, self.work)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return local_positions(local_len, self.comm.size, self.comm.rank, device).unsqueeze(0)


# ---- which modules change -------------------------------------------------------------------------
def _is_hf(m: nn.Module) -> bool:
    return type(m).__module__.startswith("transformers.")


def hf_attention_modules(model: nn.Module) -> list[nn.Module]:
    """A Hugging Face model's self-attention modules that dispatch through ``config._attn_implementation``."""
    return [m for m in model.modules() if _is_hf(m) and type(m).__name__.endswith("Attention")
            and hasattr(m, "config") and getattr(m, "is_causal", True)]


def position_takers(model: nn.Module) -> list[nn.Module]:
    """The outermost modules whose forward takes ``position_ids`` (the model, or its pipeline adapters)."""
    out: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        try:
            takes = "position_ids" in inspect.signature(m.forward).parameters
        except (TypeError, ValueError):  # a forward without a signature Python can read
            takes = False
        if takes:
            if all(m is not o for o in out):  # a module shared by two parents gets one hook
                out.append(m)  # it passes positions on to what it calls itself: look no deeper
            return
        for child in m.children():
            walk(child)

    walk(model)
    return out


def _with_positions(cp: ContextParallel, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if kwargs.get("position_ids") is None:
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if x is None:
            raise ValueError(f"context parallel: {type(module).__name__} was called without a tensor input, so "
                             "the positions of its tokens are unknown")
        kwargs["position_ids"] = cp.positions(x.shape[1], x.device)
    return args, kwargs


def _hf_cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, T, d) in, (B, T, H, d) and no weights out."""
    cp: ContextParallel | None = getattr(module, "shardwise_cp", None)
    if cp is None:
        raise RuntimeError(f"{type(module).__name__} uses attn_implementation={HF_ATTENTION!r} but was not "
                           "prepared by shardwise's context parallelism")
    if dropout:
        raise ValueError(f"context parallel: attention dropout ({dropout}) is not supported (the masked "
                         "probabilities are never formed); set the config's attention dropout to 0")
    return cp.attend(query, key, value, scaling).transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def use_hf_attention(modules: list[nn.Module], name: str, fn: Callable[..., Any]) -> None:
    """Switch Hugging Face attention ``modules`` to ``fn``, registered in transformers' attention registry under
    ``name``, with a mask function that builds no mask: a context-parallel attention is causal by construction
    (it knows each chunk's place), where transformers would build a mask for the whole sequence."""
    if not modules:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _no_mask)
    for m in modules:
        m.config._attn_implementation = name  # type: ignore[union-attr]


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> nn.Module:
    """Switch ``model``'s attention to ``cp``'s and pass its tokens' positions, in place (module docstring)."""
    ours = [m for m in model.modules() if isinstance(m, Attention)]
    for m in ours:
        m.attend = cp.attend
    theirs = hf_attention_modules(model)
    for m in theirs:  # type: ignore[assignment]
        m.shardwise_cp = cp  # type: ignore[assignment]
    use_hf_attention(theirs, HF_ATTENTION, _hf_cp_attention)
    if not ours and not theirs:
        raise ValueError(no_attention_message(model))
    for m in position_takers(model):  # type: ignore[assignment]
        m.register_forward_pre_hook(functools.partial(_with_positions, cp), with_kwargs=True)
    return model


# ---- the batch ------------------------------------------------------------------------------------
def shard_batch(x: Any, cp: int, rank: int) -> Any:
    """This cp rank's tokens of a batch: every tensor of two or more dimensions cut along dim 1."""
    if cp == 1:
        return x
    if isinstance(x, torch.Tensor):
        return shard_sequence(x, cp, rank) if x.dim() >= 2 else x
    if isinstance(x, dict):
        if "attention_mask" in x:
            raise ValueError("context parallel: batches with an attention_mask (padding) are not supported; "
                             "pack sequences to the full length instead")
        parts = ((k, shard_batch(v, cp, rank)) for k, v in x.items())
        return Kwargs(parts) if isinstance(x, Kwargs) else dict(parts)
    if isinstance(x, (list, tuple)):
        return type(x)(shard_batch(v, cp, rank) for v in x)
    return x


# ---- before any process starts ------------------------------------------------------------------
def no_attention_message(model: nn.Module) -> str:
    return (f"context parallel: {type(model).__name__} has no attention that shardwise can replace; it needs "
            "shardwise.models.Attention modules (or any module whose attention is its `attend(q, k, v)` "
            "attribute), or a Hugging Face model whose attention goes through transformers' AttentionInterface "
            "(config._attn_implementation); without cp, use sw.Parallel(cp=1)")


def _heads(model: nn.Module) -> tuple[int, int] | None:
    """(query heads, kv heads) of the model's attention, or None when they cannot be read."""
    for m in model.modules():
        if isinstance(m, Attention):
            return m.n_head, m.n_head
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if heads is None:
        return None
    return int(heads), int(getattr(cfg, "num_key_value_heads", None) or heads)


def check_context_parallel(model: nn.Module, cp: int, mode: str | None, tp: int, x: Any) -> None:
    """Refuse a cp layout that cannot work on this model and batch, naming the fix (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"cp_mode={mode!r}: valid are {', '.join(map(repr, MODES))}")
    theirs = hf_attention_modules(model)
    if not theirs and not any(isinstance(m, Attention) for m in model.modules()):
        raise ValueError(no_attention_message(model))
    if not position_takers(model):
        raise ValueError(f"context parallel: {type(model).__name__}.forward takes no position_ids, so a rank "
                         "cannot tell its tokens where they are in the sequence; add a position_ids=None "
                         "argument (the positions of the tokens passed) to its forward")
    if theirs:  # one config for the model's attention modules
        cfg = theirs[0].config
        p = getattr(cfg, "attention_dropout", 0.0) or getattr(cfg, "attn_pdrop", 0.0)
        if p:
            raise ValueError(f"context parallel: attention dropout {p} is not supported; set the config's "
                             "attention dropout to 0")
    if isinstance(x, dict) and "attention_mask" in x:
        shard_batch(x, cp, 0)  # the same refusal the ranks would give, now
    seq = next((t.shape[1] for t in leaves(x) if t.dim() >= 2), None)
    if seq is not None:
        check_sequence(seq, cp)
    heads = _heads(model)
    if mode == ULYSSES and heads is not None:
        q, kv = heads
        if q % tp or kv % tp:
            return  # the tensor-parallel check says what is wrong
        check_ulysses_heads(q // tp, kv // tp, cp)


__all__ = ["ContextParallel", "HF_ATTENTION", "apply_context_parallel", "check_context_parallel",
           "hf_attention_modules", "position_takers", "shard_batch", "use_hf_attention"]
