"""Weight gradients in memory the pipeline runtime keeps from one optimizer step to the next (CPU).

Why: a training loop that frees its gradients after the optimizer step (``zero_grad(set_to_none=True)``,
torch's default) makes every step allocate them again in its backwards. On CPU those allocations go to
glibc, which hands the top of its heap back to the kernel once more than ``M_TRIM_THRESHOLD`` of it is
free, so the next step's backward touches fresh pages and takes a minor page fault for each 4 KiB. In the
zero-bubble pair at 4 ranks (``shardwise bench --pairs zb``, DualPipeV, 8 x Linear(1024)) that was
1,300-9,500 faults per step per rank, every one in a backward that computes weight gradients or in the
optimizer step; lending each parameter the same tensor in every step cut them to 0-1,100 and the step's
CPU time by 5.6% (benchmarks/README.md). CUDA's caching allocator keeps freed blocks itself, so on a GPU
there is nothing to gain and this is not applied.

What a user sees is a plain backward's behaviour:

* a parameter whose ``.grad`` is None when a step begins is lent its kept tensor, zeroed; autograd then
  accumulates into it in place (``0 + g`` is ``g`` exactly, so results are bit for bit the same);
* a lent tensor that no backward wrote is taken back at the step's end (``.grad`` None again), so an
  optimizer still skips parameters that got no gradient (an expert no token reached, a frozen branch);
* a ``.grad`` that is already set (accumulation over calls, ``zero_grad(set_to_none=False)``) is left alone;
* a kept tensor that anything besides this object still references (a ``.grad`` a user stored before
  clearing it) is never lent again: a fresh one replaces it, so no stored gradient changes under its holder.

Chunks wrapped by a data-parallel wrapper are not lent anything: DDP's buckets, ZeRO-2's freed gradients
and FSDP's flat shards manage that memory themselves (ZeRO-2 sets ``.grad`` to None to save it, which a
kept tensor would defeat). The idea is Megatron-LM's contiguous gradient buffer and DDP's
``gradient_as_bucket_view``; here the tensors stay one per parameter, because the check of "no backward
wrote it" reads each tensor's own version counter, which views of one flat buffer would share.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

__all__ = ["KeptGrads"]


def _refs(kept: dict[torch.Tensor, torch.Tensor], key: torch.Tensor) -> int:
    return sys.getrefcount(kept[key])


def _only_kept() -> int:
    """What :func:`_refs` reads for a value that only the dictionary holds, measured the same way (so the
    comparison holds whatever the interpreter's own temporary references are)."""
    key = torch.empty(0)
    return _refs({key: torch.empty(0)}, key)


_ONLY_KEPT = _only_kept()


class KeptGrads:
    """The tensors lent as ``.grad`` to one pipeline rank's parameters: :meth:`lend` before a step's
    backwards, :meth:`take_back_unused` after them."""

    def __init__(self) -> None:
        self._kept: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> its tensor (tensors hash by identity)
        self._lent: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # parameter, tensor, version when lent

    def lend(self, params: Iterable[torch.Tensor]) -> None:
        """Give every CPU parameter that needs a gradient and has none its kept tensor, zeroed."""
        for p in params:
            if not p.requires_grad or p.grad is not None or p.device.type != "cpu" or p.layout != torch.strided:
                continue
            if p in self._kept and _refs(self._kept, p) > _ONLY_KEPT:
                del self._kept[p]  # read before any local name holds it: someone else still has it
            g = self._kept.get(p)
            if g is None or g.shape != p.shape or g.dtype != p.dtype:
                g = self._kept[p] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                g.zero_()
            p.grad = g
            self._lent.append((p, g, g._version))

    def take_back_unused(self) -> None:
        """After the step's backwards: a lent tensor nothing wrote goes back (``.grad`` None, as a plain
        backward leaves a parameter it did not reach)."""
        for p, g, version in self._lent:
            if p.grad is g and g._version == version:
                p.grad = None
        self._lent.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held between steps."""
        return sum(g.numel() * g.element_size() for g in self._kept.values())

    def clear(self) -> None:
        """Forget every kept tensor (a ``.grad`` now set keeps its own; the rest is freed)."""
        self._kept.clear()
        self._lent.clear()
