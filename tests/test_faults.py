"""Faults become diagnoses: a skipped collective, a mismatched one, bad input; none of them hangs."""
from __future__ import annotations

import functools
import time

import pytest
import torch

import shardwise as sw
from shardwise import launch
from shardwise.comm import collectives
from shardwise.strategy import DDP
from shardwise.topology import Topology
from shardwise.workloads import digits

pytestmark = pytest.mark.timeout(180)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
SKIP_AT_STEP = 2


def skip_one_collective_on_rank1(topo: Topology) -> None:
    """Fault injection: on rank 1, the first collective of step 2 is silently not issued."""
    if topo.rank != 1:
        return
    original = collectives.Comm._issue
    state = {"skipped": False}

    def _issue(self, op, name, tensors, start, async_op, ranks=None):
        if (not state["skipped"] and self.diag is not None and self.diag.step == SKIP_AT_STEP
                and op in ("all_reduce", "all_gather", "reduce_scatter", "send")):
            state["skipped"] = True
            return collectives.Handle(None, name, self.timeout) if async_op else None
        return original(self, op, name, tensors, start, async_op, ranks)

    collectives.Comm._issue = _issue


class SkippingDDP(DDP):
    def setup(self, model, optimizer_fn, topo):
        skip_one_collective_on_rank1(topo)
        return super().setup(model, optimizer_fn, topo)


def _fit(strategy, devices=2, steps=5, timeout_s=6.0, debug=False):
    work = digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, timeout_s=timeout_s, debug=debug).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=steps)


def test_skipped_collective_is_diagnosed_within_the_timeout():
    t0 = time.perf_counter()
    with pytest.raises(Exception) as e:
        _fit(SkippingDDP())
    elapsed = time.perf_counter() - t0
    msg = str(e.value)
    assert "did not complete within 0:00:06" in msg
    assert "where every rank is:" in msg
    assert "rank(s) [1] never arrived at all_reduce 'ddp.bucket0'" in msg
    assert elapsed < 60  # bounded by the timeout, not by a watchdog minutes later


def _mismatch(rank, device):
    topo = Topology.create(device, debug=True)
    comm = topo.comm("dp")
    comm.all_reduce(torch.ones(4), name="grads")
    comm.all_reduce(torch.ones(4 if rank != 1 else 5), name="grads")


def test_debug_mode_names_the_rank_that_differs():
    with pytest.raises(Exception) as e:
        launch.spawn(_mismatch, 3)
    msg = str(e.value)
    assert "collective mismatch at seq 2 on group dp: rank " in msg
    assert "but rank 1 issues all_reduce 'grads' with sizes [[5]] at step -1" in msg or \
        "rank 1 issues all_reduce 'grads' with sizes [[5]] at step -1 but rank 0" in msg


def test_debug_mode_passes_a_correct_run(same_run):
    same_run(_fit("single", 1, steps=3), _fit("ddp", 2, steps=3, debug=True))
