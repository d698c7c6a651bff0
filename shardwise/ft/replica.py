"""One replica group's step under fault tolerance: every sample shard computed once, applied only when agreed.

A step of :class:`Replica`:

1. the live groups split the step's sample shards between them
   (:func:`shardwise.ft.shards.assignment`); this group runs forward and
   backward over each of its shards' rows, each weighted by its share of the
   global batch, so the gradients summed over the groups are the global
   batch's mean gradient, whatever the membership;
2. the gradients (and the loss) are summed over the live groups
   (:meth:`Quorum.all_reduce`);
3. the members vote (:meth:`Quorum.agree`). Only a unanimous ``ok`` lets the
   Trainer's loop apply the optimizer step. Otherwise the gradients are
   dropped, the RNG is put back, and the step is computed again, from the same
   state, by the launcher's next membership.

:class:`ReplicaStep` is the strategy a replica group of one rank runs: one
device, the whole model (``ddp``'s replica), with this step;
:class:`ReplicaShards` that of a group of several ranks holding FSDP shards.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.comm.topology import Topology
from shardwise.data import batch_len
from shardwise.dims import DP
from shardwise.ft import keys
from shardwise.ft.options import ReplicaPlan
from shardwise.ft.quorum import Quorum
from shardwise.ft.shards import assignment, rows
from shardwise.loggers.scalars import log
from shardwise.parallel.dp.fsdp_module import FSDPModule
from shardwise.precision import widened
from shardwise.step import (
    LossFn,
    OptimizerFactory,
    StepRun,
    forward_loss,
    set_aux_grad_scale,
)
from shardwise.strategies.parallel import Parallel
from shardwise.strategies.single import Single


class ShardSource(Protocol):
    """Any sample shard of any step, read as the Trainer reads a group's own (the fit's
    :class:`shardwise.fit.replicas.ShardReader`)."""

    def __call__(self, shard: int, step: int) -> Sequence[tuple[Any, Any]]:
        """The shard's micro-batches in ``step``: ``(input, target)`` each."""

    def indices(self, shard: int, step: int) -> list[int]:
        """The shard's sample indices in ``step`` (a stream's: the shard's positions in the global batch)."""


@dataclass
class Replica:
    """The fault-tolerant step of one replica group's rank, and what it counted (``FitResult.stats``)."""

    quorum: Quorum
    plan: ReplicaPlan
    rank: int  # the launch rank
    batch_size: int
    ledger: bool = False
    done: int = 0  # committed steps
    failures: int = 0
    recomputed: int = 0
    seconds_lost: float = 0.0
    # A group of several ranks: its reduced gradient shards (the strategy's), and its own communicator.
    shard_grads: Callable[[nn.Module], list[torch.Tensor]] | None = None
    group_comm: Comm | None = None
    read: ShardSource | None = None  # any sample shard of any step: a dead group's, taken over, and the ledger's
    grads: GradBuffer | None = None  # a group of one rank: its gradients' flat buffers, made at the first step
    _taken: dict[int, tuple[int, Sequence[tuple[Any, Any]]]] = field(default_factory=dict)

    def step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, topo: Topology,
             run: StepRun) -> torch.Tensor:
        """Forward and backward of this group's shards, summed over the live groups and agreed: on return the
        gradients are the global batch's and the step may be applied. Returns the global batch's loss."""
        rng = torch.get_rng_state()
        first = time.perf_counter()
        left: list[int] = []
        while True:
            attempt = time.perf_counter()
            if self.shard_grads is None:
                self._buffer(model).attach()
            loss = self._backward(model, self._parts(micro_batches), loss_fn, topo, run)
            if self.group_comm is not None:
                self.group_comm.all_reduce(loss, name="ft.group_loss")  # the group's ranks computed its rows
            flat = self._summed(model, loss)
            if self.quorum.agree(self.done, self.quorum.all_reduce(flat)):
                break
            self.recomputed += 1
            _drop_grads(model)
            torch.set_rng_state(rng)  # the step again, with the random numbers it drew the first time
            left += self.quorum.advance()
        if self.shard_grads is not None:
            _unflat(self.shard_grads(model), flat)
        if self.ledger:
            self._record()
        if left:
            self._report(left, attempt - first)
        self.done += 1
        # Each rank of a group holds the global loss; the Trainer sums a step's loss over the group's ranks.
        return flat[0][-1].detach().to(widened(loss).dtype) / self.quorum.group_size

    def _buffer(self, model: nn.Module) -> GradBuffer:
        if self.grads is None:
            self.grads = GradBuffer([p for p in model.parameters() if p.requires_grad])
        return self.grads

    def _summed(self, model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
        """What the live groups sum, the loss as the first buffer's last element: the persistent buffers the
        gradients were accumulated in, or a copy of a sharded group's gradient shards."""
        if self.shard_grads is not None:
            return _flat(self.shard_grads(model), loss)
        assert self.grads is not None
        return self.grads.collect(loss)

    def _backward(self, model: nn.Module, parts: list[tuple[Any, Any, int]], loss_fn: LossFn, topo: Topology,
                  run: StepRun) -> torch.Tensor:
        """Forward and backward of each part, its loss weighted by its share of the global batch (the loss is
        a mean over its rows, so the weighted sum is the global batch's mean); returns that partial sum."""
        total = torch.zeros((), dtype=torch.float64, device=topo.device)
        # A group of several ranks averages its ranks' gradients (FSDP's reduce-scatter divides by their number):
        # each rank's part is weighted that many times over, so the group's gradient is the sum of its rows'.
        size = self.quorum.group_size
        for x, y, n in parts:
            share = n / self.batch_size
            set_aux_grad_scale(model, run.loss_scale * share * size)
            with run.forward_context(topo.device):
                loss = forward_loss(model, x, y, loss_fn)
            (widened(loss) * (run.loss_scale * share * size)).backward()
            total = total + widened(loss.detach()).to(total.dtype) * share
        return total

    def _parts(self, micro_batches: Sequence[tuple[Any, Any]]) -> list[tuple[Any, Any, int]]:
        """``(input, target, rows)`` of each micro-batch of this group's shards (its own, which the Trainer read,
        and the dead groups' it took over, which :attr:`read` reads); in a group of several ranks, this rank's
        every ``group_size``-th row of each from its place on."""
        mine = assignment(self.quorum.members, self.plan.replicas)[self.quorum.group]
        micro = [m for s in mine for m in (micro_batches if s == self.quorum.group else self._read(s))]
        parts = [(x, y, batch_len(y) or batch_len(x)) for x, y in micro]
        size, place = self.quorum.group_size, self.quorum.place
        if size == 1:
            return parts
        if any(n < size for _, _, n in parts):
            raise ValueError(f"a sample shard's micro-batch has fewer rows than the {size} ranks of a replica "
                             f"group: raise batch_size (now {self.batch_size}) or lower accumulate_grad_batches")
        return [(rows(x, place, size), rows(y, place, size), len(range(place, n, size))) for x, y, n in parts]

    def _read(self, shard: int) -> Sequence[tuple[Any, Any]]:
        """A dead group's shard of this step, read once (a step computed again reads none again)."""
        if shard not in self._taken or self._taken[shard][0] != self.done:
            assert self.read is not None
            self._taken[shard] = (self.done, self.read(shard, self.done))
        return self._taken[shard][1]

    def _record(self) -> None:
        """The committed step's sample indices by group, for the launcher's ledger (every member writes the
        same value: the line survives any one of them)."""
        owned = assignment(self.quorum.members, self.plan.replicas)
        assert self.read is not None
        samples = {g: sorted(i for s in shards for i in self.read.indices(s, self.done)) for g, shards in owned.items()}
        line = {"epoch": self.quorum.epoch, "members": self.quorum.members,
                "shards": {str(g): s for g, s in owned.items()}, "samples": {str(g): s for g, s in samples.items()}}
        self.quorum.store.set(keys.committed(self.done), json.dumps(line))

    def _report(self, left: list[int], lost: float) -> None:
        """A quorum change: counted, logged in the step's row (the step, who left, the seconds lost), and told on
        the progress output by the logging rank."""
        self.failures += len(left)
        self.seconds_lost += lost
        log("ft/failures", float(self.failures), reduce="max")
        log("ft/seconds_lost", lost, reduce="max")
        log("ft/live_groups", float(len(self.quorum.members)), reduce="min")
        for g in left:
            log(f"ft/left/group{g}", 1.0, reduce="max")
        if self.logs_here():
            why = "; ".join(f"group {g}: {self.quorum.why_left(g)}" for g in left)
            print(f"shardwise: step {self.done + 1}: replica group{'s' if len(left) > 1 else ''} "
                  f"{', '.join(map(str, left))} left ({why}); {len(self.quorum.members)} of {self.plan.replicas} "
                  f"groups continue, the step computed again, {lost:.2f} s lost", file=sys.stderr, flush=True)

    def logs_here(self) -> bool:
        """Whether this rank is the first of the first live group: the one that reports quorum changes and
        writes the step rows (see :meth:`shardwise.strategies.base.Strategy.logs_here`)."""
        return self.rank == min(self.quorum.members) * self.quorum.group_size

    def stats(self) -> dict[str, Any]:
        return {"failures": self.failures, "steps_recomputed": self.recomputed, "seconds_lost": self.seconds_lost,
                "live_groups": list(self.quorum.members)}


def _flat(grads: list[torch.Tensor], loss: torch.Tensor) -> list[torch.Tensor]:
    """One buffer per gradient dtype, the loss as the first buffer's last element."""
    dtypes = list(dict.fromkeys(g.dtype for g in grads)) or [loss.dtype]
    out = []
    for i, dt in enumerate(dtypes):
        parts = [g.reshape(-1) for g in grads if g.dtype == dt]
        if i == 0:
            parts.append(loss.reshape(1).to(dt))
        out.append(torch.cat(parts))
    return out


def _unflat(grads: list[torch.Tensor], flat: list[torch.Tensor]) -> None:
    """The summed gradients back into ``grads`` in place (a sharded group's gradient shards, which its optimizer
    reads where they are)."""
    dtypes = list(dict.fromkeys(g.dtype for g in grads))
    for dt, buf in zip(dtypes, flat):
        at = 0
        for g in (g for g in grads if g.dtype == dt):
            g.copy_(buf[at:at + g.numel()].view_as(g))
            at += g.numel()


class GradBuffer:
    """Every parameter's gradient as a view of one flat buffer per dtype, with one more element in the first for
    the step's loss: autograd accumulates straight into the buffers (as DDP's buckets), and the reduction over
    the live groups sends them as they are, with no copy and no allocation per step. A parameter that got no
    gradient sends zeros, so that every group sends the same sizes."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        dtypes = list(dict.fromkeys(p.dtype for p in params))
        self.buffers: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(params)
        for i, dt in enumerate(dtypes):
            mine = [j for j, p in enumerate(params) if p.dtype == dt]
            size = sum(params[j].numel() for j in mine) + (i == 0)
            buf = torch.zeros(size, dtype=dt, device=params[mine[0]].device)
            at = 0
            for j in mine:
                self.views[j] = buf[at:at + params[j].numel()].view_as(params[j])
                at += params[j].numel()
            self.buffers.append(buf)

    def attach(self) -> None:
        """Zero the buffers and make each gradient its view again (the Trainer sets gradients to None after
        each step, and a failed attempt's are dropped)."""
        for buf in self.buffers:
            buf.zero_()
        for p, v in zip(self.params, self.views):
            p.grad = v

    def collect(self, loss: torch.Tensor) -> list[torch.Tensor]:
        """The buffers to sum, the loss written into its element; a gradient autograd put elsewhere (a hook
        that replaced it) is copied in first."""
        for p, v in zip(self.params, self.views):
            if p.grad is not None and p.grad.data_ptr() != v.data_ptr():
                v.copy_(p.grad)
                p.grad = v
        self.buffers[0][-1:].copy_(loss.detach().reshape(1))
        return self.buffers


class _ReplicaStepping:
    """What both replica strategies share: the step is :meth:`Replica.step`, and the Trainer reads the group's own
    sample shard of each global batch (the step reads those of dead groups it takes over). The step's loss is
    already the global batch's: no data-parallel shards to average over."""

    replica: Replica | None

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        assert self.replica is not None
        return self.replica.step(model, micro_batches, loss_fn, topo, run)

    def data_parallel(self, topo: Topology) -> tuple[int, int]:
        return 1, 0

    def train_shards(self, topo: Topology) -> tuple[int, int]:
        assert self.replica is not None
        return self.replica.plan.replicas, self.replica.quorum.group

    def logs_here(self, topo: Topology) -> bool:
        assert self.replica is not None
        return self.replica.logs_here()


@dataclass
class ReplicaStep(_ReplicaStepping, Single):
    """A replica group of one rank: the whole model on one device (``ddp``'s replica) whose step is
    :meth:`Replica.step`. The Trainer reads the group's own sample shard; the step reads those it takes over."""

    replica: Replica | None = field(default=None, repr=False, compare=False)
    name: ClassVar[str] = "ddp"

    def rank_stats(self, model: nn.Module, topo: Topology) -> dict[str, Any]:
        return self.replica.stats() if self.replica is not None else {}


@dataclass
class ReplicaShards(_ReplicaStepping, Parallel):
    """A replica group of several ranks holding FSDP shards of one copy of the state (``sw.Parallel(dp=G,
    zero=3)`` on the group's own process group), whose step is :meth:`Replica.step`: the ranks of the group
    reduce-scatter as usual, then rank ``i`` of each live group sums its gradient shard with rank ``i`` of the
    others. Each rank reads its group's sample shards, and computes its rows of them."""

    replica: Replica | None = field(default=None, repr=False, compare=False)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        assert self.replica is not None
        self.replica.shard_grads = _fsdp_grad_shards
        self.replica.group_comm = topo.comm(DP)
        return super().setup(model, optimizer_fn, topo)

    def rank_stats(self, model: nn.Module, topo: Topology) -> dict[str, Any]:
        return {**super().rank_stats(model, topo), **(self.replica.stats() if self.replica is not None else {})}


def _drop_grads(model: nn.Module) -> None:
    """A failed attempt's gradients gone: each parameter's, and each FSDP unit's reduced shard (which a wrapper's
    ``zero_grad`` does not reach: the unit keeps it apart from its parameters)."""
    model.zero_grad(set_to_none=True)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.zero_grad(set_to_none=True)


def _fsdp_grad_shards(model: nn.Module) -> list[torch.Tensor]:
    """Every FSDP unit's reduced gradient shard on this rank, in unit order (alike on every group)."""
    return [g for m in model.modules() if isinstance(m, FSDPModule) for g in m.shard_grads()]
