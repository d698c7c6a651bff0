"""shardwise: train one PyTorch model across many processes, devices and machines.

Every public name is imported on first use (PEP 562), so ``import shardwise``
and ``shardwise --help`` do not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> "module:attribute". Strategy classes (sw.ZeRO3, sw.Parallel, ...) come from
# strategy.CLASSES, looked up after this table.
_PUBLIC: dict[str, str] = {
    "init": "shardwise.loop:init",
    "Prepared": "shardwise.loop:Prepared",
    "Callback": "shardwise.callbacks:Callback",
    "EarlyStopping": "shardwise.callbacks:EarlyStopping",
    "all_reduce_mean": "shardwise.loop:all_reduce_mean",
    "clip_grad_norm_": "shardwise.loop:clip_grad_norm_",
    "gather": "shardwise.loop:gather",
    "no_sync": "shardwise.loop:no_sync",
    "prepare_dataloader": "shardwise.loop:prepare_dataloader",
    "save": "shardwise.loop:save",
    "load": "shardwise.loop:load",
    "CLASSES": "shardwise.strategy:CLASSES",
    "DDP": "shardwise.strategy:DDP",
    "REGISTRY": "shardwise.strategy:REGISTRY",
    "Single": "shardwise.strategy:Single",
    "Strategy": "shardwise.strategy:Strategy",
    "available_strategies": "shardwise.strategy:available_strategies",
    "register": "shardwise.strategy:register",
    "resolve": "shardwise.strategy:resolve",
    "Topology": "shardwise.topology:Topology",
    "teardown": "shardwise.topology:teardown",
    "FitResult": "shardwise.trainer:FitResult",
    "Trainer": "shardwise.trainer:Trainer",
    "setup": "shardwise.loop:setup",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name is imported on first use
    from shardwise.callbacks import Callback, EarlyStopping
    from shardwise.loop import (Prepared, all_reduce_mean, clip_grad_norm_, gather, init, load, no_sync,
                                prepare_dataloader, save, setup)
    from shardwise.strategy import CLASSES, DDP, REGISTRY, Single, Strategy, available_strategies, register, resolve
    from shardwise.topology import Topology, teardown
    from shardwise.trainer import FitResult, Trainer


def __getattr__(name: str) -> Any:
    target = _PUBLIC.get(name)
    if target is None:
        from shardwise.strategy import CLASSES

        target = CLASSES.get(name)
    if target is None:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    from shardwise.strategy import CLASSES

    return sorted({*globals(), *_PUBLIC, *CLASSES})


__all__ = ["Callback", "DDP", "EarlyStopping", "FitResult", "Prepared", "REGISTRY", "Single", "Strategy", "Topology", "Trainer",
           "all_reduce_mean", "available_strategies", "clip_grad_norm_", "gather", "init", "load", "no_sync",
           "prepare_dataloader", "register", "resolve", "save", "setup", "teardown", "NaiveMP", "NaiveModelParallel", "ZeRO1", "ZeRO2",
           "ZeRO3", "FSDP", "HSDP", "TP", "PP", "Parallel", "DP", "ParameterServer"]
