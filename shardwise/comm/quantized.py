"""The mean of tensors over a group, started now and finished later, sent at full or at a quantized precision.

:func:`start_mean` averages tensors in place over a :class:`~shardwise.comm.collectives.Comm` (one flat buffer per
dtype) and returns the callable that finishes it, so that inner steps can run while it is in flight.

Unquantized, it is one all-reduce: ``2 (N - 1) / N`` of the bytes per rank, the ring's count.

Quantized (``"bf16"`` or ``"int8"``), it runs on any backend (gloo included) as a reduce-scatter then an
all-gather, both in the quantized domain:

1. every rank quantizes its whole buffer, cut into N equal chunks, and an all-to-all gives rank i every rank's
   chunk i (``(N - 1) / N`` of the quantized bytes out);
2. rank i dequantizes those N chunks, averages them in the buffer's own dtype, quantizes the mean, and an
   all-gather gives every rank every chunk's quantized mean (``(N - 1) / N`` again); every rank dequantizes it.

So a quantized mean sends ``2 (N - 1) / N`` of the quantized bytes: the ring all-reduce's factor on the quantized
element. Every rank ends with the same values (all dequantize the same bits). The buffer is padded with zeros to
a whole number of chunks (and of int8 blocks), and the padding is sent and counted.

The two encodings (round to nearest), with u = 2^-8 and A the largest magnitude of an int8 block:

- ``"bf16"``: 16 bits an element; an element's error is at most u of its magnitude (normal bfloat16 range);
- ``"int8"``: 8 bits an element, plus one float32 scale per block of :data:`INT8_BLOCK` elements (the scales are
  sent and counted); the scale is A / 127 (rounded up to a float32), an element's error at most half of it.

Two roundings touch a mean (each rank's input, then the mean of the dequantized inputs), so an element of the mean
is off by at most ``(2 u + u²) · mean_r |x_r|`` under bf16, and by at most
``(1 / 127) · (1 + 1 / 508) · mean_r A_r`` (``A_r``: rank r's block maximum; ``(1 + 2^-23)`` for the scale's
rounding aside) under int8. A quantization that cannot run raises; nothing falls back to full precision.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from shardwise.comm.collectives import Comm, Handle

QUANTIZE = ("bf16", "int8")
INT8_BLOCK = 64  # elements per int8 scale
_SCALE = torch.float32
SCALE_BYTES = 4  # a float32 scale per int8 block


def element_bytes(quantize: str | None, itemsize: int) -> float:
    """Bytes sent per element of ``itemsize`` bytes under ``quantize`` (int8's share of its block's scale
    included)."""
    if quantize is None:
        return float(itemsize)
    return 2.0 if quantize == "bf16" else 1.0 + SCALE_BYTES / INT8_BLOCK


def refusal(quantize: str | None, dtype: torch.dtype) -> str | None:
    """Why ``quantize`` cannot send ``dtype`` tensors in fewer bits, or None when it can."""
    if quantize is None:
        return None
    if quantize not in QUANTIZE:
        return f"quantize={quantize!r} must be None, 'bf16' or 'int8'"
    if not dtype.is_floating_point:
        return f"quantize={quantize!r} cannot quantize {dtype} tensors (floating point only)"
    own = dtype.itemsize
    if element_bytes(quantize, own) >= own:
        return (f"quantize={quantize!r} cannot shrink {dtype} tensors ({8 * own} bits an element); "
                "use quantize=None or a narrower encoding")
    return None


def padded(numel: int, ranks: int, quantize: str | None) -> int:
    """``numel`` rounded up to whole chunks over ``ranks`` (each a whole number of int8 blocks)."""
    unit = ranks * (INT8_BLOCK if quantize == "int8" else 1)
    return -(-numel // unit) * unit


def encode(x: torch.Tensor, quantize: str) -> torch.Tensor:
    """Rows of ``x`` (k, m) as rows of bytes (k, b): bf16 bits, or int8 values then their blocks' float32 scales."""
    if quantize == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    k, m = x.shape
    blocks = x.reshape(k, m // INT8_BLOCK, INT8_BLOCK)
    top = blocks.abs().amax(-1).double()
    scale = (top / 127).to(_SCALE)
    # Rounded up, so |x| / scale <= 127 and no value is clamped.
    scale = torch.where(scale.double() * 127 < top, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
    q = torch.round(blocks.double() / safe[..., None]).to(torch.int8)
    return torch.cat([q.reshape(k, m).view(torch.uint8), scale.view(torch.uint8).reshape(k, -1)], dim=1)


def decode(b: torch.Tensor, quantize: str, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`encode`: rows of bytes (k, b) as rows of ``dtype`` values (k, m)."""
    if quantize == "bf16":
        return b.contiguous().view(torch.bfloat16).to(dtype)
    k, width = b.shape
    m = width * INT8_BLOCK // (INT8_BLOCK + _SCALE.itemsize)
    q = b[:, :m].contiguous().view(torch.int8).reshape(k, m // INT8_BLOCK, INT8_BLOCK)
    scale = b[:, m:].contiguous().view(_SCALE).reshape(k, m // INT8_BLOCK, 1)
    return (q.to(dtype) * scale.to(dtype)).reshape(k, m)


def start_mean(comm: Comm, tensors: list[torch.Tensor], name: str,
               quantize: str | None = None) -> Callable[[], None]:
    """Start averaging ``tensors`` in place over ``comm``; the returned callable finishes it (call it once, on
    every rank at the same point). One flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    finishers = [_start_flat(comm, ts, name, quantize) for ts in by_dtype.values()]

    def finish() -> None:
        for f in finishers:
            f()
    return finish


def _start_flat(comm: Comm, ts: list[torch.Tensor], name: str, quantize: str | None) -> Callable[[], None]:
    flat = torch.cat([t.detach().reshape(-1) for t in ts])
    finished = _start_plain(comm, flat, name) if quantize is None else _start_quantized(comm, flat, name, quantize)

    def finish() -> None:
        finished()
        with torch.no_grad():
            for t, piece in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(piece.view_as(t))
    return finish


def _start_plain(comm: Comm, flat: torch.Tensor, name: str) -> Callable[[], None]:
    handle = comm.all_reduce(flat, name=name, async_op=True)

    def finish() -> None:
        assert handle is not None  # started with async_op=True
        handle.wait()
        flat.div_(comm.size)
    return finish


def _start_quantized(comm: Comm, flat: torch.Tensor, name: str, quantize: str) -> Callable[[], None]:
    """Stage 1 started: this rank's encoded chunks on their way to their owners."""
    why = refusal(quantize, flat.dtype)
    if why is not None:
        raise ValueError(why)
    n = comm.size
    full = torch.zeros(padded(flat.numel(), n, quantize), dtype=flat.dtype, device=flat.device)
    full[:flat.numel()] = flat
    mine = encode(full.reshape(n, -1), quantize)
    theirs = torch.empty_like(mine)
    handle = comm.all_to_all(theirs, mine, name=name, async_op=True)

    def finish() -> None:
        flat.copy_(_gather_mean(comm, handle, theirs, quantize, flat, name))
    return finish


def _gather_mean(comm: Comm, handle: Handle | None, theirs: torch.Tensor, quantize: str, flat: torch.Tensor,
                 name: str) -> torch.Tensor:
    """Stage 2: this rank's chunk averaged and quantized again, gathered from every rank, dequantized."""
    assert handle is not None  # started with async_op=True
    handle.wait()
    n = comm.size
    chunk = decode(theirs, quantize, flat.dtype).sum(0) / n
    mine = encode(chunk.reshape(1, -1), quantize).reshape(-1)
    every = torch.empty(n * mine.numel(), dtype=torch.uint8, device=flat.device)
    comm.all_gather(every, mine, name=name)
    return decode(every.reshape(n, -1), quantize, flat.dtype).reshape(-1)[:flat.numel()]


__all__ = ["INT8_BLOCK", "QUANTIZE", "SCALE_BYTES", "decode", "element_bytes", "encode", "padded", "refusal",
           "start_mean"]
