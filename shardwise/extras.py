"""The optional features, the package each needs and the extra of ``pip install 'shardwise[...]'`` that adds it.

pyproject.toml's ``[project.optional-dependencies]`` installs these packages
(``all`` is every extra; tests/system/test_package.py checks that the two agree).
A feature checks for its package before it starts, so that a missing one is a
single line naming the extra, not an ImportError from deep inside a run.
Standard library only: the command line checks an extra before it imports torch.
"""
from __future__ import annotations

import importlib.util

# extra -> (the module imported, the package pip installs).
EXTRAS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),  # Trainer(tensorboard_dir=)
    "plots": ("matplotlib", "matplotlib"),  # --plot of `shardwise demo` and `shardwise bench`
    "demo": ("sklearn", "scikit-learn"),  # `shardwise demo` and the digits workload read its bundled digits
    "hf": ("transformers", "transformers"),  # Hugging Face models, `shardwise checkpoint export --format hf`
    "mlflow": ("mlflow", "mlflow-skinny"),  # sw.loggers.MLflow
    "wandb": ("wandb", "wandb"),  # sw.loggers.WandB
    "eval": ("torchmetrics", "torchmetrics"),  # trainer.validate/test with torchmetrics' metric objects
    "config": ("jsonargparse", "jsonargparse"),  # `shardwise fit --config`, sw.configured(main)
}
# extra -> the packages it installs beside its main one: MLflow's client keeps runs in a SQLite database
# through SQLAlchemy, whose schema alembic creates (mlflow-skinny leaves both out; the full mlflow adds a server
# and its UI, which a logger does not need).
ALSO: dict[str, tuple[str, ...]] = {"mlflow": ("sqlalchemy", "alembic")}


class MissingExtra(ImportError):
    """An optional feature's package is not installed; the message names the extra that installs it."""


def message(feature: str, extra: str) -> str:
    """``"shardwise demo needs scikit-learn: pip install 'shardwise[demo]'"``."""
    return f"{feature} needs {EXTRAS[extra][1]}: pip install 'shardwise[{extra}]'"


def installed(extra: str) -> bool:
    """Whether the package of ``extra`` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(EXTRAS[extra][0]) is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        return False


def require(feature: str, extra: str) -> None:
    """Raise :class:`MissingExtra` with :func:`message` when ``extra``'s package is not installed."""
    if not installed(extra):
        raise MissingExtra(message(feature, extra), name=EXTRAS[extra][0])


__all__ = ["ALSO", "EXTRAS", "MissingExtra", "installed", "message", "require"]
