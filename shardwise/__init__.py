"""shardwise: train one PyTorch model across many processes, devices and machines."""
from __future__ import annotations

from typing import Any

from shardwise.launch import init
from shardwise.strategy import CLASSES, DDP, REGISTRY, Single, Strategy, available_strategies, load, register, resolve
from shardwise.topology import Topology, teardown
from shardwise.trainer import FitResult, Trainer, setup



def __getattr__(name: str) -> Any:
    # Strategy objects of the other paradigms (strategy.CLASSES), imported on first use.
    if name in CLASSES:
        return load(CLASSES[name])
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")


__all__ = ["DDP", "FitResult", "REGISTRY", "Single", "Strategy", "Topology", "Trainer", "available_strategies",
           "init", "register", "resolve", "setup", "teardown", *CLASSES]
__version__ = "0.1.0"
