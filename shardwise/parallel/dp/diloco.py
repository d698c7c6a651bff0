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

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512; :class:`Streaming`) cuts those tensors into F
fragments. Fragment p's pseudo-gradient mean starts after inner step (p + 1) H / F of every cycle, so one sync
carries 1/F of the model; it is applied τ inner steps later (the inner steps run while it is in flight), and the
fragment's local weights then become α · local + (1 − α) · global. F = 1, τ = 0, α = 0 is the algorithm above.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.comm.collectives import Comm
from shardwise.comm.quantized import refusal, start_mean
from shardwise.loggers.scalars import log as log_scalar
from shardwise.optim.wrapped import WrappedOptimizer
from shardwise.parallel.dp.ddp import through_flat

OuterFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
SYNC = "diloco.sync"  # the name of the pseudo-gradients' all-reduce in the byte counts
START = "diloco_start"  # the broadcast that gives every replica replica 0's weights at the start


def default_outer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: Nesterov momentum, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True)
class Streaming:
    """Streaming DiLoCo's settings (Douillard et al. 2025, arXiv 2501.18512).

    ``fragments`` F: the tensors a rank steps, cut into F contiguous groups of about equal bytes; fragment p syncs
    after inner step (p + 1) H / F of every cycle of H steps. ``delay`` τ: a fragment's mean starts then and is
    applied τ inner steps later, the inner steps running while it is in flight. ``alpha`` α: after a fragment's
    outer step, its local weights become α · local + (1 − α) · global. ``quantize``: the encoding of the
    pseudo-gradients on the wire (:mod:`shardwise.comm.quantized`). The defaults are plain DiLoCo.
    """

    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    quantize: str | None = None


def cut(tensors: list[torch.Tensor], fragments: int) -> list[list[int]]:
    """The indices of ``tensors`` in each fragment: tensor j goes to fragment floor(F · b_j / B), b_j the bytes
    before it and B the total; contiguous, in order, equal when the tensors split evenly (a fragment may be empty
    when one tensor outweighs several fragments)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    total, before = max(1, sum(sizes)), 0
    out: list[list[int]] = [[] for _ in range(fragments)]
    for j, size in enumerate(sizes):
        out[min(fragments - 1, fragments * before // total)].append(j)
        before += size
    return out


@dataclass
class _InFlight:
    """A fragment's mean on its way: its tensors' indices, the pseudo-gradients it overwrites, how to finish it."""

    indices: list[int]
    deltas: list[torch.Tensor]
    finish: Callable[[], None]
    sent: int  # bytes counted when it started


class OuterLoop:
    """One rank's part of the outer loop over ``local``, the tensors its inner optimizer steps.

    ``across``: the ranks at the same place of every replica; ``norm``: squares this rank's pieces' sum of
    squares into the whole model's (a sum over the ranks of the replica that hold other pieces), or None where
    the pieces are whole. ``spread``: run after the local tensors are overwritten (ZeRO-1/2 all-gather their
    updated shards into the full parameters). ``streaming``: fragments, delay, alpha and quantization.
    """

    def __init__(self, local: list[torch.Tensor], outer: OuterFactory, across: Comm, sync_every: int,
                 norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 spread: Callable[[], None] | None = None, streaming: Streaming = Streaming()) -> None:
        self.local, self.across, self.sync_every = local, across, sync_every
        self.norm, self.spread, self.streaming = norm, spread, streaming
        for t in local:
            why = refusal(streaming.quantize, t.dtype)
            if why is not None:
                raise ValueError(f"DiLoCo {why}")
        with torch.no_grad():
            # Leaves of their own (requires_grad: the outer optimizer steps them as parameters).
            self.global_weights = [p.detach().clone().requires_grad_(True) for p in local]
        self.outer = outer(self.global_weights)  # one optimizer; a fragment's step gives only its tensors a grad
        self.fragments = cut(local, streaming.fragments)
        self.offsets = [(p + 1) * sync_every // streaming.fragments for p in range(streaming.fragments)]
        self.in_flight: dict[int, _InFlight] = {}
        self.steps = torch.zeros((), dtype=torch.int64)  # inner steps taken: a tensor, so checkpoints hold it
        self.pseudo_norm: float | None = None  # of the last sync's averaged pseudo-gradient
        self.sync_bytes = 0  # counted for the last sync (its fragment), start and finish together

    @property
    def outer_steps(self) -> int:
        return int(self.steps) // self.sync_every

    @property
    def at_global(self) -> bool:
        """Whether the local tensors hold the global weights (plain DiLoCo at a cycle's end, or at the start)."""
        s = self.streaming
        plain = s.fragments == 1 and s.delay == 0 and s.alpha == 0
        return int(self.steps) == 0 or (plain and int(self.steps) % self.sync_every == 0)

    @torch.no_grad()
    def start(self) -> None:
        """Every replica starts from replica 0's weights, so no replica's first inner steps are thrown away."""
        through_flat(self.global_weights, lambda flat: self.across.broadcast(flat, src=0, name=START))
        self._restart(range(len(self.local)))

    def _due(self, step: int, p: int, lag: int) -> bool:
        since = step - self.offsets[p] - lag
        return since >= 0 and since % self.sync_every == 0

    @torch.no_grad()
    def inner_step_done(self) -> None:
        """Count one inner step; start the fragments due now, apply those whose delay is over. Logs the outer
        steps and, at a sync, the pseudo-gradient's norm and the sync's bytes (``sw.log``: the step rows)."""
        self.steps += 1
        step = int(self.steps)
        for p in range(len(self.fragments)):
            if self._due(step, p, 0):
                self.in_flight[p] = self._send(p)
        applied = [p for p in list(self.in_flight) if self._due(step, p, self.streaming.delay)]
        for p in applied:
            self._apply(p)
        if applied:
            log_scalar("diloco/pseudo_grad_norm", self.pseudo_norm, reduce="max")  # type: ignore[arg-type]
            log_scalar("diloco/sync_bytes", self.sync_bytes, reduce="max")
        log_scalar("diloco/outer_steps", self.outer_steps, reduce="max")

    def _send(self, p: int) -> _InFlight:
        """Start fragment ``p``'s mean of the pseudo-gradients (the global weights minus the local)."""
        indices = self.fragments[p]
        deltas = [self.global_weights[i].detach() - self.local[i].detach() for i in indices]
        before = self.across.stats.sent
        finish = start_mean(self.across, deltas, SYNC, self.streaming.quantize)
        return _InFlight(indices, deltas, finish, self.across.stats.sent - before)

    @torch.no_grad()
    def _apply(self, p: int) -> None:
        """Finish fragment ``p``'s mean, step its global weights, mix them into the local ones."""
        sync = self.in_flight.pop(p)
        before = self.across.stats.sent
        sync.finish()
        self.sync_bytes = sync.sent + self.across.stats.sent - before
        for i, d in zip(sync.indices, sync.deltas):
            self.global_weights[i].grad = d
        self.pseudo_norm = self._norm(sync.deltas)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self._restart(sync.indices, self.streaming.alpha)

    @torch.no_grad()
    def complete(self) -> None:
        """Apply every sync still in flight now (where the weights are read at the end), in fragment order."""
        for p in sorted(self.in_flight):
            self._apply(p)

    def _norm(self, deltas: list[torch.Tensor]) -> float:
        squares = sum((d.double().square().sum() for d in deltas), torch.zeros((), dtype=torch.float64))
        total = self.norm(squares) if self.norm is not None else squares
        return float(total.sqrt())

    def _restart(self, indices: Iterable[int], alpha: float = 0.0) -> None:
        """The local tensors ``indices`` become α · local + (1 − α) · global (the global ones for α = 0)."""
        for i in indices:
            p, g = self.local[i], self.global_weights[i]
            if alpha == 0:
                p.copy_(g)
            else:
                p.mul_(alpha).add_(g.detach(), alpha=1 - alpha)
        if self.spread is not None:
            self.spread()

    @contextlib.contextmanager
    @torch.no_grad()
    def global_in_place(self) -> Iterator[None]:
        """Inside the block the local tensors hold the global weights (a gather of the full model reads them);
        the replica's own come back after. Nothing moves where the two are equal."""
        if self.at_global:
            yield
            return
        kept = [p.detach().clone() for p in self.local]
        self._restart(range(len(self.local)))
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


__all__ = [
    "OUTER_SCOPE",
    "SYNC",
    "DiLoCoOptimizer",
    "OuterLoop",
    "Streaming",
    "cut",
    "default_outer",
    "each_piece",
    "outer_states",
    "same_view",
]
