"""Activation checkpointing per block (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

A checkpointed block keeps only its input for backward and recomputes its
forward when backward reaches it (``torch.utils.checkpoint`` without the
reentrant variant, which composes with hooks and autocast). We patch the
block's ``forward`` on the instance rather than wrapping the module, so state
dict keys, tensor-parallel plans and FSDP units keep the model's own names.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def blocks(model: nn.Module, classes: Iterable[type[nn.Module]] | None = None) -> list[nn.Module]:
    """The blocks to checkpoint: instances of ``classes``, or by default every entry of every ModuleList."""
    if classes is not None:
        wanted = tuple(classes)
        return [m for m in model.modules() if isinstance(m, wanted)]
    return [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]


def apply_activation_checkpointing(model: nn.Module,
                                   classes: Iterable[type[nn.Module]] | None = None) -> list[nn.Module]:
    """Checkpoint each block of ``model`` in place; returns the blocks (an empty list is an error)."""
    chosen = blocks(model, classes)
    if not chosen:
        raise ValueError("activation checkpointing found no blocks: the model has no nn.ModuleList of blocks; "
                         "pass the block classes, e.g. activation_checkpointing=(MyBlock,)")
    for b in chosen:
        if getattr(b, "_shardwise_checkpointed", False):
            continue
        b.forward = functools.partial(_checkpointed, b.forward)  # type: ignore[method-assign]
        b._shardwise_checkpointed = True  # type: ignore[assignment]
    return chosen


def saved_activation_bytes(model: nn.Module, *inputs: Any) -> int:
    """Bytes autograd saves for backward during ``model(*inputs)``, parameters excluded.

    Counted through saved-tensor hooks, so it is exactly what the forward keeps
    alive for backward (the quantity activation checkpointing reduces).
    """
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
    del out
    return sum(seen.values())
