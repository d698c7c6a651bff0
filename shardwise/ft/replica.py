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

:class:`ReplicaStep` is the strategy a replica group's rank runs: one device,
the whole model (``ddp``'s replica), with this step.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.data import GlobalBatches, is_stream
from shardwise.ft import keys
from shardwise.ft.options import ReplicaPlan
from shardwise.ft.quorum import Quorum
from shardwise.ft.shards import assignment, pieces
from shardwise.precision import widened
from shardwise.loggers.scalars import log
from shardwise.step import LossFn, StepRun, forward_loss, set_aux_grad_scale
from shardwise.strategies.single import Single


@dataclass
class Replica:
    """The fault-tolerant step of one replica group's rank, and what it counted (``FitResult.stats``)."""

    quorum: Quorum
    plan: ReplicaPlan
    rank: int  # the launch rank: only rank 0 reports quorum changes
    batch_size: int
    dataset: Any = None  # for the ledger's sample indices (a map-style dataset; a stream records positions)
    seed: int = 0
    ledger: bool = False
    done: int = 0  # committed steps
    failures: int = 0
    recomputed: int = 0
    seconds_lost: float = 0.0
    _shards: dict[int, GlobalBatches] = field(default_factory=dict)

    def step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, topo: Topology,
             run: StepRun) -> torch.Tensor:
        """Forward and backward of this group's shards, summed over the live groups and agreed: on return the
        gradients are the global batch's and the step may be applied. Returns the global batch's loss."""
        params = [p for p in model.parameters() if p.requires_grad]
        rng = torch.get_rng_state()
        first = time.perf_counter()
        left: list[int] = []
        while True:
            attempt = time.perf_counter()
            mine = assignment(self.quorum.members, self.plan.replicas)[self.quorum.group]
            loss = self._backward(model, pieces(micro_batches, mine, self.plan.replicas), loss_fn, topo, run)
            flat = _flat(params, loss)
            if self.quorum.agree(self.done, self.quorum.all_reduce(flat)):
                break
            self.recomputed += 1
            for p in params:
                p.grad = None
            torch.set_rng_state(rng)  # the step again, with the random numbers it drew the first time
            left += self.quorum.advance()
        _unflat(params, flat)
        if self.ledger:
            self._record()
        if left:
            self._report(left, attempt - first)
        self.done += 1
        return flat[0][-1].detach().to(widened(loss).dtype)

    def _backward(self, model: nn.Module, parts: list[tuple[Any, Any, int]], loss_fn: LossFn, topo: Topology,
                  run: StepRun) -> torch.Tensor:
        """Forward and backward of each part, its loss weighted by its share of the global batch (the loss is
        a mean over its rows, so the weighted sum is the global batch's mean); returns that partial sum."""
        total = torch.zeros((), dtype=torch.float64, device=topo.device)
        for x, y, n in parts:
            share = n / self.batch_size
            set_aux_grad_scale(model, run.loss_scale * share)
            with run.forward_context(topo.device):
                loss = forward_loss(model, x, y, loss_fn)
            (widened(loss) * (run.loss_scale * share)).backward()
            total = total + widened(loss.detach()).to(total.dtype) * share
        return total

    def _record(self) -> None:
        """The committed step's sample indices by group, for the launcher's ledger (every member writes the
        same value: the line survives any one of them)."""
        owned = assignment(self.quorum.members, self.plan.replicas)
        samples = {g: sorted(i for s in shards for i in self._samples(s)) for g, shards in owned.items()}
        line = {"epoch": self.quorum.epoch, "members": self.quorum.members,
                "shards": {str(g): s for g, s in owned.items()}, "samples": {str(g): s for g, s in samples.items()}}
        self.quorum.store.set(keys.committed(self.done), json.dumps(line))

    def _samples(self, shard: int) -> list[int]:
        """Shard ``shard``'s sample indices in this step (its positions in the global batch, for a stream)."""
        if self.dataset is None or is_stream(self.dataset):
            return list(range(shard, self.batch_size, self.plan.replicas))
        if shard not in self._shards:
            self._shards[shard] = GlobalBatches(self.dataset, self.batch_size, self.plan.replicas, shard,
                                                seed=self.seed)
        return self._shards[shard].indices(self.done)

    def _report(self, left: list[int], lost: float) -> None:
        """A quorum change: counted, logged in the step's row, and told on the progress output by rank 0."""
        self.failures += len(left)
        self.seconds_lost += lost
        log("ft/failures", float(self.failures), reduce="max")
        log("ft/seconds_lost", lost, reduce="max")
        log("ft/live_groups", float(len(self.quorum.members)), reduce="min")
        if self.rank == 0:
            why = "; ".join(f"group {g}: {self.quorum.why_left(g)}" for g in left)
            print(f"shardwise: step {self.done + 1}: replica group{'s' if len(left) > 1 else ''} "
                  f"{', '.join(map(str, left))} left ({why}); {len(self.quorum.members)} of {self.plan.replicas} "
                  f"groups continue, the step computed again, {lost:.2f} s lost", file=sys.stderr, flush=True)

    def stats(self) -> dict[str, Any]:
        return {"failures": self.failures, "steps_recomputed": self.recomputed, "seconds_lost": self.seconds_lost,
                "live_groups": list(self.quorum.members)}


def _flat(params: list[torch.Tensor], loss: torch.Tensor) -> list[torch.Tensor]:
    """One buffer per gradient dtype (a missing gradient as zeros), the loss as the first buffer's last element."""
    dtypes = list(dict.fromkeys(p.dtype for p in params)) or [loss.dtype]
    out = []
    for i, dt in enumerate(dtypes):
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params if p.dtype == dt]
        if i == 0:
            parts.append(loss.reshape(1).to(dt))
        out.append(torch.cat(parts))
    return out


def _unflat(params: list[torch.Tensor], flat: list[torch.Tensor]) -> None:
    """The summed gradients back into each parameter's ``grad``."""
    dtypes = list(dict.fromkeys(p.dtype for p in params))
    for dt, buf in zip(dtypes, flat):
        at = 0
        for p in (p for p in params if p.dtype == dt):
            p.grad = buf[at:at + p.numel()].view_as(p)
            at += p.numel()


@dataclass
class ReplicaStep(Single):
    """A replica group of one rank: the whole model on one device (``ddp``'s replica) whose step is
    :meth:`Replica.step`. Every rank reads the whole global batch; the step picks its shards' rows."""

    replica: Replica | None = field(default=None, repr=False, compare=False)
    name: ClassVar[str] = "ddp"

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        assert self.replica is not None
        return self.replica.step(model, micro_batches, loss_fn, topo, run)

    def data_parallel(self, topo: Topology) -> tuple[int, int]:
        return 1, 0

    def rank_stats(self, model: nn.Module, topo: Topology) -> dict[str, Any]:
        return self.replica.stats() if self.replica is not None else {}
