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
memory per rank falls as 1/C. Bytes per rank and layer, element size e and
h_kv kv heads of width d: forward ``2(S/C)·h_kv·d·B·(C-1)·e`` ("cp.kv");
backward the same again plus ``2(S/C)·h_kv·d·B·C·e`` of gradients ("cp.dkv").

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


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of ``x`` (its two chunks of ``2 * cp``, along ``dim``)."""
    s = x.shape[dim]
    if s % (2 * cp):
        raise ValueError(f"context parallel: a sequence of {s} tokens does not split into 2*cp = {2 * cp} equal "
                         f"chunks; use a sequence length divisible by {2 * cp}")
    c = s // (2 * cp)
    a, b = chunk_ids(cp, rank)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


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
def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, T, d) queries as (B, kv_heads, H/kv_heads, T, d): each kv head's group of query heads."""
    b, h, t, d = q.shape
    return q.view(b, kv_heads, h // kv_heads, t, d)


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = x.shape[-2] // 2
    return x[..., :c, :], x[..., c:, :]


def _kind(q_chunk: int, k_chunk: int) -> str | None:
    """How a query chunk sees a key chunk: all of it, the causal triangle, or none (a later chunk)."""
    if k_chunk > q_chunk:
        return None
    return "diag" if k_chunk == q_chunk else "full"


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if kind == "diag":
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


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
        cp, r, kvh = comm.size, comm.rank, k.shape[1]
        ring = _Ring(comm)
        qg = _grouped(q, kvh)
        qs = _halves(qg)
        mine = chunk_ids(cp, r)
        out = [torch.zeros_like(x) for x in qs]
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            pending: list[Handle] = []
            if step < cp - 1:  # the next block is on its way while this one is computed
                nxt, pending = ring.start(kv, "cp.kv")
            theirs = chunk_ids(cp, (r - step) % cp)
            ks, vs = _halves(kv[0]), _halves(kv[1])
            for i, qa in enumerate(mine):
                for j, kb in enumerate(theirs):
                    kind = _kind(qa, kb)
                    if kind is None:
                        continue
                    s = _scores(qs[i], ks[j], scale, kind)
                    block_lse = torch.logsumexp(s, dim=-1)
                    o = torch.einsum("bhgqk,bhkd->bhgqd", torch.exp(s - block_lse.unsqueeze(-1)), vs[j])
                    new = torch.logaddexp(lse[i], block_lse)
                    out[i] = out[i] * torch.exp(lse[i] - new).unsqueeze(-1) + o * torch.exp(block_lse - new).unsqueeze(-1)
                    lse[i] = new
                    if work is not None:
                        c = qs[i].shape[-2]
                        work.pairs += c * c if kind == "full" else c * (c + 1) // 2
            if pending:
                _wait(pending)
                kv = nxt
        b, h, t, d = q.shape
        # Laid out (B, T, H, d) like SDPA's output, returned as its (B, H, T, d) view: the model's
        # transpose(1, 2).reshape(B, T, H*d) before the output projection is then a view, and the
        # projection saves this very storage, which is also the one saved here (no second copy).
        o_all = torch.cat(out, dim=-2).reshape(b, h, t, d).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, o_all, torch.cat(lse, dim=-1))
        ctx.comm, ctx.scale = comm, scale
        return o_all

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        comm, scale = ctx.comm, ctx.scale
        cp, r, kvh = comm.size, comm.rank, k.shape[1]
        ring = _Ring(comm)
        qg = _grouped(q, kvh)
        do = _grouped(grad.contiguous(), kvh)
        delta = (do * _grouped(o.contiguous(), kvh)).sum(-1)  # D_i = sum_d dO_id O_id: the softmax's row term
        qs, dos = _halves(qg), _halves(do)
        c = qs[0].shape[-2]
        lses, deltas = (lse[..., :c], lse[..., c:]), (delta[..., :c], delta[..., c:])
        dq = [torch.zeros_like(x) for x in qs]
        mine = chunk_ids(cp, r)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)  # the gradient of the block held now, accumulated by the ranks it has visited
        for step in range(cp):
            pending: list[Handle] = []
            if step < cp - 1:
                nxt, pending = ring.start(kv, "cp.kv")
            theirs = chunk_ids(cp, (r - step) % cp)
            ks, vs = _halves(kv[0]), _halves(kv[1])
            dk, dv = dkv[0], dkv[1]
            for i, qa in enumerate(mine):
                for j, kb in enumerate(theirs):
                    kind = _kind(qa, kb)
                    if kind is None:
                        continue
                    p = torch.exp(_scores(qs[i], ks[j], scale, kind) - lses[i].unsqueeze(-1))
                    sl = slice(j * c, (j + 1) * c)
                    dv[..., sl, :] += torch.einsum("bhgqk,bhgqd->bhkd", p, dos[i])
                    ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", dos[i], vs[j]) - deltas[i].unsqueeze(-1))
                    dq[i] += torch.einsum("bhgqk,bhkd->bhgqd", ds, ks[j]) * scale
                    dk[..., sl, :] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qs[i]) * scale
            # This block's gradient goes on with it (after the last step: home to its owner).
            handles: list[Handle] = []
            if cp > 1:
                dkv, handles = ring.start(dkv.contiguous(), "cp.dkv")
            _wait(pending + handles)
            if step < cp - 1:
                kv = nxt
        dq_all = torch.cat(dq, dim=-2).reshape(q.shape)
        return dq_all, dkv[0], dkv[1], None, None, None


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


def _natural_order(cp: int) -> list[int]:
    """Where each chunk of the natural order sits in the rank-by-rank (head, tail) concatenation."""
    gathered = [cid for r in range(cp) for cid in chunk_ids(cp, r)]
    return [gathered.index(i) for i in range(2 * cp)]


def _seq_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(B, H, T, d), this rank's tokens of every head -> (B, H/C, S, d), every token of its heads, in order."""
    cp = comm.size
    b, h, t, d = x.shape
    parts = _AllToAll.apply(x.reshape(b, cp, h // cp, t, d).transpose(0, 1), comm, "cp.a2a")
    # parts[j]: rank j's tokens (its two chunks) of this rank's heads.
    chunks = parts.permute(1, 2, 0, 3, 4).reshape(b, h // cp, 2 * cp, t // 2, d)
    order = torch.tensor(_natural_order(cp), device=x.device)
    return chunks.index_select(2, order).reshape(b, h // cp, cp * t, d)


def _heads_to_seq(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: (B, H/C, S, d) -> (B, H, T, d)."""
    cp = comm.size
    b, hc, s, d = y.shape
    t = s // cp
    gathered = [cid for r in range(cp) for cid in chunk_ids(cp, r)]
    order = torch.tensor(gathered, device=y.device)
    parts = y.reshape(b, hc, 2 * cp, t // 2, d).index_select(2, order).reshape(b, hc, cp, t, d).permute(2, 0, 1, 3, 4)
    back = _AllToAll.apply(parts, comm, "cp.a2a")  # back[j]: this rank's tokens of rank j's heads
    return back.transpose(0, 1).reshape(b, cp * hc, t, d)


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


__all__ = ["MODES", "RING", "RingAttention", "RingWork", "ULYSSES", "attention", "check_ulysses_heads", "chunk_ids",
           "local_positions", "ring_attention", "shard_sequence", "ulysses_attention", "unmasked_pairs"]
