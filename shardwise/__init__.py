"""shardwise: train one PyTorch model across many processes, devices and machines."""
from __future__ import annotations

import importlib
from typing import Any

from shardwise.launch import init
from shardwise.strategy import DDP, REGISTRY, Single, Strategy, available_strategies, register, resolve
from shardwise.topology import Topology, teardown
from shardwise.trainer import FitResult, Trainer, setup

# Strategy objects of the other paradigms, imported on first use.
_LAZY = {
    "DP": "shardwise.parallel.dp", "ParameterServer": "shardwise.parallel.ps",
    "ZeRO1": "shardwise.parallel.zero", "ZeRO2": "shardwise.parallel.zero",
    "ZeRO3": "shardwise.parallel.fsdp", "FSDP": "shardwise.parallel.fsdp", "HSDP": "shardwise.parallel.fsdp",
    "TP": "shardwise.parallel.tp", "PP": "shardwise.parallel.pipeline", "Parallel": "shardwise.parallel.compose",
    "NaiveMP": "shardwise.parallel.naive_mp", "NaiveModelParallel": "shardwise.parallel.naive_mp",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")


__all__ = ["DDP", "FitResult", "REGISTRY", "Single", "Strategy", "Topology", "Trainer", "available_strategies",
           "init", "register", "resolve", "setup", "teardown", *_LAZY]
__version__ = "0.1.0"
