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
of each full parameter (see :mod:`shardwise.parallel.dp.sharding` for the layout),
so its update rule runs unchanged on the piece, and writes straight into the
full parameter before the all-gather spreads it.

This module holds that optimizer (:class:`ShardedOptimizer`, shared with
FSDP) and the offload and clipping helpers; the wrapper and its buckets are
:mod:`shardwise.parallel.dp.zero_module`, the strategies :mod:`shardwise.strategies.dp.zero`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.comm import Comm
from shardwise.optim.wrapped import WrappedOptimizer
from shardwise.parallel.clip import clip_global_norm


class ShardedOptimizer(WrappedOptimizer):
    """A real torch optimizer over shard parameters, with the communication its step needs around it.

    ``param_groups`` and ``state`` are the inner optimizer's own (so learning-rate
    schedulers work); ``.optimizer`` is the inner optimizer. ``owner`` is the
    wrapped model, which knows how to finish the gradients before the update
    (:meth:`before_step`), spread the updated parameters after it
    (:meth:`after_step`) and drop gradients (:meth:`zero_grad`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, owner: Any) -> None:
        super().__init__(optimizer)
        self.owner = owner

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
        """This rank's shard of the optimizer state (torch layout); see ``Strategy.checkpoint_held`` for the global
        one."""
        return self.optimizer.state_dict()


OFFLOADS = ("none", "optimizer", "all")


def check_offload(offload: str, strategy: str, stage: int) -> None:
    """Reject an unknown offload, or one this stage cannot do, when the strategy object is made."""
    if offload not in OFFLOADS:
        raise ValueError(f"unknown offload {offload!r}; use one of {', '.join(OFFLOADS)}")
    if offload == "all" and stage < 3:
        raise ValueError(f"offload='all' moves the parameter shards to the host too, but strategy {strategy!r} "
                         "keeps full parameters on every device; use offload='optimizer' with it, or "
                         "'zero3'/'fsdp'/'hsdp' for offload='all'")


def zero_clip_grad_norm(grads: Sequence[torch.Tensor], max_norm: float, comm: Comm, name: str,
                        device: torch.device | None = None) -> torch.Tensor:
    """Clip sharded gradients by the norm of the whole (global) gradient.

    Each rank holds disjoint pieces (padding is zero), so the squared norms add
    up over ``comm``'s group: one all-reduce of a scalar, on ``device`` (the
    communication device; offloaded gradients live elsewhere).
    """
    here = grads[0].device if grads else (device or torch.device("cpu"))
    return clip_global_norm(grads, grads, max_norm, [(comm, name)], device or here)


