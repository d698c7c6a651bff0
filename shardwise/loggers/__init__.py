"""Experiment loggers: where a fit's hyperparameters and per-step scalars go (``Trainer(logger=...)``).

``sw.loggers.CSV(dir)``, ``TensorBoard(dir)``, ``JSONL(path)``, ``MLflow(tracking_uri=, experiment=,
run_name=)`` and ``WandB(project=, mode=)``, or any object of the :class:`Logger` protocol. Rank 0 writes;
see docs/how-to/loggers.md. MLflow and W&B are optional extras (``pip install 'shardwise[mlflow]'``,
``'shardwise[wandb]'``); each library is imported when its logger opens its run.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from shardwise.loggers.background import Background
from shardwise.loggers.base import FAILED, SUCCESS, Logger, Resumable, check_hparams, check_logger, flatten, keys
from shardwise.loggers.files import CSV, JSONL, ROOT, TensorBoard
from shardwise.loggers.trackers import MLflow, WandB, sqlite_uri

# Trainer(logger="csv", ...): the logger each name builds, writing under ``root`` (<checkpoint_dir>/logs, or
# shardwise_logs in the working directory).
NAMES: dict[str, Callable[[str], Any]] = {
    "csv": lambda root: CSV(os.path.join(root, "csv")),
    "tensorboard": lambda root: TensorBoard(os.path.join(root, "tensorboard")),
    "mlflow": lambda root: MLflow(tracking_uri=sqlite_uri(os.path.join(root, "mlflow.db"))),
    "wandb": lambda root: WandB(dir=root),
}


def resolve(given: Any, root: str = ROOT) -> list[Any]:
    """``Trainer(logger=)``: None (or Lightning's False), a name of :data:`NAMES`, a logger object, or a list of
    them, as loggers."""
    if given is None or given is False:
        return []
    out = []
    for item in given if isinstance(given, (list, tuple)) else [given]:
        if isinstance(item, str):
            if item.lower() not in NAMES:
                raise ValueError(f"unknown logger {item!r}; valid names: {', '.join(NAMES)} (or a logger object)")
            out.append(NAMES[item.lower()](root))
        else:
            out.append(check_logger(item))
    return out


__all__ = ["Background", "CSV", "FAILED", "JSONL", "Logger", "MLflow", "NAMES", "ROOT", "Resumable", "SUCCESS",
           "TensorBoard",
           "WandB", "check_hparams", "check_logger", "flatten", "keys", "resolve", "sqlite_uri"]
