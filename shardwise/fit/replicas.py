"""A fit with ``fault_tolerance``: its ranks started by :func:`shardwise.ft.supervise.run_replicas`.

Each rank runs the usual :class:`~shardwise.fit.job.Job` as a one-process job
(its topology is its replica group's, whose rank is its launch rank), with the
strategy :class:`~shardwise.ft.replica.ReplicaStep`, whose step sums the
gradients over the live groups and applies only agreed steps. Every rank that
finishes writes its result; the first survivor's is the fit's, with every
survivor's stats.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from typing import Any

import torch

from shardwise import launch
from shardwise.data import GlobalBatches, StreamBatches, as_source
from shardwise.fit.job import FitResult, Job, pickled
from shardwise.fit.steps import micro_batches, step_inputs, train_batches
from shardwise.ft.quorum import Quorum
from shardwise.ft.replica import Replica, ReplicaShards, ReplicaStep
from shardwise.ft.supervise import run_replicas
from shardwise.layout import RunLayout


def fit_replicas(job: Job) -> FitResult:
    """Run ``job`` on fault-tolerant replica groups started here; the result of the first rank that finished."""
    t = job.options
    plan = t.replicas
    assert plan is not None
    if launch.under_launcher():
        raise RuntimeError("fault_tolerance runs from a plain `python script.py`, whose launcher keeps the "
                           "survivors alive; under `shardwise run`, torchrun or srun, the launcher ends every "
                           "rank when one dies: run the script without it")
    payload = pickled(job)
    with launch.result_dir() as tmp:
        path = os.path.join(tmp, "result")
        try:
            done = run_replicas(spawned_replica_fit, plan, args=(payload, path), accelerator=t.rank_accelerator,
                                timeout=t.timeout, ledger=t.sample_ledger)
        except launch.WorkerFailed as e:
            print(f"shardwise: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            raise
        results = [torch.load(f"{path}.{r}", weights_only=True) for r in done]
    first = dict(results[0])
    # Each rank's result holds its group's stats (a group of several ranks gathers them): one entry per rank.
    first["stats"] = sorted({s["rank"]: s for r in results for s in r["stats"]}.values(), key=lambda s: s["rank"])
    return FitResult(**first)


def spawned_replica_fit(rank: int, device: torch.device, quorum: Quorum, payload: bytes, path: str) -> None:
    """One rank of a fault-tolerant fit: its replica group's job, its result to ``path.<rank>``."""
    job: Job = pickle.loads(payload)
    t = job.options
    assert t.replicas is not None
    replica = Replica(quorum, t.replicas, rank, job.batch_size, ledger=t.sample_ledger is not None,
                      read=ShardReader(job, device))
    size = t.replicas.group_size
    strategy = ReplicaStep(replica=replica) if size == 1 else ReplicaShards(dp=size, zero=3, replica=replica)
    layout = RunLayout(ReplicaStep.name) if size == 1 else strategy.layout(size)
    job.options = dataclasses.replace(t, strategy=strategy, devices=size, layout=layout)
    job.launch_rank = rank
    job.result_from_rank0 = False  # any survivor's result is the fit's: each copies its replica
    result = job.run(device)
    torch.save({f.name: getattr(result, f.name) for f in dataclasses.fields(result)}, f"{path}.{rank}")


class ShardReader:
    """Any sample shard of any step, as the Trainer reads a group's own: ``reader(shard, step)``, its
    micro-batches (a dead group's shard, which a live group takes over), and ``reader.indices(shard, step)``, its
    sample indices (for the ledger). A shard's batches are opened at the first step read, and again when a step
    is not the next (a shard that went to another group and came back)."""

    def __init__(self, job: Job, device: torch.device) -> None:
        self.job, self.device = job, device
        self.source = as_source(job.dataset)
        assert job.options.replicas is not None
        self.replicas = job.options.replicas.replicas
        self.opened: dict[int, tuple[GlobalBatches | StreamBatches, int]] = {}  # shard -> (its batches, next step)
        self.orders: dict[int, GlobalBatches | StreamBatches] = {}  # shard -> its batches, for their indices

    def __call__(self, shard: int, step: int) -> list[tuple[Any, Any]]:
        batches, next_step = self.opened.get(shard, (None, -1))
        if batches is None or next_step != step:
            batches = self._open(shard, step)
        self.opened[shard] = (batches, step + 1)
        x, y = step_inputs(self.job, self.source, batches.batch(step, self.device))
        return micro_batches(x, y, self.job.options.accumulate_grad_batches)

    def indices(self, shard: int, step: int) -> list[int]:
        if self.source.streaming:
            return list(range(shard, self.job.batch_size, self.replicas))
        if shard not in self.orders:
            self.orders[shard] = self._open(shard, 0)
        order = self.orders[shard]
        assert isinstance(order, GlobalBatches)
        return order.indices(step)

    def _open(self, shard: int, start: int) -> GlobalBatches | StreamBatches:
        return train_batches(self.job, self.source, self.replicas, shard, start=start, stop=self.job.max_steps)
