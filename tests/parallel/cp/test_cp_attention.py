"""Ring and Ulysses attention against causal attention on the whole sequence: values, gradients, work, bytes.

Every cp rank holds its head-tail chunks of q, k, v; the outputs and the
gradients of q, k and v, put back in sequence order, must equal those of
``F.scaled_dot_product_attention(is_causal=True)`` on one process (float64:
only rounding differs). The bytes each rank sends are counted by ``Comm`` and
compared with the formulas of :mod:`shardwise.parallel.cp.attention`.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from shardwise import launch
from shardwise.comm.collectives import Comm, CommStats
from shardwise.comm.topology import Topology
from shardwise.dims import CP, ParallelDims
from shardwise.parallel.cp.attention import (
    RingWork,
    _block_backward,
    _block_forward,
    _explicit_backward,
    _explicit_forward,
    _span,
    attention,
    check_ulysses_heads,
    chunk_ids,
    local_positions,
    shard_sequence,
    unmasked_pairs,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.float64]

B, S, D = 2, 16, 8


def _inputs(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, heads, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, heads, S, D, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _reference(q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _check(rank: int, device: torch.device, mode: str, heads: int, kv_heads: int) -> None:
    topo = Topology.create(device, ParallelDims(cp=dist.get_world_size()))
    comm = topo.comm(CP)
    cp, r = comm.size, comm.rank
    q, k, v, dout = _inputs(heads, kv_heads)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout)
    mine = [shard_sequence(t, cp, r, dim=2).clone().requires_grad_() for t in (q, k, v)]
    work = RingWork()
    out = attention(mode, *mine, comm, work=work)
    forward = topo.stats.sent
    out.backward(shard_sequence(dout, cp, r, dim=2))
    backward = topo.stats.sent - forward
    for got, want, what in [(out, ref_out, "out"), (mine[0].grad, ref_dq, "dq"), (mine[1].grad, ref_dk, "dk"),
                            (mine[2].grad, ref_dv, "dv")]:
        torch.testing.assert_close(got.detach(), shard_sequence(want, cp, r, dim=2), rtol=1e-10, atol=1e-12,
                                   msg=f"{mode} cp={cp} rank {r}: {what}")
    assert topo.stats.received == topo.stats.sent
    assert topo.stats.by_group == {CP: forward + backward}
    e = 8  # float64
    if mode == "ring":
        assert work.pairs == unmasked_pairs(S, cp, r)  # per sequence and head
        block = (S // cp) * kv_heads * D * B * e  # one of k, v: this rank's tokens of every kv head
        assert forward == 2 * block * (cp - 1)
        assert backward == 2 * block * (cp - 1) + 2 * block * cp  # the blocks again, and their gradients home
    else:
        reps = max(1, cp // kv_heads)
        q_bytes = B * heads * (S // cp) * D * e
        kv_bytes = B * kv_heads * reps * (S // cp) * D * e
        assert forward == (2 * q_bytes + 2 * kv_bytes) * (cp - 1) // cp  # q, k, v in, the output back
        assert backward == forward
    topo.close()


@pytest.mark.parametrize("mode,cp,heads,kv_heads", [
    ("ring", 2, 4, 4), ("ring", 4, 4, 2), ("ring", 2, 4, 1),
    ("ulysses", 2, 4, 4), ("ulysses", 2, 4, 2), ("ulysses", 4, 4, 2), ("ulysses", 4, 8, 1),
])
def test_equals_causal_attention_on_the_whole_sequence(mode, cp, heads, kv_heads):
    launch.spawn(_check, cp, args=(mode, heads, kv_heads))


def test_head_tail_chunks_balance_the_causal_work():
    for cp in (2, 4, 8):
        seq = 64 * cp
        balanced = [unmasked_pairs(seq, cp, r) for r in range(cp)]
        assert len(set(balanced)) == 1
        c = seq // (2 * cp)
        assert balanced[0] == (2 * cp - 1) * c * c + c * (c + 1)
        # All ranks together compute exactly the causal triangle of the whole sequence.
        assert sum(balanced) == seq * (seq + 1) // 2
        plain = [unmasked_pairs(seq, cp, r, head_tail=False) for r in range(cp)]
        assert sum(plain) == seq * (seq + 1) // 2
        n = seq // cp
        assert plain[-1] / plain[0] == ((cp - 1) * n * n + n * (n + 1) / 2) / (n * (n + 1) / 2)
        assert round(plain[-1] / plain[0]) == 2 * cp - 1  # about 2C-1 times the first rank's work


def test_positions_and_shards_agree():
    x = torch.arange(16).reshape(1, 16)
    for r in range(4):
        assert torch.equal(shard_sequence(x, 4, r)[0], local_positions(4, 4, r))
    assert shard_sequence(x, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(x, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    with pytest.raises(ValueError, match=r"a sequence of 16 tokens does not split into 2\*cp = 6 equal chunks "
                                         r"\(each rank holds a head and a tail chunk\); use a sequence length "
                                         r"divisible by 6$"):
        shard_sequence(x, 3, 0)


def test_ulysses_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match=r"6 heads \(per tensor-parallel rank\) do not divide by cp=4"):
        check_ulysses_heads(6, 6, 4)
    with pytest.raises(ValueError, match=r"3 kv heads neither divide by cp=2 nor divide it"):
        check_ulysses_heads(6, 3, 2)
    check_ulysses_heads(8, 2, 4)  # 2 kv heads, each repeated twice


def test_each_ring_step_is_one_call_over_exactly_the_causal_pairs():
    """Per step, the one span (query rows x key rows, causal or whole) is exactly where a local query's
    position is at or after a held key's, and counts those pairs."""
    c = 3
    for cp in range(1, 7):
        for r in range(cp):
            queries = local_positions(2 * c, cp, r)
            total = 0
            for step in range(cp):
                src = (r - step) % cp
                want = local_positions(2 * c, cp, src)[None, :] <= queries[:, None]
                span = _span(chunk_ids(cp, r), chunk_ids(cp, src), c)
                got = torch.zeros(2 * c, 2 * c, dtype=torch.bool)
                got[span.rows, span.keys] = True
                if span.causal:
                    got &= torch.ones(2 * c, 2 * c, dtype=torch.bool).tril()
                assert torch.equal(got, want), (cp, r, step)
                assert span.pairs == int(want.sum())
                total += span.pairs
            assert total == unmasked_pairs(2 * c * cp, cp, r)


def test_block_shares_from_the_merged_lse_add_up_to_the_gradient():
    """Two key blocks' forwards merged by log-sum-exp give the whole attention, and each block's backward
    with the merged output and lse is its share of the gradient: CPU kernel and explicit scores alike."""
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64) for n in (6, 9, 9, 6))
    scale = 0.4
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = torch.ones(6, 9, dtype=torch.bool).tril(3)  # keys 0..2 whole, keys 3..8 causal to queries 0..5
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, attn_mask=mask, scale=scale)
    ref.backward(do)
    blocks = [(slice(0, 3), False), (slice(3, 9), True)]
    for fwd, bwd in ((_block_forward, _block_backward), (_explicit_forward, _explicit_backward)):
        parts = [fwd(q, k[:, :, keys], v[:, :, keys], causal, scale) for keys, causal in blocks]
        lse = torch.logaddexp(parts[0][1], parts[1][1])
        out = sum(o * torch.exp(part_lse - lse).unsqueeze(-1) for o, part_lse in parts)
        torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for keys, causal in blocks:
            a, b, c = bwd(do, q, k[:, :, keys], v[:, :, keys], out, lse, causal, scale)
            dq += a
            dk[:, :, keys], dv[:, :, keys] = b, c
        for got, want in ((dq, ref_q.grad), (dk, ref_k.grad), (dv, ref_v.grad)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_one_rank_ring_takes_any_strides_and_lays_its_output_out_as_sdpa():
    """On a one-rank group the ring is one causal call: inputs whose last dim is strided, grouped kv heads
    and an expanded incoming gradient (``out.sum().backward()``) give SDPA's values and gradients."""
    q, k, v, _ = _inputs(4, 2)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, torch.ones_like(q))
    mine = [t.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_() for t in (q, k, v)]
    assert mine[0].stride(-1) != 1
    work = RingWork()
    out = attention("ring", *mine, Comm(None, CommStats()), work=work)
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H, d) storage, as CPU SDPA's output
    out.sum().backward()
    assert work.pairs == S * (S + 1) // 2
    for got, want in ((out.detach(), ref_out), (mine[0].grad, ref_dq), (mine[1].grad, ref_dk), (mine[2].grad, ref_dv)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
