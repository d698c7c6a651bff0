"""The ``zb`` pair's V half on a tiny MLP: ours ZBV and DualPipeV against torch's ScheduleZBVZeroBubble and
ScheduleDualPipeV, same V cut, same batch and micro-batches, in float64 (torch's stages take the dtype of their
example input): the same actions, the same loss and gradients, and our bytes equal the formula."""
from __future__ import annotations

import pytest
import torch

from shardwise.bench.pp.mp import mlp
from shardwise.bench.pp.zb import loss_gap, run_zb, summarize
from shardwise.bench.pp.zbv import (
    DPV,
    TORCH_DPV,
    TORCH_ZBV,
    V_CONTENDERS,
    ZBV,
    expected_sent_v,
    simulated_bubble_v,
    split_order,
    v_order,
    zbv_table,
)

WIDTH, DEPTH, BATCH, M = 32, 8, 16, 8
TOL = 1e-12


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [2, 4])
def test_zbv_pair_same_training_same_schedule_bytes_formula(p):
    ranks = run_zb(mlp(WIDTH, DEPTH), p, BATCH, M, reps=1, warmup=1, steps=1, dtype=torch.float64,
                   contenders=V_CONTENDERS)
    assert len(ranks) == p
    first = ranks[0].loss  # rank 0 holds the last virtual stage: the loss is computed there
    assert first[ZBV] is not None and all(r.loss[ZBV] is None for r in ranks[1:])
    for key in (TORCH_ZBV, DPV, TORCH_DPV):
        d_loss, d_grad = loss_gap(ranks, key, ZBV, loss_rank=0)
        assert d_loss <= TOL * abs(first[ZBV]), (key, d_loss)
        assert d_grad <= TOL, (key, d_grad)

    order = ranks[0].order
    # the same actions in the same order as torch's; ours runs more of the backwards whole (BW)
    assert order[ZBV] == v_order("zbv", p, M) and order[DPV] == v_order("dualpipev", p, M)
    assert split_order(order[TORCH_ZBV]) == split_order(order[ZBV])
    assert split_order(order[TORCH_DPV]) == split_order(order[DPV])
    assert sum(o.count("BW") for o in order[TORCH_ZBV]) == 0 < sum(o.count("BW") for o in order[ZBV])
    assert sum(o.count("BW") for o in order[TORCH_DPV]) < sum(o.count("BW") for o in order[DPV])
    for key in (ZBV, DPV):
        assert simulated_bubble_v(order[key], p) == pytest.approx((p - 1) / (6 * M + p - 1))

    # the exact tensor peak (parameters, gradients, AdamW's moments at least): ours never above torch's
    for r, res in enumerate(ranks):
        stage = 4 * (WIDTH * WIDTH + WIDTH) * 8 * DEPTH // p
        assert min(res.alloc.values()) >= stage, (r, res.alloc, stage)
        assert res.alloc[ZBV] <= res.alloc[TORCH_ZBV] and res.alloc[DPV] <= res.alloc[TORCH_DPV], (r, res.alloc)

    for r, res in enumerate(ranks):
        for key in (ZBV, DPV):
            assert res.sent[key] == [expected_sent_v(r, p, BATCH, WIDTH, elem=8)], (r, key)
    assert summarize(ranks)[ZBV]["sent"] == (4 if p > 2 else 2) * BATCH * WIDTH * 8
    # CPU per step: one figure per repetition and rank, summed over the ranks
    assert all(len(r.cpu[k]) == 1 and r.cpu[k][0] > 0 for r in ranks for k in r.cpu)
    assert summarize(ranks)[DPV]["cpu_s"] == pytest.approx(sum(r.cpu[DPV][0] for r in ranks), rel=1e-12)
    assert zbv_table(ranks, p, M, BATCH, WIDTH, DEPTH, elem=8).row_count == 4
