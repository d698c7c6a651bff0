"""Fault tolerance refuses, before any process starts, what it cannot survive; and its sample shards are exact.

No process is started here: every refusal comes from ``sw.Trainer(...)``.
"""
from __future__ import annotations

import random

import pytest

import shardwise as sw
from shardwise.ft.shards import assignment

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("strategy, devices, kw, message", [
    ("ddp", 3, {"fault_tolerance": sw.FaultTolerance(min_replicas=4)},
     "FaultTolerance(min_replicas=4) is above the 3 replica groups of strategy 'ddp' on 3 processes: the run "
     "could not even start"),
    ("ddp", 2, {"fault_tolerance": sw.FaultTolerance(timeout_s=0.5)},
     "FaultTolerance(timeout_s=0.5) is below 1.0 s, the least in which the launcher tells a stopped rank from a "
     "busy one (a rank beats every 0.25 s)"),
    ("ddp", 2, {"fault_tolerance": sw.FaultTolerance(timeout_s=30.0), "timeout_s": 20.0},
     "FaultTolerance(timeout_s=30.0) must be below "
     "Trainer(timeout_s=20), how long a collective waits: the launcher "
     "must find a stopped rank before its peers give up waiting for it"),
    ("zero2", 2, {"fault_tolerance": True},
     "fault_tolerance cannot run strategy 'zero2': zero=2 shards the optimizer state over every rank, so a dead "
     "rank's shard of the optimizer state exists nowhere else; keep replicas: strategy='ddp', 'hsdp', or "
     "sw.Parallel(dp=, replicate=R, zero=3)"),
    ("fsdp", 2, {"fault_tolerance": True},
     "fault_tolerance cannot run strategy 'fsdp': zero=3 shards the optimizer state over every rank, so a dead "
     "rank's shard of the optimizer state exists nowhere else; keep replicas: strategy='ddp', 'hsdp', or "
     "sw.Parallel(dp=, replicate=R, zero=3)"),
    ("tp", 2, {"fault_tolerance": True},
     "fault_tolerance cannot run strategy 'tp': it splits the "
     "model over every rank (tp=2), so a dead rank's part "
     "of the model exists nowhere else; add data-parallel replicas"),
    ("ps", 3, {"fault_tolerance": True},
     "fault_tolerance cannot run strategy 'ps': its server ranks hold the only copy of the model and optimizer "
     "state, so a dead server's share exists nowhere else; use strategy='ddp'"),
    ("ddp", 2, {"fault_tolerance": True, "engine": "torch"},
     "fault_tolerance cannot run strategy 'ddp': under engine='torch' PyTorch's DDP and FSDP own the reduction, "
     "which cannot leave out a dead replica; use engine='shardwise'"),
    ("ddp", 2, {"sample_ledger": "ledger.jsonl"},
     "sample_ledger= records which replica group computed which samples of each step: it needs "
     "fault_tolerance=True (or sw.FaultTolerance(...))"),
])
def test_refused_before_start(strategy, devices, kw, message):
    with pytest.raises(ValueError) as e:
        sw.Trainer(strategy, devices, accelerator="cpu", **kw)
    assert str(e.value) == message


def test_groups_of_several_ranks_that_split_the_model_are_refused_with_the_reason():
    with pytest.raises(ValueError) as e:
        sw.Trainer(sw.Parallel(dp=2, tp=2), 4, accelerator="cpu", fault_tolerance=True)
    assert str(e.value) == ("fault_tolerance cannot run strategy 'parallel': its replica groups of 2 ranks split the "
                            "model by tp, pp, cp or ep; fault tolerance runs replica groups of FSDP shards "
                            "(sw.Parallel(dp=, replicate=R, zero=3) or 'hsdp') or of one rank ('ddp')")


@pytest.mark.parametrize("value, message", [
    (dict(min_replicas=0), "FaultTolerance(min_replicas=0): must be a positive integer"),
    (dict(timeout_s=0), "FaultTolerance(timeout_s=0): must be a positive number of seconds"),
])
def test_fault_tolerance_values(value, message):
    with pytest.raises(ValueError) as e:
        sw.FaultTolerance(**value)
    assert str(e.value) == message


def test_every_shard_computed_once_whatever_the_live_groups():
    rng = random.Random(0)
    for replicas in (1, 2, 3, 4, 7):
        for _ in range(20):
            members = sorted(rng.sample(range(replicas), rng.randint(1, replicas)))
            owned = assignment(members, replicas)
            assert sorted(owned) == members
            assert sorted(s for shards in owned.values() for s in shards) == list(range(replicas))
            assert all(g in owned[g] for g in members)  # a live group keeps its own shard
            sizes = [len(s) for s in owned.values()]
            assert max(sizes) - min(sizes) <= 1 or replicas - len(members) < len(members)
