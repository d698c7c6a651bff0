"""Strategy names -> strategy classes: the one table ``strategy="..."`` and ``sw.<Class>`` are looked up in.

Built-in strategies are imported only when named, so that importing the core
never imports every paradigm; :func:`register` adds a user's own.
"""
from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from shardwise.strategies.base import Strategy

# Built-in strategies live with their paradigm in shardwise/parallel/ and are
# imported only when named, so that the core never imports every paradigm.
BUILTIN: dict[str, str] = {
    "single": "shardwise.strategies.single:Single",
    "ddp": "shardwise.strategies.dp.ddp:DDP",
    "dp": "shardwise.strategies.dp.threaded:DP",
    "ps": "shardwise.strategies.ps:ParameterServer",
    "zero1": "shardwise.strategies.dp.zero:ZeRO1",
    "zero2": "shardwise.strategies.dp.zero:ZeRO2",
    "zero3": "shardwise.strategies.dp.fsdp:ZeRO3",
    "fsdp": "shardwise.strategies.dp.fsdp:FSDP",
    "hsdp": "shardwise.strategies.dp.fsdp:HSDP",
    "tp": "shardwise.strategies.tp:TP",
    "pp": "shardwise.strategies.pp:PP",
    "parallel": "shardwise.strategies.parallel:Parallel",
    "diloco": "shardwise.strategies.diloco:DiLoCo",
}


# Strategy classes reachable as ``sw.<Name>`` without a name of their own in BUILTIN.
CLASSES: dict[str, str] = {
    **{target.partition(":")[2]: target for target in BUILTIN.values()},
    "NaiveMP": "shardwise.strategies.naive_mp:NaiveMP",
    "NaiveModelParallel": "shardwise.parallel.pp.naive_mp:NaiveModelParallel",
}


# Lightning's strategy names, and what runs the same training here (refused with it: never taken silently).
LIGHTNING: dict[str, str] = {
    "ddp_spawn": "'ddp'", "ddp_fork": "'ddp'", "ddp_notebook": "'ddp'",
    "ddp_find_unused_parameters_true": "sw.DDP(find_unused_parameters=True)",
    "ddp_find_unused_parameters_false": "'ddp'",
    "deepspeed": "'zero2'", "deepspeed_stage_1": "'zero1'", "deepspeed_stage_2": "'zero2'",
    "deepspeed_stage_3": "'zero3'", "deepspeed_stage_2_offload": "sw.ZeRO2(offload='optimizer')",
    "deepspeed_stage_3_offload": "sw.ZeRO3(offload='optimizer')", "fsdp_cpu_offload": "sw.FSDP(offload='optimizer')",
    "single_device": "'single'",
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


def canonical_name(name: str) -> str | None:
    """The strategy name ``name`` spells, in any case ("DDP", "Zero3"); None for an unknown one. A registered
    name is matched exactly first, so that names differing only in case stay apart."""
    if name in REGISTRY or name in BUILTIN:
        return name
    matches = [n for n in available_strategies() if n.lower() == name.lower()]
    return matches[0] if len(matches) == 1 else None


def resolve(strategy: str | Strategy) -> Strategy:
    """A strategy object for a name (in any case) or an object; unknown names list the valid ones and the
    nearest ("did you mean 'ddp'?")."""
    if isinstance(strategy, Strategy):
        return strategy
    factory = None
    name = canonical_name(strategy) if isinstance(strategy, str) else None
    if name is not None:
        factory = REGISTRY.get(name) or (_load_builtin(name) if name in BUILTIN else None)
    if factory is None and isinstance(strategy, str) and (strategy in LIGHTNING or strategy == "auto"):
        raise ValueError(lightning_name(strategy))
    if factory is None:
        valid = available_strategies()
        message = f"unknown strategy {strategy!r}; valid strategies: {', '.join(valid)}"
        if isinstance(strategy, str):
            lowered = {n.lower(): n for n in valid}
            near = difflib.get_close_matches(strategy.lower(), list(lowered))
            if near:
                names = [repr(lowered[n]) for n in near]
                said = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
                message += f"; did you mean {said}?"
        raise ValueError(message)
    return factory()


def lightning_name(name: str) -> str:
    """The refusal of Lightning's strategy ``name``, naming ours."""
    if name == "auto":
        return ("strategy 'auto' is Lightning's choice by device count; name one here: 'ddp' for several "
                "devices, 'single' for one (the default)")
    return f"strategy {name!r} is Lightning's name: it is {LIGHTNING[name]} here"
