"""What a logger is: the protocol the fit writes through, and the names ``Trainer(logger=)`` accepts.

Standard library only: a logger's library (tensorboard, mlflow, wandb) is
imported by that logger when it opens its run, on the rank that writes.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

# What finalize() is told: the run ended normally, or an exception ended it.
SUCCESS, FAILED = "success", "failed"
METHODS = ("log_hyperparams", "log_metrics", "finalize")


class Logger(Protocol):
    """Where rank 0 writes a run's hyperparameters and scalars.

    ``log_hyperparams`` comes first (it may open the run), then ``log_metrics`` for
    every logged step and validation, then ``finalize`` once. Metric names are
    ``train/<name>`` (``train/loss``, ``train/lr/0``, ``train/grad_norm``, ...) and
    ``val/<name>`` (``val/val_loss``, each ``val_metrics`` name); values are
    numbers or flags.
    """

    def log_hyperparams(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def finalize(self, status: str) -> None: ...


@runtime_checkable
class Resumable(Protocol):
    """A logger that says where its run is (``run_ref``) and reopens it (``resume``).

    ``run_ref()`` (JSON values, valid once the run is open) is kept in every
    checkpoint's manifest and returned in ``FitResult.loggers``. A run that
    resumes from a checkpoint after ``step`` steps calls ``resume(step, ref)``
    before anything else, with the ref that checkpoint kept (None when it kept
    none for this logger): a tracker reopens that run, a file drops the rows
    of steps at or past ``step`` (an interrupted attempt's, trained again).
    """

    def run_ref(self) -> dict[str, Any]: ...

    def resume(self, step: int, ref: dict[str, Any] | None) -> None: ...


def check_logger(logger: Any) -> Logger:
    """An object of the :class:`Logger` protocol, or a TypeError naming what it lacks."""
    if isinstance(logger, type):
        raise TypeError(f"logger holds the class {logger.__name__}, not an instance: pass {logger.__name__}(...)")
    missing = [m for m in METHODS if not callable(getattr(logger, m, None))]
    if missing:
        raise TypeError(f"logger {logger!r} lacks {', '.join(missing)}: a logger has the methods "
                        f"{', '.join(METHODS)} (shardwise.loggers.Logger)")
    return logger  # type: ignore[no-any-return]


def check_hparams(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``fit(hparams=)`` as a dict (None stays None), or a TypeError: a mapping with string keys."""
    if params is None:
        return None
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise TypeError(f"hparams must be a dict with string keys, got {params!r}")
    return dict(params)


def keys(loggers: list[Any]) -> list[str]:
    """Each logger's key in checkpoints and ``FitResult.loggers``: its ``name`` (or class name, lower case),
    ``name.1``, ``name.2``... for repeats, in the order given."""
    out: list[str] = []
    for lg in loggers:
        name = str(getattr(lg, "name", type(lg).__name__.lower()))
        seen = sum(1 for k in out if k == name or k.startswith(name + "."))
        out.append(f"{name}.{seen}" if seen else name)
    return out


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested hyperparameters as one level of ``a/b`` keys (a tracker's parameters are flat)."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, Mapping) for x in v):
            for i, x in enumerate(v):
                out.update(flatten(x, f"{key}/{i}/"))
        else:
            out[key] = v
    return out


__all__ = ["FAILED", "Logger", "Resumable", "SUCCESS", "check_hparams", "check_logger", "flatten", "keys"]
