"""DiLoCo in the planner: one replica per node (the inner strategy inside it), a sync every H inner steps.

The sync is one all-reduce of the pseudo-gradient, the size of the parameters this rank steps, over the R
ranks at the same place of each replica (the group :data:`~shardwise.dims.DILOCO`, ``G = devices / R`` ranks
apart): ``2 (R - 1) / R`` of those bytes per rank, what DDP's gradient all-reduce of the same model on R ranks
sends. Spread over the H inner steps of a cycle, a step costs the inner strategy's own traffic (inside the
replica) plus 1/H of a sync, and its time the inner step's plus 1/H of the sync's (nothing hides it: the
replicas wait for the average before the next cycle).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardwise.dims import DILOCO
from shardwise.plan.comm import Collective, _make, group_link
from shardwise.plan.estimate import Estimate, plan
from shardwise.plan.model import ModelSpec
from shardwise.plan.specs import ClusterSpec, TrainingSpec


def sync_collective(param_bytes: int, replicas: int, ranks_per_replica: int, cluster: ClusterSpec) -> Collective:
    """One sync: the all-reduce of ``param_bytes`` (a rank's pieces of the pseudo-gradient) over the replicas."""
    link = group_link(cluster, replicas, ranks_per_replica)
    return _make("all_reduce", DILOCO, "pseudo-gradients (DiLoCo sync)", param_bytes, 1, replicas, link, "none")


@dataclass(frozen=True)
class DiLoCoEstimate:
    """DiLoCo's figures per inner step beside the inner strategy's (``inner``: one replica's estimate)."""

    replicas: int
    sync_every: int
    inner: Estimate
    sync: Collective

    @property
    def comm_bytes_per_step(self) -> float:
        return self.inner.comm_bytes_per_step + self.sync.bytes_sent / self.sync_every

    @property
    def cross_replica_bytes_per_step(self) -> float:
        return self.sync.bytes_sent / self.sync_every

    @property
    def step_time_s(self) -> float:
        return self.inner.step_time_s + self.sync.time_s / self.sync_every


def estimate_diloco(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, sync_every: int,
                    inner: str = "ddp") -> DiLoCoEstimate | None:
    """DiLoCo with one replica per node of ``cluster`` and ``inner`` inside each, the global batch split over
    the replicas; None when no layout of ``inner`` on one node is planned."""
    replicas = cluster.nodes
    node = dataclasses.replace(cluster, nodes=1)
    batch = training.global_batch // replicas if training.global_batch else None
    ests = [e for e in plan(model, node, dataclasses.replace(training, global_batch=batch), [inner], max_tp=1)
            if e.layout.dp == cluster.devices_per_node]
    if not ests:
        return None
    param_bytes = ests[0].params_bytes  # the parameters a rank of the replica steps (all of them under DDP)
    return DiLoCoEstimate(replicas, sync_every, ests[0],
                          sync_collective(int(param_bytes), replicas, cluster.devices_per_node, cluster))


__all__ = ["DiLoCoEstimate", "estimate_diloco", "sync_collective"]
