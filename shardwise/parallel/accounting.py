"""Which tensors a rank holds for the model state, by kind: the exact byte account of ``FitResult.stats``.

A data-parallel wrapper reports its own (flat buckets, shard rows, host
copies, ``model_state_tensors``); a bare module its parameters and gradients;
:func:`with_optimizer_states` adds the optimizer's states.
"""
from __future__ import annotations

import torch
from torch import nn


def model_state_tensors(module: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Parameter and gradient tensors ``module`` holds: its wrapper's account, or its parameters and ``.grad``."""
    if hasattr(module, "model_state_tensors"):
        return module.model_state_tensors()  # type: ignore[no-any-return,operator]
    params = list(module.parameters())
    return {"params": params, "grads": [p.grad for p in params if p.grad is not None]}  # type: ignore[dict-item]


def with_optimizer_states(parts: dict[str, list[torch.Tensor]],
                          optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """``parts`` plus the optimizer's state tensors (host memory when the wrapper offloads)."""
    out: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "optimizer": []}
    for k, v in parts.items():
        out.setdefault(k, []).extend(v)
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out.setdefault("host_optimizer" if "host_params" in out else "optimizer", []).extend(states)
    return out
