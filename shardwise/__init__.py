"""shardwise: train one PyTorch model across many processes, devices and machines."""
from shardwise.launch import init
from shardwise.strategy import DDP, REGISTRY, Single, Strategy, register, resolve
from shardwise.topology import Topology, teardown
from shardwise.trainer import FitResult, Trainer, setup

__all__ = ["DDP", "FitResult", "REGISTRY", "Single", "Strategy", "Topology", "Trainer", "init", "register",
           "resolve", "setup", "teardown"]
__version__ = "0.1.0"
