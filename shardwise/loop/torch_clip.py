"""torch's own clip functions on a model from ``sw.setup``: routed to the strategy's clip, or refused.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` is what a hand-written loop already calls; under a
strategy that shards or slices the gradients it would clip the wrong tensors, so :func:`guard_torch_clip`
replaces torch's functions (once per process) with ones that send a prepared model's parameters to its
strategy (:mod:`shardwise.loop.prepared`) and leave every other call to torch.
"""
from __future__ import annotations

import contextvars
import functools
import weakref
from typing import Any

import torch
import torch.nn.utils as utils
import torch.nn.utils.clip_grad as clip_grad

# Set while a routed call runs the strategy's clip, which may call torch's on the tensors it holds.
_ROUTED: contextvars.ContextVar[bool] = contextvars.ContextVar("shardwise_clip_routed", default=False)


def guard_torch_clip(models: weakref.WeakSet[Any]) -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` over a model from :func:`setup`'s
    parameters (``models``: every live one, as :func:`~shardwise.loop.prepared.setup` adds them).

    Under ZeRO-2/3, FSDP and tensor parallelism a rank holds pieces of the gradients (or none, on the full
    parameters), so torch's functions would clip the wrong tensors and silently clip nothing right: a norm of
    0.0 under zero2 and fsdp. Given exactly a prepared model's parameters, the strategy's clip runs instead;
    given some of them, it raises with the fix.
    """
    if getattr(utils.clip_grad_norm_, "_shardwise_guard", False):
        return
    norm = _routed(utils.clip_grad_norm_, "clip_grad_norm_", lambda m, limit, *a, **k: m.clip_grad_norm_(limit),
                   lambda *a, **k: float(a[0] if a else k.get("norm_type", 2.0)) == 2.0, models)
    value = _routed(utils.clip_grad_value_, "clip_grad_value_", lambda m, limit, *a, **k: m.clip_grad_value_(limit),
                    lambda *a, **k: True, models)
    utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = norm
    utils.clip_grad_value_ = clip_grad.clip_grad_value_ = value


def _routed(original: Any, name: str, route: Any, supported: Any, models: weakref.WeakSet[Any]) -> Any:
    """``original`` (torch's clip function ``name``), sent to ``route(prepared, limit)`` when given exactly a
    prepared model's parameters (one of ``models``) and only options ``supported`` accepts; refused when given some
    of them."""
    @functools.wraps(original)
    def guarded(parameters: Any, limit: float, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _ROUTED.get():  # the strategy's own clip, which may call torch's on the tensors it holds
            return original(params, limit, *args, **kwargs)
        ids = {id(p) for p in params}
        for m in list(models):
            owned = {id(p) for p in m.parameters()}
            if ids & owned:
                if ids != owned or not supported(*args, **kwargs):
                    raise RuntimeError(f"torch.nn.utils.{name} on some parameters of a model from sw.setup"
                                       f"{' (or with norm_type != 2)' if 'norm' in name else ''}: "
                                       "under a sharded strategy each rank holds pieces of the gradients, so the "
                                       "clip must see all of them; use "
                                       f"sw.{name}(model, {'max_norm' if 'norm' in name else 'clip_value'})")
                token = _ROUTED.set(True)
                try:
                    return route(m, limit, *args, **kwargs)
                finally:
                    _ROUTED.reset(token)
        return original(params, limit, *args, **kwargs)

    guarded._shardwise_guard = True  # type: ignore[attr-defined]
    return guarded


__all__ = ["guard_torch_clip"]
