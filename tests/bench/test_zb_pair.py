"""The ``zb`` benchmark pair on a tiny MLP: the four contenders train the same thing, torch's zero-bubble schedule
runs our ZB-H1's actions, and our bytes equal the formula.

torch's ``ScheduleInterleavedZeroBubble`` and ``Schedule1F1B`` run in float64 (the stage's example input gives the
dtype), so the pair runs in float64 here and the losses and gradients are compared at 1e-12 (measured: bitwise
equal, here at p = 2 and 4, and in float32 on the benchmark's MLP too; the tolerance only leaves room for a
different summation order).
"""
from __future__ import annotations

import pytest
import torch

from shardwise.bench.pp.mp import mlp
from shardwise.bench.pp.zb import (
    CONTENDERS,
    F1B,
    TORCH_1F1B,
    TORCH_ZB,
    ZB,
    RankResult,
    expected_sent,
    loss_gap,
    our_order,
    paired,
    paired_text,
    run_zb,
    simulated_bubble,
    summarize,
    zb_table,
)

WIDTH, DEPTH, BATCH, M = 32, 4, 16, 8
TOL = 1e-12


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [2, 4])
def test_zb_pair_same_training_same_schedule_bytes_formula(p):
    ranks = run_zb(mlp(WIDTH, DEPTH), p, BATCH, M, reps=1, warmup=1, steps=1, dtype=torch.float64)
    assert len(ranks) == p

    # the same loss and gradients from the same weights on the same batch: ours ZB-H1 against torch's (and the 1F1Bs)
    last = ranks[-1].loss
    assert last[ZB] is not None and all(r.loss[ZB] is None for r in ranks[:-1])
    for key in (TORCH_ZB, F1B, TORCH_1F1B):
        d_loss, d_grad = loss_gap(ranks, key)
        assert d_loss <= TOL * abs(last[ZB]), (key, d_loss)
        assert d_grad <= TOL, (key, d_grad)

    # one stage per rank, torch's zero-bubble schedule runs exactly our zb-h1 (its I is our B); its 1F1B our 1f1b
    order = ranks[0].order
    assert order[TORCH_ZB] == order[ZB] == our_order("zb-h1", p, M)
    assert order[TORCH_1F1B] == order[F1B] == our_order("1f1b", p, M)
    assert simulated_bubble(order[ZB], p) == pytest.approx((p - 1) / (3 * M + p - 1))
    assert simulated_bubble(order[F1B], p) == pytest.approx((p - 1) / (M + p - 1))

    # the activations autograd saves, per rank: ours and torch's hold the same bytes under each schedule
    for res in ranks:
        assert res.saved[ZB] == res.saved[TORCH_ZB] and res.saved[F1B] == res.saved[TORCH_1F1B]
    assert max(res.saved[ZB] for res in ranks) > 0

    # the exact tensor peak of building and training: at least each rank's parameters, gradients and AdamW's two
    # moments; ours never above torch's (it keeps no receive buffers between steps, and no copy of the stage)
    for r, res in enumerate(ranks):
        stage = 4 * (WIDTH * WIDTH + WIDTH) * 8 * DEPTH // p
        for key in (ZB, TORCH_ZB, F1B, TORCH_1F1B):
            assert res.alloc[key] >= stage, (r, key, res.alloc[key], stage)
        assert res.alloc[ZB] <= res.alloc[TORCH_ZB] and res.alloc[F1B] <= res.alloc[TORCH_1F1B], (r, res.alloc)

    # bytes our Comm counted in the timed step: activations forward, their gradients backward, nothing else
    for r, res in enumerate(ranks):
        for key in (ZB, F1B):
            assert res.sent[key] == [expected_sent(r, p, BATCH, WIDTH, elem=8)], (r, key)
    assert summarize(ranks)[ZB]["sent"] == (2 if p > 2 else 1) * BATCH * WIDTH * 8

    assert all(len(r.cpu[k]) == 1 and r.cpu[k][0] > 0 for r in ranks for k in r.cpu)
    assert summarize(ranks)[ZB]["cpu_s"] == pytest.approx(sum(r.cpu[ZB][0] for r in ranks), rel=1e-12)

    table = zb_table(ranks, CONTENDERS, p, M, BATCH, WIDTH, DEPTH, elem=8)
    assert table.row_count == 4
    assert [c.header for c in table.columns][2:4] == ["vs torch ZB", "paired vs torch ZB"]
    wide = zb_table(ranks, CONTENDERS, p, M, BATCH, WIDTH, DEPTH, elem=8, wide_=True)
    assert [c.header for c in wide.columns][3:8] == ["vs torch ZB", "paired vs torch ZB", "vs torch 1F1B",
                                                     "CPU / step", "CPU vs torch ZB"]


@pytest.mark.timeout(10)
def test_paired_ratio_is_per_repetition_of_the_slowest_rank():
    """Each repetition's ratio of the two contenders' slowest-rank step, then its median and quartiles: not the
    ratio of the medians (here 1.5), which a slowdown of the host shared by both in one repetition can move."""
    ours = [[1.0, 2.0, 4.0, 1.0, 1.0], [1.5, 1.0, 1.0, 1.0, 2.0]]     # slowest rank: 1.5 2.0 4.0 1.0 2.0
    theirs = [[3.0, 2.0, 4.4, 1.2, 2.0], [1.0, 3.0, 1.0, 1.0, 2.5]]   # slowest rank: 3.0 3.0 4.4 1.2 2.5
    ranks = [RankResult(times={"a": a, "b": b}) for a, b in zip(ours, theirs)]
    # ratios 2.0 1.5 1.1 1.2 1.25: median 1.25, quartiles (inclusive) 1.2 and 1.5
    assert paired(ranks, "a", "b") == pytest.approx((1.25, 1.2, 1.5), rel=1e-12)
    assert paired_text(ranks, "a", "b") == "1.250x (1.200-1.500)"
    assert paired(ranks, "b", "a") == pytest.approx((0.8, 1 / 1.5, 1 / 1.2), rel=1e-12)
    one = [RankResult(times={"a": [2.0], "b": [3.0]})]
    assert paired(one, "a", "b") == (1.5, 1.5, 1.5)
