"""A CUDA side stream for communication-side work, and nothing at all on other devices.

Why a stream of our own, when NCCL already runs each collective on an internal
stream: the work *around* a collective (pre-dividing a gradient bucket, the
cast to a narrower wire dtype, the copy back, an offloaded shard's
host-to-device copy) is otherwise queued on the compute stream, between
kernels of the backward or forward pass. On a side stream it overlaps them.

The rules (the CUDA caching allocator is per stream):

* the side stream first waits for the compute stream (:meth:`SideStream.enter`),
  so it reads the gradients or weights the compute stream produced;
* a tensor allocated on the compute stream and used on the side stream is
  ``record_stream``-ed, so the allocator does not hand its memory to the
  compute stream again before the side stream is done with it;
* before the compute stream reads anything the side stream wrote (or reuses
  the buffers it sent), it waits for the side stream (:meth:`SideStream.join`).

On CPU (and any non-CUDA device) every method is a no-op and no ``torch.cuda``
function is called: the CPU path is unchanged.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SHARED: dict[tuple[str, str], SideStream] = {}


class SideStream:
    """One CUDA stream beside the compute stream of ``device``; inert unless ``device.type == "cuda"``."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @classmethod
    def shared(cls, device: torch.device, purpose: str) -> SideStream:
        """One side stream per (device, purpose) in this process (every FSDP unit gathers on the same one)."""
        key = (str(device), purpose)
        if key not in _SHARED:
            _SHARED[key] = cls(device)
        return _SHARED[key]

    @property
    def active(self) -> bool:
        return self.stream is not None

    @contextlib.contextmanager
    def enter(self, *used: torch.Tensor) -> Iterator[None]:
        """Run the block on the side stream after the compute stream's work so far; ``used``: compute-stream
        tensors the block reads or writes (kept from reuse until the side stream is done)."""
        if self.stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        for t in used:
            if t.device.type == "cuda":
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """Make the current (compute) stream wait for everything queued on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def pinned_like(t: torch.Tensor, host: torch.device, for_device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``host`` memory; page-locked (pinned) when it will travel to and from a CUDA
    ``for_device``, so ``non_blocking`` copies are truly asynchronous. Elsewhere a plain copy, as before."""
    if host.type == "cpu" and for_device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, device=host, pin_memory=True)
        out.copy_(t)
        return out
    return t.to(host, copy=True)


__all__ = ["SideStream", "pinned_like"]
