"""Parameter server: sync equals single-device training, async stays within its staleness bound and
learns as well, exact bytes, and a dead worker is reported by the server."""
from __future__ import annotations

import functools
import os
import random
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import shardwise as sw
from shardwise.commands.verify import accuracy
from shardwise.parallel.ps.module import APPLY, HEADER, PULL, StalenessGate
from shardwise.strategies.ps import ParameterServer
from shardwise.workloads import digits

pytestmark = pytest.mark.timeout(240)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
E = 4  # fp32


def fit(strategy, devices, steps=4, batch=48, work=None, **kw):
    work = work or digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, **kw).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=batch, max_steps=steps)


def numel() -> int:
    return sum(p.numel() for p in digits().make_model().parameters())


def shard_numel(servers: int) -> list[int]:
    base, extra = divmod(numel(), servers)
    return [base + (1 if s < extra else 0) for s in range(servers)]


@pytest.fixture(scope="module")
def reference():
    return fit("single", 1)


# ---- synchronous: the same optimisation as one device -------------------------------------
@pytest.mark.float64
@pytest.mark.parametrize("servers,workers", [(1, 2), (2, 2)])
def test_sync_equals_single_and_bytes_are_exact(reference, same_run, servers, workers):
    E = torch.empty(()).element_size()  # the default dtype's (float64 here), not the module's fp32 one
    steps = 4
    run = fit(ParameterServer(servers=servers), servers + workers, steps=steps)
    same_run(reference, run)
    shards, p = shard_numel(servers), numel()
    for s in run.stats:
        r = s["rank"]
        if r < servers:  # a server: W pushes in (header + its shard), W pulls out
            assert s["role"] == "server" and s["staleness"] == [0] * steps
            assert s["comm_bytes_per_step"] == workers * E * shards[r]
            assert s["comm_received_bytes_per_step"] == workers * (HEADER + E * shards[r])
            # It holds its shard, its gradient and AdamW's two states for the shard only.
            assert s["params_bytes"] == E * shards[r] and s["optimizer_bytes"] == 2 * E * shards[r]
        else:  # a worker: one push to every server, the whole model back
            assert s["role"] == "worker"
            assert s["comm_bytes_per_step"] == servers * HEADER + E * p
            assert s["comm_received_bytes_per_step"] == E * p
            assert s["optimizer_bytes"] == 0


@pytest.mark.float64
def test_sync_sharded_with_clipping_and_accumulation_equals_single(same_run):
    # Clipping needs the norm of the *averaged* gradient over all shards: the servers exchange theirs.
    same_run(fit("single", 1, gradient_clip_val=0.05),
             fit(ParameterServer(servers=2), 5, accumulate_grad_batches=2, gradient_clip_val=0.05))


# ---- asynchronous ---------------------------------------------------------------------------
def _fit_digits(strategy, steps: int):
    work = digits()
    run = sw.Trainer(strategy, 3, accelerator="cpu", progress=False).fit(
        work.make_model(), work.train, work.loss_fn, work.optimizer(), batch_size=work.batch_size, max_steps=steps)
    model = work.make_model()
    model.load_state_dict(run.state_dict)
    return run, accuracy(model, work.test)


def test_async_learns_as_well_as_sync_within_the_staleness_bound():
    # ~18 epochs of the digits example: both settle, so the comparison is not a race.
    steps, bound = 400, 2
    _, sync_acc = _fit_digits(ParameterServer(), steps)
    run, async_acc = _fit_digits(ParameterServer(mode="async", max_staleness=bound), steps)
    server = run.stats[0]
    assert len(server["staleness"]) == 2 * steps  # every push of both workers is one update
    assert max(server["staleness"]) <= bound
    assert sorted(server["applied_by"]) == [0] * steps + [1] * steps
    assert sync_acc > 0.95
    # Async is not deterministic: which update is stale depends on the scheduler. Over 18 runs of
    # this test (2026-11-24, 2-core VM) async scored 0.958-0.981 against sync's 0.981 on the 360 test
    # digits, a gap of at most 0.022 (8 digits; 0.02 failed CI once). 0.04 leaves room for a loaded
    # machine; dropped or over-stale updates are caught exactly by the applied_by/staleness checks.
    assert async_acc >= sync_acc - 0.04, (sync_acc, async_acc)


def test_async_sharded_servers_share_one_update_order():
    steps, servers, workers = 5, 2, 2
    run = fit(ParameterServer(servers=servers, mode="async", max_staleness=1), servers + workers, steps=steps)
    lead, follow = run.stats[0], run.stats[1]
    assert max(lead["staleness"]) <= 1
    # The follower applied the same updates in the same order, so it saw the same staleness.
    assert follow["staleness"] == lead["staleness"] and follow["applied_by"] == lead["applied_by"]
    shards, p, decisions = shard_numel(servers), numel(), 2 * workers * steps
    order = decisions * 16 * (servers - 1) / steps  # the leader's (kind, worker) messages
    assert lead["comm_bytes_per_step"] == workers * E * shards[0] + order
    assert lead["comm_received_bytes_per_step"] == workers * (HEADER + E * shards[0])
    assert follow["comm_received_bytes_per_step"] == workers * (HEADER + E * shards[1]) + order
    for s in run.stats[servers:]:
        assert s["comm_bytes_per_step"] == servers * HEADER + E * p
    assert all(torch.isfinite(v).all() for v in run.state_dict.values())


def _simulate(workers: int, steps: int, bound: int | None, seed: int) -> StalenessGate:
    """Run the gate against workers of very different speeds in simulated time."""
    rng = random.Random(seed)
    speed = [rng.choice([1.0, 1.0, 3.0, 10.0]) for _ in range(workers)]
    gate = StalenessGate(workers, steps, bound)
    busy: dict[int, float] = {}
    now = 0.0

    def follow(decisions: list[tuple[int, int]]) -> None:
        for kind, w in decisions:
            if kind == PULL:
                assert w not in busy
                busy[w] = now + speed[w] * rng.uniform(0.5, 1.5)
            else:
                assert kind == APPLY
        if bound is not None:
            assert len(gate.window) <= bound + 1  # at most s+1 workers hold weights at once

    follow(gate.decide())
    while not gate.done:
        assert busy, f"deadlock: waiting={gate.waiting} arrived={gate.arrived}"
        w = min(busy, key=busy.__getitem__)
        now = busy.pop(w)
        follow(gate.push(w))
    assert len(gate.staleness) == workers * steps
    return gate


@pytest.mark.parametrize("bound", [0, 1, 2, 5])
@pytest.mark.parametrize("workers", [1, 2, 3, 6])
def test_gate_never_exceeds_the_bound_and_never_deadlocks(bound, workers):
    for seed in range(20):
        gate = _simulate(workers, 12, bound, seed)
        assert max(gate.staleness) <= bound
        if bound == 0:
            assert set(gate.staleness) == {0}


def test_unbounded_gate_never_makes_anyone_wait():
    gate = StalenessGate(3, 2, None)
    assert gate.decide() == [(PULL, 0), (PULL, 1), (PULL, 2)]
    assert gate.push(2) == [(APPLY, 2), (PULL, 2)]
    assert gate.push(0) == [(APPLY, 0), (PULL, 0)]
    assert gate.staleness == [0, 1]  # worker 0 pulled version 0 and was applied at version 1


def test_bound_makes_the_fast_worker_wait_for_the_slow_one():
    gate = StalenessGate(2, 10, 1)
    assert gate.decide() == [(PULL, 0), (PULL, 1)]
    assert gate.push(0) == [(APPLY, 0), (PULL, 0)]  # worker 1's window is at 1 now
    assert gate.push(0) == []                       # applying it would make worker 1 two behind
    # Applies go first, so both pull the newest weights.
    assert gate.push(1) == [(APPLY, 1), (APPLY, 0), (PULL, 1), (PULL, 0)]
    assert gate.staleness == [0, 1, 1] and gate.version == 3


# ---- failures are reported, not waited on forever -------------------------------------------
_CALLS = [0]


def _dies_on_rank_2(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _CALLS[0] += 1
    if dist.get_rank() == 2 and _CALLS[0] == 2:
        os._exit(0)  # a silent death: no error report, no barrier, exit code 0
    return F.cross_entropy(out, y)


def _hangs_on_rank_2(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _CALLS[0] += 1
    if dist.get_rank() == 2 and _CALLS[0] == 2:
        time.sleep(120)
    return F.cross_entropy(out, y)


@pytest.mark.parametrize("loss_fn", [_dies_on_rank_2, _hangs_on_rank_2], ids=["dies", "hangs"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_server_names_a_worker_that_dies_or_hangs(loss_fn, mode):
    work = digits()
    # 3 s: the hang is found when the server's wait for that gradient times out (a warm pool's steps take ms)
    trainer = sw.Trainer(ParameterServer(mode=mode), 3, accelerator="cpu", progress=False, timeout_s=3)
    with pytest.raises(Exception, match=r"server rank 0 got no gradient from worker rank 2 \(worker 1\)"):
        trainer.fit(work.make_model(), work.train, loss_fn, ADAMW, batch_size=48, max_steps=4)


# ---- configuration errors ---------------------------------------------------------------------
def test_configuration_errors():
    with pytest.raises(ValueError, match="unknown parameter-server mode 'hogwild'; valid: sync, async"):
        ParameterServer(mode="hogwild")
    with pytest.raises(ValueError, match="max_staleness bounds asynchronous updates; use mode='async' with it"):
        ParameterServer(max_staleness=3)
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -1"):
        ParameterServer(mode="async", max_staleness=-1)
    with pytest.raises(ValueError, match=r"servers=2 needs at least 3 devices \(the servers plus one worker\), "
                                         r"got devices=2"):
        sw.Trainer(ParameterServer(servers=2), 2)
    # The global batch is split over the workers (2 here), not over all 3 processes.
    work = digits()
    with pytest.raises(ValueError, match="batch_size=45 is not divisible by data-parallel size 2"):
        sw.Trainer("ps", 3, accelerator="cpu").fit(work.make_model(), work.train, work.loss_fn, ADAMW,
                                                   batch_size=45, max_steps=1)
    s = ParameterServer(servers=2)
    assert s.processes(5) == 5 and s.batch_shards(5) == 3 and s.sizes(5)["dp"] == 5
