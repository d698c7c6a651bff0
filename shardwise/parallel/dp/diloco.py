"""DiLoCo's outer loop: replicas that train alone for H inner steps, then average their pseudo-gradients.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models" (arXiv 2311.08105),
Algorithm 1. Every replica starts a cycle from the global weights θ. It takes H steps of its own (inner)
optimizer on its own data, reaching θ_r. The pseudo-gradient Δ = mean over replicas of (θ − θ_r) is then the
gradient of an outer optimizer that steps θ, and every replica restarts from the new θ.

:class:`OuterLoop` holds what the outer loop adds to a rank: the global weights of the tensors this rank's
inner optimizer steps (whole parameters under DDP, shards under ZeRO/FSDP, slices under tensor parallelism:
the ranks at the same place of each replica hold the same pieces, so one all-reduce across the replicas
averages every piece), the outer optimizer over them, and the count of inner steps.
:class:`DiLoCoOptimizer` wraps the inner optimizer: its ``step()`` is the inner step, and every H-th also the
sync. Both doors (the Trainer and a hand-written loop) call ``optimizer.step()``, so both run DiLoCo.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from shardwise.comm.collectives import Comm
from shardwise.loggers.scalars import log as log_scalar
from shardwise.optim.wrapped import WrappedOptimizer
from shardwise.parallel.dp.ddp import through_flat

OuterFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
SYNC = "diloco.sync"  # the name of the pseudo-gradients' all-reduce in the byte counts
START = "diloco_start"  # the broadcast that gives every replica replica 0's weights at the start


def default_outer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: Nesterov momentum, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class OuterLoop:
    """One rank's part of the outer loop over ``local``, the tensors its inner optimizer steps.

    ``across``: the ranks at the same place of every replica; ``norm``: squares this rank's pieces' sum of
    squares into the whole model's (a sum over the ranks of the replica that hold other pieces), or None where
    the pieces are whole. ``spread``: run after the local tensors are overwritten (ZeRO-1/2 all-gather their
    updated shards into the full parameters).
    """

    def __init__(self, local: list[torch.Tensor], outer: OuterFactory, across: Comm, sync_every: int,
                 norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 spread: Callable[[], None] | None = None) -> None:
        self.local, self.across, self.sync_every = local, across, sync_every
        self.norm, self.spread = norm, spread
        with torch.no_grad():
            # Leaves of their own (requires_grad: the outer optimizer steps them as parameters).
            self.global_weights = [p.detach().clone().requires_grad_(True) for p in local]
        self.outer = outer(self.global_weights)
        self.steps = torch.zeros((), dtype=torch.int64)  # inner steps taken: a tensor, so checkpoints hold it
        self.pseudo_norm: float | None = None  # of the last sync's averaged pseudo-gradient

    @property
    def outer_steps(self) -> int:
        return int(self.steps) // self.sync_every

    @property
    def mid_cycle(self) -> bool:
        """Whether the replicas have stepped since the last sync (their weights then differ from the global)."""
        return int(self.steps) % self.sync_every != 0

    @torch.no_grad()
    def start(self) -> None:
        """Every replica starts from replica 0's weights, so no replica's first inner steps are thrown away."""
        through_flat(self.global_weights, lambda flat: self.across.broadcast(flat, src=0, name=START))
        self._restart()

    @torch.no_grad()
    def inner_step_done(self) -> None:
        """Count one inner step; every ``sync_every``-th, sync. Logs the outer steps and, at a sync, the
        pseudo-gradient's norm (``sw.log``: the loggers' step rows)."""
        self.steps += 1
        if not self.mid_cycle:
            self.sync()
            log_scalar("diloco/pseudo_grad_norm", self.pseudo_norm, reduce="max")  # type: ignore[arg-type]
        log_scalar("diloco/outer_steps", self.outer_steps, reduce="max")

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients over the replicas, step the global weights, restart from them."""
        deltas = [g.detach() - p.detach() for g, p in zip(self.global_weights, self.local)]
        replicas = self.across.size
        through_flat(deltas, lambda flat: (self.across.all_reduce(flat, name=SYNC), flat.div_(replicas)))
        for g, d in zip(self.global_weights, deltas):
            g.grad = d
        self.pseudo_norm = self._norm(deltas)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self._restart()

    def _norm(self, deltas: list[torch.Tensor]) -> float:
        squares = sum((d.double().square().sum() for d in deltas), torch.zeros((), dtype=torch.float64))
        total = self.norm(squares) if self.norm is not None else squares
        return float(total.sqrt())

    def _restart(self) -> None:
        for p, g in zip(self.local, self.global_weights):
            p.copy_(g)
        if self.spread is not None:
            self.spread()

    @contextlib.contextmanager
    @torch.no_grad()
    def global_in_place(self) -> Iterator[None]:
        """Inside the block the local tensors hold the global weights (a gather of the full model reads them);
        the replica's own come back after. Nothing moves at a cycle's end, where the two are equal."""
        if not self.mid_cycle:
            yield
            return
        kept = [p.detach().clone() for p in self.local]
        self._restart()
        try:
            yield
        finally:
            for p, k in zip(self.local, kept):
                p.copy_(k)
            if self.spread is not None:
                self.spread()

    def tensors(self) -> list[torch.Tensor]:
        """What the outer loop adds to the rank's memory: the global weights and the outer optimizer's states."""
        states = [v for s in self.outer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        return [*self.global_weights, *states]


class DiLoCoOptimizer(WrappedOptimizer):
    """The inner optimizer, whose ``step()`` also counts the inner steps and syncs every H-th (``loop``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, loop: OuterLoop, scope: str) -> None:
        super().__init__(optimizer)
        self.loop, self.scope = loop, scope  # scope: this replica's, in checkpoint keys
        self.owner = getattr(optimizer, "owner", None)  # (ZeRO's wrapper, whose gradients finish at its step)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = self.optimizer.step(closure)
        self.loop.inner_step_done()
        return loss

    def scoped_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The optimizers whose states a checkpoint keeps, by the scope of their keys."""
        return {self.scope: self.optimizer, OUTER_SCOPE: self.loop.outer}


OUTER_SCOPE = "outer"  # the checkpoint keys of the global weights' outer optimizer states: "outer/optim.<fqn>.<s>"


def each_piece(local: list[torch.Tensor], view: torch.Tensor) -> tuple[int, int] | None:
    """(index in ``local``, element offset) of the tensor of ``local`` that ``view`` looks into, or None."""
    for i, p in enumerate(local):
        if p.untyped_storage().data_ptr() != view.untyped_storage().data_ptr():
            continue
        offset = view.storage_offset() - p.storage_offset()
        if 0 <= offset < max(1, p.numel()):
            return i, offset  # type: ignore[return-value]
    return None


def same_view(base: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """The view of ``base`` (a copy of the tensor ``like`` looks into) that ``like`` is of the original."""
    return torch.as_strided(base.detach(), like.size(), like.stride(), base.storage_offset() + offset)


def outer_states(opt: torch.optim.Optimizer, t: torch.Tensor) -> dict[str, Any]:
    return {k: v for k, v in opt.state.get(t, {}).items() if isinstance(v, torch.Tensor)}


__all__ = ["DiLoCoOptimizer", "OUTER_SCOPE", "OuterLoop", "SYNC", "default_outer", "each_piece", "outer_states",
           "same_view"]
