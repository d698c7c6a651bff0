"""The ``moe`` benchmark pair on a tiny MoE GPT at 2 ranks: its table has every row, and what it counts is exact.

One step (no warm-up) from the initial weights, so the routing the ranks counted is that of the initial model
on their batch, which this process replays (float64, so that the ranks' differently batched expert GEMMs cannot
flip a top-k choice): per rank and MoE layer, the router's expert choices give each expert's load, and from it

* routed slots = k x the rank's tokens, per layer;
* dropped slots = sum over experts of max(0, load_e - C), C = ceil(cf x T x k / E) (per source rank);
* bytes of ``ep_dispatch`` = the kept slots bound for the other rank's experts x n_embd x 8 B, and the
  combine sends back what arrived: over the two ranks, ``ep_combine`` of one is ``ep_dispatch`` of the other;
  backward is each exchange reversed (``ep_dispatch_grad`` = ``ep_combine``, ``ep_combine_grad`` = ``ep_dispatch``).

The model state per rank under ep=2 is the ddp figure less half the expert parameters' bytes, four times
(parameter, gradient, AdamW's two moments).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from shardwise.bench.moe import (
    MoEContender,
    contender_of,
    contenders_for,
    gpt,
    moe_table,
    run_moe,
    samples,
    summarize,
)
from shardwise.comm.collectives import CommStats
from shardwise.models import GPT, GPTConfig
from shardwise.moe import MoE
from shardwise.parallel.ep import ExpertParallel, apply_expert_parallel, expert_parameter_count

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, n_experts=4, top_k=2,
                 moe_intermediate=16, aux_loss_coef=0.01)
SEQUENCES, N = 4, 2
CONTENDERS = (MoEContender(1), MoEContender(2), MoEContender(2, 1.0), MoEContender(2, 1.25))
E = 8  # float64


def replay(model: GPT, x: torch.Tensor, cf: float | None) -> list[torch.Tensor]:
    """Each MoE layer's expert choices (T, k) in one forward of ``x`` on this process, dropping as an ep rank
    does (the capacity is per source rank, so one rank's own tokens decide its drops)."""
    m = copy.deepcopy(model)
    apply_expert_parallel(m, ExpertParallel(None, CommStats(), cf))
    seen: list[torch.Tensor] = []
    for layer in m.modules():
        if isinstance(layer, MoE):
            layer.router.register_forward_hook(lambda _m, _i, out: seen.append(out[2]))
    with torch.no_grad():
        m(x)
    return seen


def expected(indices: list[torch.Tensor], cf: float | None, rank: int) -> tuple[int, int, int]:
    """(routed, dropped, kept slots bound for another rank's experts) of one rank, summed over the layers."""
    routed = dropped = off_rank = 0
    local = TINY.n_experts // N
    for index in indices:
        t, k = index.shape
        load = torch.bincount(index.reshape(-1), minlength=TINY.n_experts)
        c = t * k if cf is None else math.ceil(cf * t * k / TINY.n_experts)
        routed += t * k
        dropped += int((load - c).clamp(min=0).sum())
        kept = load.clamp(max=c)
        off_rank += int(kept.sum() - kept[rank * local:(rank + 1) * local].sum())
    return routed, dropped, off_rank


@pytest.mark.timeout(300)
def test_moe_pair_rows_counts_bytes_and_state():
    model = gpt(TINY).double()
    ranks = run_moe(model, N, SEQUENCES, reps=1, warmup=0, steps=1, contenders=CONTENDERS)
    assert len(ranks) == N
    g = torch.Generator().manual_seed(1234)  # the batch of shardwise.bench.compose.local_batch
    tokens = torch.randint(0, TINY.vocab_size, (SEQUENCES, TINY.block_size + 1), generator=g)
    for r, res in enumerate(ranks):
        x = tokens.chunk(N)[r][:, :-1]
        assert res["ddp"]["tokens"] == x.numel()
        ddp = samples(res, "ddp")[0]
        assert ddp.counters == {}  # nothing goes through the dispatcher under ddp
        assert not any(k.startswith("ep_") for k in ddp.by_name)
        for c in CONTENDERS[1:]:
            s = samples(res, c.key)[0]
            routed, dropped, off_rank = expected(replay(model, x, c.capacity_factor), c.capacity_factor, r)
            assert routed == TINY.n_layer * TINY.top_k * x.numel()
            assert s.counters.get("moe_dispatched") == routed, c.key
            assert s.counters.get("moe_dropped", 0) == dropped, c.key
            assert s.by_name["ep_dispatch"] == off_rank * TINY.n_embd * E, c.key
            assert s.by_name["ep_dispatch_grad"] == s.by_name["ep_combine"], c.key
            assert s.by_name["ep_combine_grad"] == s.by_name["ep_dispatch"], c.key
            other = samples(ranks[1 - r], c.key)[0]
            assert s.by_name["ep_combine"] == other.by_name["ep_dispatch"], c.key
        assert samples(res, "ep2")[0].counters.get("moe_dropped", 0) == 0  # dropless
        # the same first routing: a larger capacity drops no more, and this router's skew makes cf=1.0 drop some
        assert samples(res, "ep2-cf1")[0].counters["moe_dropped"] >= samples(res, "ep2-cf1.25")[0].counters.get(
            "moe_dropped", 0)
    assert sum(samples(res, "ep2-cf1")[0].counters["moe_dropped"] for res in ranks) > 0

    summary = summarize(ranks)
    half_experts = expert_parameter_count(model) // N
    assert summary["ddp"]["state"] - summary["ep2"]["state"] == half_experts * E * 4
    assert summary["ep2"]["dropped"] == 0 and summary["ep2-cf1"]["dropped"] > 0
    assert summary["ep2"]["dispatched"] == TINY.n_layer * TINY.top_k * SEQUENCES * TINY.block_size
    for s in summary.values():
        assert s["step_time_s"] > 0 and s["rss"] >= 0 and s["sent"] > 0
    table = moe_table({N: summary}, TINY, SEQUENCES)
    assert table.row_count == len(CONTENDERS)


def test_contender_keys_round_trip():
    for n in (2, 4):
        for c in contenders_for(n):
            assert contender_of(c.key) == c
    assert [c.key for c in contenders_for(2)] == ["ddp", "ep2", "ep2-cf1", "ep2-cf1.25"]
    assert [c.key for c in contenders_for(4)] == ["ddp", "ep4"]
