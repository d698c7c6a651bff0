"""ZeRO stages 1 and 2: optimizer states (and gradients) sharded over data-parallel ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC20), section 5: with ``N`` data-parallel ranks,

* stage 1 (P_os) keeps the full parameters and gradients on every rank but only
  ``1/N`` of the optimizer states; each rank updates its ``1/N`` of the
  parameters and the updated pieces are all-gathered;
* stage 2 (P_os+g) also keeps only ``1/N`` of the gradients: they are
  reduce-scattered in buckets while backward runs, and the full gradient of a
  bucket is freed as soon as it has been sent.

Both move ``2 x (N-1)/N x Psi`` bytes per rank and step (section 7.2: a
reduce-scatter of the gradients plus an all-gather of the parameters), the same
as plain data parallelism's all-reduce.

The optimizer is never re-implemented: the user's factory builds a real
``torch.optim`` optimizer over *shard parameters*, views of this rank's piece
of each full parameter (see :mod:`shardwise.parallel.sharding` for the layout),
so its update rule runs unchanged on the piece, and writes straight into the
full parameter before the all-gather spreads it.

This module holds that optimizer (:class:`ShardedOptimizer`, shared with
FSDP), the offload and clipping helpers and the strategies (``ZeRO1``,
``ZeRO2``); the wrapper :class:`ZeROModule` and its buckets live in
:mod:`shardwise.parallel.zero_module` (issue 11: small modules), and
``ZeROModule`` stays importable from here.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.comm import Comm
from shardwise.parallel.zero_module import ZeROModule
from shardwise.layout import RunLayout
from shardwise.strategy import OptimizerFactory, Strategy, unwrap
from shardwise.topology import Topology


class ShardedOptimizer(torch.optim.Optimizer):
    """A real torch optimizer over shard parameters, with the communication its step needs around it.

    ``param_groups`` and ``state`` are the inner optimizer's own (so learning-rate
    schedulers work); ``.optimizer`` is the inner optimizer. ``owner`` is the
    wrapped model, which knows how to finish the gradients before the update
    (:meth:`before_step`), spread the updated parameters after it
    (:meth:`after_step`) and drop gradients (:meth:`zero_grad`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, owner: Any) -> None:
        # The base __init__ would build param_groups of its own; we share the inner optimizer's instead.
        self.optimizer = optimizer
        self.owner = owner
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.owner.before_step()
        self.optimizer.step()
        self.owner.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.owner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (torch layout); see ``Strategy.checkpoint_held`` for the global one."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("a sharded optimizer's parameters are fixed by the model it was set up with")

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.optimizer!r})"


OFFLOADS = ("none", "optimizer", "all")


def check_offload(offload: str, strategy: str, stage: int) -> None:
    """Reject an unknown offload, or one this stage cannot do, when the strategy object is made."""
    if offload not in OFFLOADS:
        raise ValueError(f"unknown offload {offload!r}; use one of {', '.join(OFFLOADS)}")
    if offload == "all" and stage < 3:
        raise ValueError(f"offload='all' moves the parameter shards to the host too, but strategy {strategy!r} "
                         "keeps full parameters on every device; use offload='optimizer' with it, or "
                         "'zero3'/'fsdp'/'hsdp' for offload='all'")


def _check_not_meta(model: nn.Module, name: str) -> None:
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(f"strategy {name!r} keeps full parameters on every rank, so it cannot set up a model "
                         "on the meta device; use 'zero3' or 'fsdp', which materialise it shard by shard")


def zero_clip_grad_norm(grads: Sequence[torch.Tensor], max_norm: float, comm: Comm, name: str,
                        device: torch.device | None = None) -> torch.Tensor:
    """Clip sharded gradients by the norm of the whole (global) gradient.

    Each rank holds disjoint pieces (padding is zero), so the squared norms add
    up over ``comm``'s group: one all-reduce of a scalar, on ``device`` (the
    communication device; offloaded gradients live elsewhere).
    """
    from shardwise.parallel.sharding import clip_global_norm

    here = grads[0].device if grads else (device or torch.device("cpu"))
    return clip_global_norm(grads, grads, max_norm, [(comm, name)], device or here)


@dataclass
class ZeRO1(Strategy):
    """ZeRO stage 1: optimizer states sharded; full parameters and gradients on every rank.

    Gradients are reduce-scattered in buckets while backward runs (overlapping
    it, as DDP's all-reduce does) and every rank keeps its full local
    gradients as well. Under ``no_sync`` nothing is sent and the last
    micro-batch's backward reduces the accumulated gradients; if every
    backward ran under ``no_sync`` the reduction happens at the optimizer step
    (or at gradient clipping, which needs it first).

    Args:
        bucket_cap_mb: parameters are reduced and gathered in buckets of about this size.
        collectives: ``"native"`` (the backend's reduce-scatter and all-gather),
            ``"p2p"`` (pairwise isend/irecv exchange, same bytes) or ``"auto"``
            (p2p on gloo, whose reduce-scatter is slow; native otherwise).
        offload: ``"optimizer"`` keeps this rank's master pieces, gradient
            pieces and optimizer states on ``offload_device`` and runs the
            update there (ZeRO-Offload, Ren et al. 2021); ``"none"`` (default)
            keeps everything on the training device. ``"all"`` needs sharded
            parameters (``ZeRO3``/``FSDP``/``HSDP``) and is an error here.
        offload_device: where offloaded state lives (default ``"cpu"``).
    """

    bucket_cap_mb: float = 4.0
    collectives: str = "auto"
    offload: str = "none"
    offload_device: str = "cpu"
    name: ClassVar[str] = "zero1"
    stage: ClassVar[int] = 1

    def __post_init__(self) -> None:
        check_offload(self.offload, self.name, self.stage)

    def describe(self, devices: int) -> RunLayout:
        return replace(super().describe(devices), zero=self.stage, offload=self.offload)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        from shardwise.parallelize import DataParallelOptions, wrap_module

        _check_not_meta(model, self.name)
        opts = DataParallelOptions(zero=self.stage, bucket_cap_mb=self.bucket_cap_mb, collectives=self.collectives,
                                   offload=self.offload, offload_device=self.offload_device)
        wrapped = wrap_module(model.to(topo.device), topo, opts)
        return wrapped, ShardedOptimizer(optimizer_fn(wrapped.shard_params), wrapped)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        zm: ZeROModule = model  # type: ignore[assignment]
        zm.before_step()
        return zero_clip_grad_norm(zm.shard_grads(), max_norm, zm.comm, "zero_clip", device=topo.device)

@dataclass
class ZeRO2(ZeRO1):
    """ZeRO stage 2: optimizer states and gradients sharded.

    Buckets are reduce-scattered while backward runs (overlapping it) and each
    rank keeps only its piece of the gradient. Under ``no_sync`` the full
    gradients accumulate locally and the last micro-batch's backward sends
    them, so accumulation costs no extra communication (it does hold the full
    gradients during the accumulation, as FSDP2 does).
    """

    name: ClassVar[str] = "zero2"
    stage: ClassVar[int] = 2
