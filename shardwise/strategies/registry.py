"""Strategy names -> strategy classes: the one table ``strategy="..."`` and ``sw.<Class>`` are looked up in.

Built-in strategies are imported only when named, so that importing the core
never imports every paradigm; :func:`register` adds a user's own.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from shardwise.strategies.base import Strategy

# Built-in strategies live with their paradigm in shardwise/parallel/ and are
# imported only when named, so that the core never imports every paradigm.
BUILTIN: dict[str, str] = {
    "single": "shardwise.strategies.single:Single",
    "ddp": "shardwise.strategies.ddp:DDP",
    "dp": "shardwise.strategies.dp:DP",
    "ps": "shardwise.strategies.ps:ParameterServer",
    "zero1": "shardwise.strategies.zero:ZeRO1",
    "zero2": "shardwise.strategies.zero:ZeRO2",
    "zero3": "shardwise.strategies.fsdp:ZeRO3",
    "fsdp": "shardwise.strategies.fsdp:FSDP",
    "hsdp": "shardwise.strategies.fsdp:HSDP",
    "tp": "shardwise.strategies.tp:TP",
    "pp": "shardwise.strategies.pp:PP",
    "parallel": "shardwise.strategies.parallel:Parallel",
}


# Strategy classes reachable as ``sw.<Name>`` without a name of their own in BUILTIN.
CLASSES: dict[str, str] = {
    **{target.partition(":")[2]: target for target in BUILTIN.values()},
    "NaiveMP": "shardwise.strategies.naive_mp:NaiveMP",
    "NaiveModelParallel": "shardwise.parallel.naive_mp:NaiveModelParallel",
}


REGISTRY: dict[str, Callable[[], Strategy]] = {}


def register(name: str, factory: Callable[[], Strategy]) -> None:
    """Make ``name`` a valid ``strategy=`` string (for user-defined strategies)."""
    REGISTRY[name] = factory


def load(target: str) -> Any:
    """``"module:Attr"`` imported. An ImportError inside a strategy's module propagates with its traceback:
    it is a broken installation or a bug, not an unknown strategy."""
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _load_builtin(name: str) -> Callable[[], Strategy]:
    return load(BUILTIN[name])  # type: ignore[no-any-return]


def available_strategies() -> list[str]:
    """Every name ``strategy=`` accepts, in the order of the README's strategy table, then registered ones."""
    return list(BUILTIN) + [n for n in REGISTRY if n not in BUILTIN]


def resolve(strategy: str | Strategy) -> Strategy:
    """A strategy object for a name or an object; unknown names list the valid ones."""
    if isinstance(strategy, Strategy):
        return strategy
    factory = None
    if isinstance(strategy, str):
        factory = REGISTRY.get(strategy) or (_load_builtin(strategy) if strategy in BUILTIN else None)
    if factory is None:
        raise ValueError(f"unknown strategy {strategy!r}; valid strategies: {', '.join(available_strategies())}")
    return factory()
