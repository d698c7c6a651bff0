"""Activation checkpointing per block (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

A checkpointed block keeps only its input for backward and recomputes its
forward when backward reaches it (``torch.utils.checkpoint`` without the
reentrant variant, which composes with hooks and autocast). We patch the
block's ``forward`` on the instance rather than wrapping the module, so state
dict keys, tensor-parallel plans and FSDP units keep the model's own names.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
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
        b.forward = functools.partial(_checkpointed, b.forward)
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


def _storage_ptr(t: torch.Tensor) -> int:
    """Address of ``t``'s storage, 0 for a tensor without a plain one (a DTensor, a freed FSDP2 parameter)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class SavedActivations:
    """Live and peak bytes of the distinct storages autograd holds for backward.

    Parameters and the given input tensors are not activations and are left
    out. Parameter storages are looked up at every save, because sharded
    strategies (ZeRO-3/FSDP) refill a parameter's storage on each gather, at a
    new address. A saved tensor is released when autograd drops it (after its
    backward, or when the graph is freed), so ``peak`` is the high-water mark
    of one step, whatever the schedule (pipeline 1F1B interleaves backwards).
    """

    def __init__(self, params: Iterable[torch.Tensor], inputs: Iterable[Any] = ()) -> None:
        # Wrapper tensors (DTensor parameters of torch's FSDP2 and tp) have no plain storage, so they are never
        # an activation's: left out once here, since asking one for its storage raises through DTensor's dispatch
        # (a fifth of a torch FSDP2 step's time when asked at every save).
        self._params = [p for p in params if not isinstance(p, DTensor)]
        self._inputs = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, references]
        self.current = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, DTensor):  # a wrapper (torch's tp saves them): not ours to count, as above
            return t
        try:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            params = {_storage_ptr(p) for p in self._params}
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        if ptr == 0 or ptr in self._inputs or ptr in params:
            return t
        entry = self._live.setdefault(ptr, [s.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        # A detached alias (same storage): a saved *output* (ReLU saves its result) kept as itself would refer
        # back to its own grad_fn, a cycle through autograd's C++ graph that Python's collector cannot break.
        # A plain backward frees it anyway, node by node; a split backward (B, then W) never runs B's nodes
        # again, so the tensor would stay allocated, and counted, after the step.
        return _Held(t.detach(), ptr, self)

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[ptr]


class _Held:
    __slots__ = ("t", "ptr", "owner")

    def __init__(self, t: torch.Tensor, ptr: int, owner: SavedActivations) -> None:
        self.t, self.ptr, self.owner = t, ptr, owner

    def __del__(self) -> None:
        self.owner._release(self.ptr)


@contextlib.contextmanager
def track_saved_activations(params: Iterable[torch.Tensor], inputs: Iterable[Any] = ()) -> Iterator[SavedActivations]:
    """Count what autograd saves for backward inside the block (forward and backward of a step).

    Saved-tensor hooks are innermost-wins: regions that install their own (a
    checkpointed block, a pipeline recorder with ``track_saved``) are counted
    by what those regions save outside themselves.
    """
    counter = SavedActivations(params, inputs)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        yield counter
