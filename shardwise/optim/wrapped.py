"""An optimizer that wraps a real torch optimizer and shares its groups and state: the base of the wrappers
that add what a step needs around the user's optimizer (ZeRO/FSDP's communication, fp16's loss scaling).

``param_groups`` and ``state`` are the inner optimizer's own objects, so learning-rate schedulers, a loop that
sets ``g["lr"]``, and checkpoints see and change the real ones.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """Delegates to ``optimizer`` (``.optimizer``); subclasses override :meth:`step` (and what else they add)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # The base __init__ would build param_groups of its own; we share the inner optimizer's instead.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__}'s parameters are fixed by the model it was set up with")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


__all__ = ["WrappedOptimizer"]
