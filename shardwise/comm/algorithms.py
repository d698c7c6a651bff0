"""All-reduce written on point-to-point messages: the naive master algorithm and the ring.

Both run through :class:`~shardwise.comm.Comm` ``isend``/``irecv``, so the bytes
every rank sends and receives are counted exactly (unlike the backend's own
all-reduce, whose wire traffic we can only estimate).

naive
    Every rank sends its tensor to a master, which sums them and sends the
    result back. The master receives and sends (N-1) x S bytes; every other rank
    sends S and receives S. The master's link carries all the traffic, so the
    time grows linearly with N.

ring
    Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters
    of workstations" (J. Parallel Distrib. Comput. 2009), the algorithm behind
    Baidu's ring all-reduce and NCCL's ring: the tensor is cut into N chunks;
    N-1 reduce-scatter steps pass partial sums around the ring until rank r
    holds the full sum of chunk r, then N-1 all-gather steps pass the finished
    chunks around. Every rank sends 2(N-1) chunks, about 2(N-1)/N x S bytes,
    independent of N. Chunks are further cut into segments that are forwarded
    as soon as they are reduced, so consecutive steps overlap (a pipeline).

Exact bytes with uneven chunks: with ``n`` elements of ``e`` bytes, chunk ``i``
has ``c_i = n // N + (1 if i < n % N else 0)`` elements. Rank r sends every
chunk but ``r`` in the reduce-scatter and every chunk but ``r+1`` in the
all-gather, and receives what rank r-1 sends::

    sent_r     = e * (2n - c_r - c_{(r+1) mod N})
    received_r = e * (2n - c_{(r-1) mod N} - c_r)

which is exactly 2(N-1)/N x S when N divides n (:func:`ring_bytes`).

Both functions match the ``fn(tensor, comm, name) -> Handle`` signature that
:class:`~shardwise.parallel.dp.ddp.DDPModule` calls per bucket. They run
synchronously and return a completed handle: DDP then waits on nothing, at
the price of no overlap between these all-reduces and the rest of backward.
:data:`ALGORITHMS` names them ``"naive"`` and ``"ring"`` for ``sw.DDP(allreduce=...)``.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from shardwise.comm.collectives import Comm, Handle

OPS = ("sum", "avg")
SEGMENT_BYTES = 1 << 20  # ring pipeline granularity: big enough to amortise per-message cost


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Elements of each of the ``n`` ring chunks of a tensor of ``numel`` elements (first ones one larger)."""
    base, extra = divmod(numel, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def ring_bytes(numel: int, n: int, element_size: int, rank: int) -> tuple[int, int]:
    """Exact (sent, received) bytes of :func:`ring_allreduce` on ``rank`` of ``n``."""
    if n == 1:
        return 0, 0
    c = chunk_sizes(numel, n)
    sent = 2 * numel - c[rank] - c[(rank + 1) % n]
    received = 2 * numel - c[(rank - 1) % n] - c[rank]
    return sent * element_size, received * element_size


def naive_bytes(numel: int, n: int, element_size: int, rank: int, root: int = 0) -> tuple[int, int]:
    """Exact (sent, received) bytes of :func:`naive_allreduce` on ``rank`` of ``n``."""
    s = numel * element_size
    if n == 1:
        return 0, 0
    return ((n - 1) * s, (n - 1) * s) if rank == root else (s, s)


def _check(t: torch.Tensor, op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown reduction {op!r}; valid: {', '.join(OPS)}")
    if op == "avg" and not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"op='avg' needs a floating-point tensor, got {t.dtype}")


def _flat(t: torch.Tensor) -> torch.Tensor:
    # Work in place on contiguous tensors; others get a contiguous copy that is written back.
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _done(t: torch.Tensor, flat: torch.Tensor, comm: Comm, name: str) -> Handle:
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        t.copy_(flat.view_as(t))
    return Handle(None, name, comm.timeout)


def naive_allreduce(t: torch.Tensor, comm: Comm, name: str, op: str = "sum", root: int = 0) -> Handle:
    """Reduce to group rank ``root`` over point-to-point messages, then send the result back to all.

    The root sums in rank order (its own tensor first), so the result is the
    same bits on every rank. Returns a completed :class:`Handle`.
    """
    _check(t, op)
    n, r = comm.size, comm.rank
    flat = _flat(t)
    if n == 1 or flat.numel() == 0:
        return _done(t, flat, comm, name)
    if r == root:
        others = [q for q in range(n) if q != root]
        # Two receive buffers: the next message lands while the previous one is added.
        bufs = [torch.empty_like(flat), torch.empty_like(flat)]
        pending = comm.irecv(bufs[0], others[0], f"{name}.reduce")
        for i in range(len(others)):
            nxt = comm.irecv(bufs[(i + 1) % 2], others[i + 1], f"{name}.reduce") if i + 1 < len(others) else None
            pending.wait()
            flat.add_(bufs[i % 2])
            if nxt is not None:
                pending = nxt
        if op == "avg":
            flat.div_(n)
        for h in [comm.isend(flat, q, f"{name}.bcast") for q in others]:
            h.wait()
    else:
        comm.isend(flat, root, f"{name}.reduce").wait()
        comm.irecv(flat, root, f"{name}.bcast").wait()
    return _done(t, flat, comm, name)


def ring_allreduce(t: torch.Tensor, comm: Comm, name: str, op: str = "sum",
                   segment_bytes: int = SEGMENT_BYTES) -> Handle:
    """Pipelined ring all-reduce (reduce-scatter, then all-gather) over point-to-point messages.

    Stage s = 0 .. 2N-3 moves one chunk from every rank to its successor.
    Reduce-scatter stage k sends chunk r-1-k and adds the received chunk
    r-2-k into place; after the last one rank r owns the finished chunk r
    (divided by N here for ``op="avg"``, once, so every rank gets the same
    bits). All-gather stage k sends chunk r-k and stores the received chunk
    r-1-k. What a stage receives is exactly what the next stage sends, so each
    segment is forwarded the moment it is ready. Returns a completed handle.
    """
    _check(t, op)
    n, r = comm.size, comm.rank
    flat = _flat(t)
    if n == 1 or flat.numel() == 0:
        return _done(t, flat, comm, name)
    nxt, prv = (r + 1) % n, (r - 1) % n
    sizes = chunk_sizes(flat.numel(), n)
    starts = [sum(sizes[:i]) for i in range(n)]
    seg = max(1, segment_bytes // flat.element_size())
    stages = 2 * (n - 1)

    def send_chunk(s: int) -> int:
        return (r - 1 - s) % n if s < n - 1 else (r - (s - n + 1)) % n

    def recv_chunk(s: int) -> int:
        return (r - 2 - s) % n if s < n - 1 else (r - 1 - (s - n + 1)) % n

    def segments(c: int) -> list[tuple[int, int]]:
        lo, hi = starts[c], starts[c] + sizes[c]
        return [(a, min(a + seg, hi)) for a in range(lo, hi, seg)]

    # Two staging buffers, alternating by stage: stage s+1's receives are posted
    # while stage s is still being consumed.
    stage_buf = [torch.empty(max(sizes), dtype=flat.dtype, device=flat.device) for _ in range(2)]
    sending: dict[int, list[Handle]] = defaultdict(list)  # chunk -> sends still reading it

    def post(s: int) -> list[tuple[int, int, torch.Tensor, Handle]]:
        c, out = recv_chunk(s), []
        for a, b in segments(c):
            buf = stage_buf[s % 2][a - starts[c]:b - starts[c]]
            out.append((a, b, buf, comm.irecv(buf, prv, f"{name}.ring")))
        return out

    c0 = send_chunk(0)
    for a, b in segments(c0):
        sending[c0].append(comm.isend(flat[a:b], nxt, f"{name}.ring"))
    recvs = post(0)
    for s in range(stages):
        following = post(s + 1) if s + 1 < stages else []
        c = recv_chunk(s)
        if s >= n - 1:
            # All-gather overwrites chunk c: sends still reading it must finish first.
            for h in sending.pop(c, []):
                h.wait()
        for a, b, buf, h in recvs:
            h.wait()
            if s < n - 1:
                flat[a:b].add_(buf)
                if s == n - 2 and op == "avg":
                    flat[a:b].div_(n)
            else:
                flat[a:b].copy_(buf)
            if s + 1 < stages:
                sending[c].append(comm.isend(flat[a:b], nxt, f"{name}.ring"))
        recvs = following
    for hs in sending.values():
        for h in hs:
            h.wait()
    return _done(t, flat, comm, name)


# The algorithms DDP can be told to use by name (besides the backend's own, "native").
ALGORITHMS = {"naive": naive_allreduce, "ring": ring_allreduce}

__all__ = ["ALGORITHMS", "OPS", "chunk_sizes", "naive_allreduce", "naive_bytes", "ring_allreduce", "ring_bytes"]
