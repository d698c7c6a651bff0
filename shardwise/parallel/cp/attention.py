"""Causal attention over a sequence split across the context-parallel (cp) ranks: ring and Ulysses.

**Which tokens a rank holds.** The sequence of S tokens is cut into ``2C``
chunks of ``c = S / 2C`` tokens; cp rank r holds chunks ``r`` and ``2C-1-r``
(head and tail). Under a causal mask a query at position i attends to i+1
keys, so a plain split into C contiguous parts gives the last rank about
``2C-1`` times the first rank's work (its queries see the whole prefix);
pairing a head chunk with its tail chunk gives every rank the same number of
unmasked query-key pairs, ``(2C-1)c^2 + c(c+1)`` per head (Megatron-Core's
context parallelism; :func:`unmasked_pairs` counts both). Ulysses uses the
same split, so the data path is one whatever the mode.

**ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"):
the key/value blocks travel around the cp group in C-1 point-to-point steps,
each transfer posted before the current block's attention is computed, so
it overlaps with it. Each query chunk keeps a running output and its
log-sum-exp; a new block's partial result is merged with
``lse = log(e^lse1 + e^lse2)``, ``o = o1 e^(lse1-lse) + o2 e^(lse2-lse)``
(Milakov & Gimelshein 2018's online softmax). Only the kv heads travel
(grouped-query attention: the group's query heads stay home). Backward runs
the same ring: the blocks go round again, each with the key/value gradient
accumulated so far; after C steps every block's gradient is back on its
owner. Only local tensors (q, k, v, output, lse) are saved, so activation
memory per rank falls as 1/C.

Each step's attention is a single kernel call (:func:`_span`): this rank's
own block is plain causal attention over its 2c local tokens (head then
tail is sequence order), another rank's block a rectangle seen whole (its
head chunk by both query chunks, or both its chunks by the tail chunk). On
CPU the call is PyTorch's flash-attention kernel, which returns the block's
log-sum-exp with its output; backward calls the kernel's backward with the
*merged* output and log-sum-exp, which gives exactly that block's share of
dq, dk, dv. Other devices write the scores out (:func:`_explicit_forward`).
Bytes per rank and layer, element size e and h_kv kv heads of width d:
forward ``2(S/C)·h_kv·d·B·(C-1)·e`` ("cp.kv"); backward the same again plus
``2(S/C)·h_kv·d·B·C·e`` of gradients ("cp.dkv").

**ulysses** (Jacobs et al. 2023, "DeepSpeed Ulysses"): an all-to-all turns
each of q, k, v from a sequence shard of all heads into the whole sequence
of H/C heads; attention runs unchanged on those heads; a second all-to-all
turns the output back. Each all-to-all sends (C-1)/C of the local tensor:
``4(S/C)·H·d·B·(C-1)/C·e`` per rank and layer in forward ("cp.a2a"), as
much in backward. Heads must divide by C; kv heads fewer than C are repeated
up to C (C must then be a multiple of them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from shardwise.comm.collectives import Comm, Handle
from shardwise.torch_private import FLASH_ATTENTION_CPU, FLASH_ATTENTION_CPU_BACKWARD

RING = "ring"
ULYSSES = "ulysses"
MODES = (RING, ULYSSES)


# ---- which tokens a rank holds ---------------------------------------------------------------------
def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) cp rank ``rank`` holds: its head chunk and the matching tail chunk."""
    return rank, 2 * cp - 1 - rank


def local_positions(local_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The places in the whole sequence of the ``local_len`` tokens cp rank ``rank`` holds."""
    c = local_len // 2
    a, b = chunk_ids(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def check_sequence(seq: int, cp: int) -> None:
    """Refuse a sequence that does not cut into the ``2 * cp`` equal chunks the ranks hold, naming the fix."""
    if seq % (2 * cp):
        raise ValueError(f"context parallel: a sequence of {seq} tokens does not split into 2*cp = {2 * cp} equal "
                         f"chunks (each rank holds a head and a tail chunk); use a sequence length divisible "
                         f"by {2 * cp}")


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of ``x`` (its two chunks of ``2 * cp``, along ``dim``)."""
    s = x.shape[dim]
    check_sequence(s, cp)
    c = s // (2 * cp)
    a, b = chunk_ids(cp, rank)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


def join_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every cp rank's tokens (``parts[r]``: rank r's :func:`shard_sequence`), in order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, x in enumerate(parts):
        head, tail = x.chunk(2, dim=dim)
        a, b = chunk_ids(cp, r)
        chunks[a], chunks[b] = head, tail
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def unmasked_pairs(seq: int, cp: int, rank: int, head_tail: bool = True) -> int:
    """Causal query-key pairs cp rank ``rank`` computes for one sequence and one head.

    ``head_tail=False``: the plain split into ``cp`` contiguous parts, for contrast.
    """
    if not head_tail:
        n = seq // cp  # queries r*n .. (r+1)*n - 1, each sees every key up to itself
        return rank * n * n + n * (n + 1) // 2
    c = seq // (2 * cp)
    return sum(a * c * c + c * (c + 1) // 2 for a in chunk_ids(cp, rank))


# ---- blocks ---------------------------------------------------------------------------------------
def _kind(q_chunk: int, k_chunk: int) -> str | None:
    """How a query chunk sees a key chunk: all of it, the causal triangle, or none (a later chunk)."""
    if k_chunk > q_chunk:
        return None
    return "diag" if k_chunk == q_chunk else "full"


@dataclass(frozen=True)
class _Span:
    """A ring step's attention, one call: local query rows against rows of the key/value block held now."""

    rows: slice
    keys: slice
    causal: bool  # the top-left causal triangle (equal, aligned rows and keys); else every key is seen
    pairs: int  # unmasked query-key pairs per sequence and query head


def _span(mine: tuple[int, int], theirs: tuple[int, int], c: int) -> _Span:
    """The blocks (query chunk, key chunk) of one ring step that see anything, as one call.

    On both sides the local order is the sequence order (head chunk, then tail chunk). So this rank's own
    block (the head sees its head causally, the tail sees the head whole and its tail causally, the head
    never sees the tail) is plain causal attention over the 2c local tokens. Another rank's chunks are seen
    whole or not at all, and what is seen is a rectangle: a rank before this one gives its head chunk to
    both query chunks, a rank after it gives both its chunks to the tail chunk only."""
    seen = {(i, j): kind for i, qa in enumerate(mine) for j, kb in enumerate(theirs) if (kind := _kind(qa, kb))}
    pairs = sum(c * c if kind == "full" else c * (c + 1) // 2 for kind in seen.values())
    if "diag" in seen.values():
        assert seen == {(0, 0): "diag", (1, 0): "full", (1, 1): "diag"}, seen
        return _Span(slice(0, 2 * c), slice(0, 2 * c), True, pairs)
    rows, cols = sorted({i for i, _ in seen}), sorted({j for _, j in seen})
    assert len(seen) == len(rows) * len(cols) and rows == list(range(rows[0], rows[-1] + 1)) \
        and cols == list(range(cols[0], cols[-1] + 1)), seen
    return _Span(slice(rows[0] * c, (rows[-1] + 1) * c), slice(cols[0] * c, (cols[-1] + 1) * c), False, pairs)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit stride in its last dim (the CPU kernels read rows by their other strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """kv heads repeated over their query heads' group (the kernels pair query head h with kv head h: older
    kernels assume as many kv heads as query heads)."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _fold_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """The gradient of :func:`_expand_kv`: each kv head's group summed."""
    return x if group == 1 else x.unflatten(1, (x.shape[1] // group, group)).sum(2)


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, Tq, d) queries on (B, H, Tk, d) keys/values alone: its output and log-sum-exp
    (B, H, Tq). On CPU, PyTorch's flash-attention kernel (score tiles stay in cache, never written out);
    elsewhere :func:`_explicit_forward`."""
    if q.device.type != "cpu":
        return _explicit_forward(q, k, v, causal, scale)
    out = FLASH_ATTENTION_CPU(_dense(q), _dense(k), _dense(v), 0.0, causal, scale=scale)
    return out  # type: ignore[no-any-return]


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """One block's share of dq, dk, dv, given the queries' *whole* output ``o`` and log-sum-exp ``lse``
    (over every key, not this block's alone): exp(s - lse) is then the global softmax restricted to this
    block, and sum_d dO O the global row term, so the blocks' shares add up to the exact gradient. On
    CPU the flash kernel's backward; elsewhere :func:`_explicit_backward`."""
    if q.device.type != "cpu":
        return _explicit_backward(do, q, k, v, o, lse, causal, scale)
    grads = FLASH_ATTENTION_CPU_BACKWARD(_dense(do), _dense(q), _dense(k), _dense(v), _dense(o), lse, 0.0, causal,
                                         scale=scale)
    return grads  # type: ignore[no-any-return]


def _causal_mask(s: torch.Tensor) -> torch.Tensor:
    c = s.shape[-1]
    return s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), float("-inf"))


def _explicit_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_block_forward` with the scores written out (any device)."""
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = _causal_mask(s)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _explicit_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """:func:`_block_backward` with the probabilities written out (any device)."""
    s = q @ k.transpose(-1, -2) * scale
    p = torch.exp((_causal_mask(s) if causal else s) - lse.unsqueeze(-1))
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do


@dataclass
class RingWork:
    """What one rank's ring attention computed: unmasked query-key pairs per sequence and query head."""

    pairs: int = 0


class _Ring:
    """The key/value blocks' trip around the cp group: send to the next rank, receive from the previous."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.next, self.prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size

    def start(self, t: torch.Tensor, name: str) -> tuple[torch.Tensor, list[Handle]]:
        """Post the send of ``t`` and the receive of the previous rank's; wait on the handles before use."""
        got = torch.empty_like(t)
        return got, [self.comm.isend(t, self.next, name), self.comm.irecv(got, self.prev, name)]


def _wait(handles: list[Handle]) -> None:
    for h in handles:
        h.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's head-tail chunks against every rank's, by a ring of kv blocks."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, scale: float,
                work: RingWork | None) -> torch.Tensor:
        cp, r = comm.size, comm.rank
        b, h, t, d = q.shape
        group, c = h // k.shape[1], t // 2
        ring = _Ring(comm)
        mine = chunk_ids(cp, r)
        # Laid out (B, T, H, d) like SDPA's output, returned as its (B, H, T, d) view: the model's
        # transpose(1, 2).reshape(B, T, H*d) before the output projection is then a view, and the
        # projection saves this very storage, which is also the one saved here (no second copy).
        out = q.new_empty(b, t, h, d).transpose(1, 2)
        lse: torch.Tensor | None = None  # (B, H, T): the log-sum-exp over the keys seen so far
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            pending: list[Handle] = []
            if step < cp - 1:  # the next block is on its way while this one is computed
                nxt, pending = ring.start(kv, "cp.kv")
            span = _span(mine, chunk_ids(cp, (r - step) % cp), c)
            o, block_lse = _block_forward(q[:, :, span.rows], _expand_kv(kv[0][:, :, span.keys], group),
                                          _expand_kv(kv[1][:, :, span.keys], group), span.causal, scale)
            if lse is None:  # step 0, this rank's own block: every query row sees its first keys here
                out.copy_(o)
                lse = block_lse
            else:  # o = o1 e^(lse1-lse) + o2 e^(lse2-lse), the two weights summing to 1: a lerp, in place
                run_out, run_lse = out[:, :, span.rows], lse[:, :, span.rows]
                new = torch.logaddexp(run_lse, block_lse)
                run_out.lerp_(o, torch.exp(block_lse - new).unsqueeze(-1).to(o.dtype))
                run_lse.copy_(new)
            if work is not None:
                work.pairs += span.pairs
            if pending:
                _wait(pending)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.scale = comm, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, scale = ctx.comm, ctx.scale
        cp, r = comm.size, comm.rank
        group, c = q.shape[1] // k.shape[1], q.shape[2] // 2
        ring = _Ring(comm)
        grad = _dense(grad)
        dq = torch.zeros_like(q)
        mine = chunk_ids(cp, r)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)  # the gradient of the block held now, accumulated by the ranks it has visited
        for step in range(cp):
            pending: list[Handle] = []
            if step < cp - 1:
                nxt, pending = ring.start(kv, "cp.kv")
            span = _span(mine, chunk_ids(cp, (r - step) % cp), c)
            rows, keys = span.rows, span.keys
            dq_b, dk_b, dv_b = _block_backward(
                grad[:, :, rows], q[:, :, rows], _expand_kv(kv[0][:, :, keys], group),
                _expand_kv(kv[1][:, :, keys], group), out[:, :, rows], lse[:, :, rows], span.causal, scale)
            dq[:, :, rows] += dq_b
            dkv[0][:, :, keys] += _fold_kv(dk_b, group)
            dkv[1][:, :, keys] += _fold_kv(dv_b, group)
            # This block's gradient goes on with it (after the last step: home to its owner).
            handles: list[Handle] = []
            if cp > 1:
                dkv, handles = ring.start(dkv.contiguous(), "cp.dkv")
            _wait(pending + handles)
            if step < cp - 1:
                kv = nxt
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, scale: float | None = None,
                   work: RingWork | None = None) -> torch.Tensor:
    """Causal attention of (B, H, T, d) queries and (B, H_kv, T, d) keys/values whose T tokens are this cp
    rank's head-tail chunks; returns (B, H, T, d). ``work`` counts the unmasked pairs computed."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {q.shape[1]} query heads do not group over {k.shape[1]} kv heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, comm, scale, work)  # type: ignore[no-any-return]


# ---- Ulysses -------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """All-to-all over dim 0 (slice i to rank i); its gradient is the same exchange, back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
        ctx.comm, ctx.name = comm, name
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all(out, x, name)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        g = grad.contiguous()
        out = torch.empty_like(g)
        ctx.comm.all_to_all(out, g, ctx.name)
        return out, None, None


def _gathered(cp: int) -> list[int]:
    """The chunks in the order an all-to-all gathers them: rank by rank, each rank's (head, tail)."""
    return [cid for r in range(cp) for cid in chunk_ids(cp, r)]


def _natural_order(cp: int) -> list[int]:
    """Where each chunk of the natural order sits in the rank-by-rank (head, tail) concatenation."""
    gathered = _gathered(cp)
    return [gathered.index(i) for i in range(2 * cp)]


def _seq_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(B, H, T, d), this rank's tokens of every head -> (B, H/C, S, d), every token of its heads, in order."""
    cp = comm.size
    b, h, t, d = x.shape
    parts = _AllToAll.apply(x.reshape(b, cp, h // cp, t, d).transpose(0, 1), comm, "cp.a2a")
    # parts[j]: rank j's tokens (its two chunks) of this rank's heads.
    chunks = parts.permute(1, 2, 0, 3, 4).reshape(b, h // cp, 2 * cp, t // 2, d)
    order = torch.tensor(_natural_order(cp), device=x.device)
    return chunks.index_select(2, order).reshape(b, h // cp, cp * t, d)  # type: ignore[no-any-return]


def _heads_to_seq(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: (B, H/C, S, d) -> (B, H, T, d)."""
    cp = comm.size
    b, hc, s, d = y.shape
    t = s // cp
    order = torch.tensor(_gathered(cp), device=y.device)
    parts = y.reshape(b, hc, 2 * cp, t // 2, d).index_select(2, order).reshape(b, hc, cp, t, d).permute(2, 0, 1, 3, 4)
    back = _AllToAll.apply(parts, comm, "cp.a2a")  # back[j]: this rank's tokens of rank j's heads
    return back.transpose(0, 1).reshape(b, cp * hc, t, d)  # type: ignore[no-any-return]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention by two all-to-alls (sequence shard <-> head shard); shapes as :func:`ring_attention`."""
    cp, heads, kv_heads = comm.size, q.shape[1], k.shape[1]
    check_ulysses_heads(heads, kv_heads, cp)
    if kv_heads < cp:  # each rank needs the kv head of its query heads: repeat them up to one per rank
        k, v = k.repeat_interleave(cp // kv_heads, dim=1), v.repeat_interleave(cp // kv_heads, dim=1)
    qh, kh, vh = (_seq_to_heads(x, comm) for x in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return _heads_to_seq(y, comm)


def check_ulysses_heads(heads: int, kv_heads: int, cp: int) -> None:
    """Ulysses gives each cp rank ``heads / cp`` whole heads: refuse what does not divide, with the fix."""
    if heads % cp:
        raise ValueError(f"cp_mode='ulysses' splits attention heads over the cp ranks: {heads} heads (per tensor-"
                         f"parallel rank) do not divide by cp={cp}; use a cp size that divides {heads}, or "
                         f"cp_mode='ring'")
    if kv_heads % cp and cp % kv_heads:
        raise ValueError(f"cp_mode='ulysses': {kv_heads} kv heads neither divide by cp={cp} nor divide it (fewer kv "
                         f"heads than cp ranks are repeated, which needs cp to be a multiple of them); use a cp "
                         f"size that divides {kv_heads} or is a multiple of it, or cp_mode='ring'")


def attention(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm,
              scale: float | None = None, work: RingWork | None = None) -> torch.Tensor:
    """Causal attention across the cp group by ``mode`` (``"ring"`` or ``"ulysses"``)."""
    if mode == RING:
        return ring_attention(q, k, v, comm, scale, work)
    if mode == ULYSSES:
        return ulysses_attention(q, k, v, comm, scale)
    raise ValueError(f"cp_mode={mode!r}: valid are {', '.join(map(repr, MODES))}")


__all__ = ["MODES", "RING", "RingAttention", "RingWork", "ULYSSES", "attention", "check_sequence",
           "check_ulysses_heads", "chunk_ids", "join_sequence",
           "local_positions", "ring_attention", "shard_sequence", "ulysses_attention", "unmasked_pairs"]
