"""What a fault-tolerant run is asked for (:class:`FaultTolerance`) and what it can survive (:func:`plan_replicas`).

The unit of failure is a replica group: the ranks that hold one whole copy of
the model state, optimizer state included. Under ``ddp`` a group is one rank;
with ``replicate=R`` and ``zero=3`` (HSDP) it is one replica's FSDP shards.
A layout without such copies (ZeRO or FSDP over every rank, tp or pp alone, a
parameter server, one process driving every device) is refused here, before
any process starts, with the reason: what a dead rank held exists nowhere else.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

from shardwise.layout import RunLayout
from shardwise.strategies.base import HasServers, OwnDevices, Strategy

# How often a rank tells the launcher it is alive, and the least timeout the launcher can judge by it: a rank
# is declared stopped after timeout_s without a beat, which must span several beats (a busy interpreter delays
# one by a few milliseconds; a stopped one sends none).
HEARTBEAT_S = 0.25
MIN_TIMEOUT_S = 4 * HEARTBEAT_S


@dataclass(frozen=True)
class FaultTolerance:
    """``Trainer(fault_tolerance=...)``: a dead replica group changes the run's time, not its model.

    Args:
        min_replicas: the fewest live replica groups the run continues with; below it the run ends with an
            error naming the dead groups.
        timeout_s: a rank that sends no heartbeat for this long (a hang, SIGSTOP) is killed by the launcher
            and its group leaves the quorum. Must be below the Trainer's ``timeout_s`` (how long a collective
            waits), so that a stopped rank is found before its peers give up on it.
        rejoin: whether a restarted group may join again (reserved: groups are not restarted yet, a dead one
            stays out for the rest of the run).
    """

    min_replicas: int = 1
    timeout_s: float = 30.0
    rejoin: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or isinstance(self.min_replicas, bool) or self.min_replicas < 1:
            raise ValueError(f"FaultTolerance(min_replicas={self.min_replicas!r}): must be a positive integer")
        if not self.timeout_s > 0:
            raise ValueError(f"FaultTolerance(timeout_s={self.timeout_s!r}): must be a positive number of seconds")

    @staticmethod
    def of(value: bool | FaultTolerance | None) -> FaultTolerance | None:
        """``Trainer(fault_tolerance=)``'s value: True is the defaults, False or None is none."""
        if value is None or value is False:
            return None
        if value is True:
            return FaultTolerance()
        if not isinstance(value, FaultTolerance):
            raise TypeError(f"fault_tolerance must be True, False, None or sw.FaultTolerance(...), got {value!r}")
        return value


@dataclass(frozen=True)
class ReplicaPlan:
    """How a run's ranks form replica groups: ``replicas`` groups of ``group_size`` ranks each, the ranks of a
    group consecutive (launch rank ``g * group_size + i`` is rank ``i`` of group ``g``)."""

    replicas: int
    group_size: int
    ft: FaultTolerance

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.group_size, (group + 1) * self.group_size))


def plan_replicas(strategy: Strategy, layout: RunLayout, ft: FaultTolerance,
                  collective_timeout: _dt.timedelta) -> ReplicaPlan:
    """The replica groups of ``layout``, or a ValueError saying why this run cannot survive a dead rank."""
    name = strategy.name
    refused = f"fault_tolerance cannot run strategy {name!r}: "
    if isinstance(strategy, HasServers):
        raise ValueError(refused + "its server ranks hold the only copy of the model and optimizer state, so a "
                                   "dead server's share exists nowhere else; use strategy='ddp'")
    if isinstance(strategy, OwnDevices) or layout.devices_per_process > 1:
        raise ValueError(refused + "one process drives every device, so there is no other replica to survive "
                                   "it; use strategy='ddp' (one process per device)")
    if layout.engine != "shardwise":
        raise ValueError(refused + "under engine='torch' PyTorch's DDP and FSDP own the reduction, which cannot "
                                   "leave out a dead replica; use engine='shardwise'")
    dims = layout.dims
    if dims.dp == 1 and (dims.tp > 1 or dims.pp > 1 or dims.cp > 1):
        raise ValueError(refused + f"it splits the model over every rank ({dims.label()}), so a dead rank's part "
                                   "of the model exists nowhere else; add data-parallel replicas")
    replicas = layout.replicate if layout.zero == 3 else dims.dp if layout.zero == 0 else 1
    if replicas == 1 and layout.zero > 0 and dims.dp > 1:
        raise ValueError(refused + f"zero={layout.zero} shards the optimizer state over every rank, so a dead "
                                   "rank's shard of the optimizer state exists nowhere else; keep replicas: "
                                   "strategy='ddp', 'hsdp', or sw.Parallel(dp=, replicate=R, zero=3)")
    group_size = layout.processes // replicas
    if group_size > 1 and (layout.zero != 3 or dims.tp > 1 or dims.pp > 1 or dims.cp > 1 or dims.ep > 1):
        raise ValueError(refused + f"its replica groups of {group_size} ranks split the model by tp, pp, cp or ep; "
                                   "fault tolerance runs replica groups of FSDP shards (sw.Parallel(dp=, "
                                   "replicate=R, zero=3) or 'hsdp') or of one rank ('ddp')")
    if ft.min_replicas > replicas:
        raise ValueError(f"FaultTolerance(min_replicas={ft.min_replicas}) is above the {replicas} replica "
                         f"group{'s' if replicas > 1 else ''} of strategy {name!r} on {layout.processes} "
                         "processes: the run could not even start")
    if ft.timeout_s < MIN_TIMEOUT_S:
        raise ValueError(f"FaultTolerance(timeout_s={ft.timeout_s}) is below {MIN_TIMEOUT_S} s, the least in which "
                         f"the launcher tells a stopped rank from a busy one (a rank beats every {HEARTBEAT_S} s)")
    limit = collective_timeout.total_seconds()
    if ft.timeout_s >= limit:
        raise ValueError(f"FaultTolerance(timeout_s={ft.timeout_s}) must be below Trainer(timeout_s={limit:g}), "
                         "how long a collective waits: the launcher must find a stopped rank before its peers "
                         "give up waiting for it")
    return ReplicaPlan(replicas, group_size, ft)
