"""DiLoCo (``sw.DiLoCo``): R replicas of an inner strategy that sync every H inner steps (arXiv 2311.08105).

The ranks form R blocks of G = devices / R consecutive ranks; replica r is block r, and the inner strategy
(ddp, fsdp, tp, pp or ``sw.Parallel``) runs inside it on its own
:class:`~shardwise.comm.topology.Topology` (``Topology.blocks``), as it would on G devices alone. The replicas
are the job's outermost data-parallel dimension: with D data-parallel ranks inside each, replica r reads the
shares of data-parallel ranks r·D … r·D + D − 1 of every global batch. The outer loop itself (global weights,
outer optimizer, the sync) is :mod:`shardwise.parallel.dp.diloco`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.checkpoint.held import Held, scoped
from shardwise.comm.collectives import Comm
from shardwise.comm.quantized import QUANTIZE
from shardwise.comm.topology import Topology
from shardwise.dims import DP
from shardwise.layout import RunLayout
from shardwise.parallel.dp.diloco import (
    OUTER_SCOPE,
    DiLoCoOptimizer,
    OuterFactory,
    OuterLoop,
    Streaming,
    default_outer,
    each_piece,
    outer_states,
    same_view,
)
from shardwise.step import LossFn, OptimizerFactory, StepRun
from shardwise.strategies.base import HasServers, OwnDevices, Strategy
from shardwise.strategies.registry import resolve

STEPS_KEY = scoped(OUTER_SCOPE, "steps")  # the inner steps taken, in checkpoints


@dataclass
class DiLoCo(Strategy):
    """``replicas`` replicas of ``inner``, each with its own inner optimizer, averaging their pseudo-gradients
    every ``sync_every`` inner steps into an outer step of the global weights (``outer_optimizer``: a factory
    over tensors; by default the paper's SGD(lr=0.7, momentum=0.9, nesterov=True)). ``batch_size`` stays the
    global batch of one inner step, over every replica.

    Streaming DiLoCo (arXiv 2501.18512): ``fragments`` F syncs F pieces of the model at staggered steps (each every
    ``sync_every`` steps; F must divide it), ``delay`` τ applies a fragment's sync τ inner steps after it started
    (τ < sync_every / F), ``alpha`` α leaves α · local + (1 − α) · global in the fragment after its sync, and
    ``quantize`` (None, "bf16" or "int8") sends the pseudo-gradients in fewer bits (see
    :mod:`shardwise.parallel.dp.diloco` and :mod:`shardwise.comm.quantized`)."""

    inner: str | Strategy = "ddp"
    replicas: int = 2
    sync_every: int = 100
    outer_optimizer: OuterFactory | None = None
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    quantize: str | None = None
    name: ClassVar[str] = "diloco"

    def __post_init__(self) -> None:
        for field, v in (("replicas", self.replicas), ("sync_every", self.sync_every)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                what = "the inner steps between two syncs" if field == "sync_every" else "the model's replicas"
                raise ValueError(f"DiLoCo {field}={v!r}: must be an integer >= 1 ({what})")
        why = self._streaming_refusal()
        if why is not None:
            raise ValueError(f"DiLoCo {why}")
        self.inner = resolve(self.inner)
        if isinstance(self.inner, (DiLoCo, HasServers, OwnDevices)):
            raise ValueError(f"DiLoCo cannot run strategy {self.inner.name!r} inside its replicas; use ddp, zero1, "
                             "zero2, fsdp, hsdp, tp, pp or sw.Parallel")

    def _streaming_refusal(self) -> str | None:
        """Why ``fragments``, ``delay``, ``alpha`` or ``quantize`` cannot run, or None."""
        f, h, tau, a = self.fragments, self.sync_every, self.delay, self.alpha
        if not isinstance(f, int) or isinstance(f, bool) or f < 1:
            return f"fragments={f!r}: must be an integer >= 1 (the pieces of the model synced at their own offsets)"
        if h % f:
            return (f"sync_every={h} must be divisible by fragments={f}: fragment p syncs after inner step "
                    f"(p + 1) x sync_every / fragments of every cycle")
        if not isinstance(tau, int) or isinstance(tau, bool) or not 0 <= tau < h // f:
            return (f"delay={tau!r} must be an integer in [0, sync_every / fragments = {h // f}): a fragment's sync "
                    "lands before the next fragment's starts, so at most one is in flight")
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            return f"alpha={a!r} must be a number in [0, 1] (the local weights' share after a fragment's sync)"
        if self.quantize is not None and self.quantize not in QUANTIZE:
            return f"quantize={self.quantize!r} must be None, 'bf16' or 'int8'"
        return None

    @property
    def streaming(self) -> Streaming:
        return Streaming(self.fragments, self.delay, float(self.alpha), self.quantize)

    @property
    def inner_strategy(self) -> Strategy:
        assert isinstance(self.inner, Strategy)  # resolved in __post_init__
        return self.inner

    def layout(self, devices: int) -> RunLayout:
        """The inner layout on devices / R, its data-parallel replicas multiplied by R: the planner and the memory
        check see one replica's states on each rank, and the batch splits over R x its data-parallel ranks."""
        if devices % self.replicas:
            raise ValueError(f"DiLoCo replicas={self.replicas} must divide the devices ({devices}): each replica is "
                             f"a block of devices / replicas consecutive ranks")
        inner = self.inner_strategy.layout(devices // self.replicas)
        if inner.ep > 1:
            raise ValueError(f"DiLoCo does not run expert parallelism inside its replicas (ep={inner.ep})")
        dims = dataclasses.replace(inner.dims, dp_replicate=inner.dims.dp_replicate * self.replicas)
        return dataclasses.replace(inner, dims=dims,
                                   replicate=inner.replicate * self.replicas if inner.zero == 3 else 1)

    def block(self, topo: Topology) -> tuple[Topology, Comm]:
        """This rank's replica as a topology of its own, and the communicator across the replicas."""
        size = topo.world_size // self.replicas
        return topo.blocks(self.replicas, self.inner_strategy.layout(size).dims)

    def replica(self, topo: Topology) -> int:
        return topo.rank // (topo.world_size // self.replicas)

    # ---- building ---------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        block, across = self.block(topo)
        model, opt = self.inner_strategy.setup(model, optimizer_fn, block)
        local = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        owner = getattr(opt, "owner", None)
        loop = OuterLoop(local, self.outer_optimizer or default_outer, across, self.sync_every,
                         norm=self._norm_over(block, owner), spread=getattr(owner, "after_step", None),
                         streaming=self.streaming)
        loop.start()
        model.__dict__["diloco_loop"] = loop  # for the full state dict, which is given the model alone
        return model, DiLoCoOptimizer(opt, loop, self._scope(topo))

    def _norm_over(self, block: Topology, owner: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How a rank's sum of squares becomes the replica's: summed over the data-parallel ranks where they hold
        disjoint shards (ZeRO, FSDP); as it is where every rank holds whole parameters (DDP)."""
        if owner is None or block.size(DP) == 1:
            return None
        comm = owner.comm if isinstance(getattr(owner, "comm", None), Comm) else block.comm(DP)

        def total(squares: torch.Tensor) -> torch.Tensor:
            out = squares.to(block.device).reshape(1).clone()
            comm.all_reduce(out, name="diloco.norm")
            return out[0].cpu()
        return total

    def _scope(self, topo: Topology) -> str:
        return f"replica{self.replica(topo)}"

    # ---- the inner strategy on this rank's replica ------------------------------------------------
    def data_parallel(self, topo: Topology) -> tuple[int, int]:
        shards, shard = self.inner_strategy.data_parallel(self.block(topo)[0])
        return self.replicas * shards, self.replica(topo) * shards + shard

    def owns_loss(self, topo: Topology) -> bool:
        return self.inner_strategy.owns_loss(self.block(topo)[0])

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self.inner_strategy.no_sync(model)

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        return self.inner_strategy.train_step(model, micro_batches, loss_fn, self.block(topo)[0], run)

    def eval_step(self, model: nn.Module, x: Any, y: Any, fn: Callable[[Any, Any], torch.Tensor], topo: Topology,
                  run: StepRun = StepRun()) -> torch.Tensor | None:
        return self.inner_strategy.eval_step(model, x, y, fn, self.block(topo)[0], run)

    def param_names(self, model: nn.Module) -> dict[int, str]:
        return self.inner_strategy.param_names(model)

    def compile_refusal(self) -> str | None:
        return self.inner_strategy.compile_refusal()

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner_strategy.check_optimizer(optimizer)

    def check_model(self, model: nn.Module, devices: int, batch_size: int, accumulate_grad_batches: int,
                    backend: str = "gloo") -> None:
        self.inner_strategy.check_model(model, devices // self.replicas, batch_size // self.replicas,
                                        accumulate_grad_batches, backend)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        """The replica's gradient norm, clipped inside the replica (the inner step's own clip)."""
        return self.inner_strategy.clip_grad_norm(model, max_norm, self.block(topo)[0])

    # ---- state: the global weights, the outer optimizer, each replica's own ----------------------
    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        """The global weights, gathered as the inner strategy gathers them: those of the last sync, once the
        syncs still in flight are applied (now, before their delay is over)."""
        model.diloco_loop.complete()  # type: ignore[union-attr,operator]
        with model.diloco_loop.global_in_place():  # type: ignore[union-attr,operator]
            return self.inner_strategy.full_state_dict(model, self.block(topo)[0])

    def final_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        model.diloco_loop.complete()  # type: ignore[union-attr,operator]
        with model.diloco_loop.global_in_place():  # type: ignore[union-attr,operator]
            full = self.inner_strategy.final_state_dict(model, self.block(topo)[0])
        return full if topo.rank == 0 else {}

    def checkpoint_held(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology) -> list[Held]:
        """The global weights under the plain keys (``model.<fqn>``: what an export or another strategy reads),
        the outer optimizer's states (``outer/optim.<fqn>.<state>``) and the inner step count, and this replica's
        own weights and inner states (``replica<r>/model.<fqn>``, ``replica<r>/optim.<fqn>.<state>``). Buffers
        (and frozen parameters, which no sync touches) are kept once, under their plain key."""
        assert isinstance(optimizer, DiLoCoOptimizer)
        loop, scope = optimizer.loop, self._scope(topo)
        if loop.in_flight:
            raise ValueError(f"DiLoCo cannot checkpoint after inner step {int(loop.steps)}: a fragment's sync is in "
                             f"flight there (delay={self.delay}); checkpoint at a step where none is")
        out = [Held(STEPS_KEY, loop.steps)]
        for h in self.inner_strategy.checkpoint_held(model, optimizer.optimizer, self.block(topo)[0]):
            out += _held_of(h, loop, scope)
        return out

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        assert isinstance(optimizer, DiLoCoOptimizer)
        own = self.inner_strategy.state_tensors(model, optimizer.optimizer)
        return {**own, "outer": optimizer.loop.tensors()}


def _held_of(h: Held, loop: OuterLoop, scope: str) -> list[Held]:
    """What one of the inner strategy's entries becomes: a parameter piece the outer loop steps gives the
    replica's own entry, the global weights' and the outer states'; anything else stays as it is."""
    if not h.key.startswith("model."):
        return [dataclasses.replace(h, key=scoped(scope, h.key))]  # an inner optimizer state
    found = each_piece(loop.local, h.data)
    if found is None:
        return [h]  # a buffer or a frozen parameter: one copy
    i, offset = found
    weights, fqn = loop.global_weights[i], h.key[len("model."):]
    out = [dataclasses.replace(h, key=scoped(scope, h.key)),
           dataclasses.replace(h, data=same_view(weights, h.data, offset))]
    for state, v in outer_states(loop.outer, weights).items():
        key = scoped(OUTER_SCOPE, f"optim.{fqn}.{state}")
        out.append(Held(key, v) if v.dim() == 0 else dataclasses.replace(h, key=key, data=same_view(v, h.data, offset)))
    return out


__all__ = ["DiLoCo"]
