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
    "init": "shardwise.loop.prepared:init",
    "Prepared": "shardwise.loop.prepared:Prepared",
    "Callback": "shardwise.fit.callbacks:Callback",
    "EarlyStopping": "shardwise.fit.callbacks:EarlyStopping",

    "all_reduce_mean": "shardwise.loop.data:all_reduce_mean",
    "clip_grad_norm_": "shardwise.loop.calls:clip_grad_norm_",
    "clip_grad_value_": "shardwise.loop.calls:clip_grad_value_",
    "gather": "shardwise.loop.data:gather",
    "gather_for_metrics": "shardwise.loop.data:gather_for_metrics",
    "no_sync": "shardwise.loop.calls:no_sync",
    "prepare_dataloader": "shardwise.loop.data:prepare_dataloader",
    "save": "shardwise.loop.calls:save",
    "load": "shardwise.loop.calls:load",
    "register_for_checkpointing": "shardwise.loop.prepared:register_for_checkpointing",
    "end_training": "shardwise.loop.prepared:end_training",
    "is_main_process": "shardwise.loop.output:is_main_process",
    "print": "shardwise.loop.output:print",  # not in __all__: `from shardwise import *` keeps the built-in
    "main_process_first": "shardwise.loop.output:main_process_first",
    "CLASSES": "shardwise.strategies.registry:CLASSES",
    "DDP": "shardwise.strategies.dp.ddp:DDP",
    "REGISTRY": "shardwise.strategies.registry:REGISTRY",
    "Single": "shardwise.strategies.single:Single",
    "Strategy": "shardwise.strategies.base:Strategy",
    "available_strategies": "shardwise.strategies.registry:available_strategies",
    "register": "shardwise.strategies.registry:register",
    "resolve": "shardwise.strategies.registry:resolve",
    "Topology": "shardwise.comm.topology:Topology",
    "teardown": "shardwise.comm.topology:teardown",
    "FaultTolerance": "shardwise.ft.options:FaultTolerance",
    "FitResult": "shardwise.fit.trainer:FitResult",
    "Trainer": "shardwise.fit.trainer:Trainer",
    "configured": "shardwise.fit.config:configured",
    "setup": "shardwise.loop.prepared:setup",
    "log": "shardwise.loggers.scalars:log",
    "seed_everything": "shardwise.seeding:seed_everything",
    "loggers": "shardwise.loggers:",  # the module itself: sw.loggers.CSV, sw.loggers.MLflow, ...
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name is imported on first use
    from shardwise import loggers
    from shardwise.comm.topology import Topology, teardown
    from shardwise.fit.callbacks import Callback, EarlyStopping
    from shardwise.fit.config import configured
    from shardwise.fit.trainer import FitResult, Trainer
    from shardwise.ft.options import FaultTolerance
    from shardwise.loggers.scalars import log
    from shardwise.loop.calls import clip_grad_norm_, clip_grad_value_, load, no_sync, save
    from shardwise.loop.data import all_reduce_mean, gather, gather_for_metrics, prepare_dataloader
    from shardwise.loop.output import is_main_process, main_process_first
    from shardwise.loop.output import print as print  # not in __all__: keeps the built-in under import *
    from shardwise.loop.prepared import Prepared, end_training, init, register_for_checkpointing, setup
    from shardwise.seeding import seed_everything
    from shardwise.strategies.base import Strategy
    from shardwise.strategies.dp.ddp import DDP
    from shardwise.strategies.registry import (
        CLASSES,
        REGISTRY,
        available_strategies,
        register,
        resolve,
    )
    from shardwise.strategies.single import Single


def __getattr__(name: str) -> Any:
    target = _PUBLIC.get(name)
    if target is None:
        from shardwise.strategies.registry import CLASSES

        target = CLASSES.get(name)
    if target is None:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = importlib.import_module(module)
    value = getattr(value, attr) if attr else value
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    from shardwise.strategies.registry import CLASSES

    return sorted({*globals(), *_PUBLIC, *CLASSES})


__all__ = ["CLASSES", "Callback", "DDP", "EarlyStopping", "FaultTolerance", "FitResult", "Prepared", "REGISTRY",
           "Single", "Strategy", "Topology", "Trainer", "all_reduce_mean", "available_strategies", "clip_grad_norm_",
           "clip_grad_value_", "configured", "end_training", "gather", "gather_for_metrics", "init",
           "is_main_process", "load", "log", "main_process_first", "no_sync", "prepare_dataloader", "register",
           "register_for_checkpointing", "resolve", "save", "seed_everything", "setup", "teardown", "NaiveMP",
           "NaiveModelParallel", "ZeRO1", "ZeRO2", "ZeRO3", "FSDP", "HSDP", "TP", "PP", "Parallel", "DP",
           "ParameterServer", "DiLoCo", "loggers"]
