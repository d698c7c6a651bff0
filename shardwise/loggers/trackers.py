"""Experiment trackers: :class:`MLflow` and :class:`WandB`, each a run that a resumed fit reopens.

Each imports its library when it opens its run (on rank 0, in the rank
process), and is built with its settings only, so that it pickles into spawned
ranks. Their run reference (``run_ref``: the run id, and where the run is) is
kept in every checkpoint's manifest and returned in ``FitResult.loggers``.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from shardwise.extras import require
from shardwise.loggers.base import FAILED, flatten
from shardwise.loggers.files import ROOT

# MLflow's limits for one log_batch call (mlflow.utils.validation): 100 parameters, 1000 metrics; a parameter's
# value is stored as a string of at most 6000 characters.
_PARAMS_PER_BATCH, _PARAM_CHARS = 100, 6000


_SQLITE = "sqlite:///"


def sqlite_uri(path: str) -> str:
    """The tracking URI of a SQLite database file (made absolute: every rank and a later resume find it)."""
    return f"{_SQLITE}{os.path.abspath(path)}"


def _sqlite_file(uri: str) -> str | None:
    """The database file of a SQLite tracking URI (None for another store)."""
    return uri[len(_SQLITE):] if uri.startswith(_SQLITE) else None


class MLflow:
    """An MLflow run: metrics under their names with their step, hyperparameters as the run's parameters.

    ``tracking_uri``: where runs are kept; default ``$MLFLOW_TRACKING_URI``, else a SQLite database
    ``shardwise_logs/mlflow.db`` (MLflow's client with SQLAlchemy; no server). ``experiment``: its name,
    created when missing. ``run_name``: MLflow picks one when None. A resumed fit logs into the run its
    checkpoint names (its status RUNNING again, then FINISHED or FAILED); parameters that run already has keep
    their first value (MLflow refuses to change one). ``tags``: the run's tags (set when it opens).
    ``log_checkpoints``: each complete checkpoint is copied into the run's artifacts as
    ``checkpoints/<its directory name>`` (off by default: a checkpoint is as large as the model and its
    optimizer).
    """

    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str = "shardwise",
                 run_name: str | None = None, tags: Mapping[str, str] | None = None,
                 log_checkpoints: bool = False) -> None:
        require("sw.loggers.MLflow", "mlflow")
        self.tags, self.log_checkpoints = dict(tags or {}), log_checkpoints
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            sqlite_uri(os.path.join(ROOT, "mlflow.db"))
        self.experiment, self.run_name = experiment, run_name
        self._ref: dict[str, Any] | None = None
        self._client: Any = None
        self._run_id: str | None = None

    def resume(self, step: int, ref: dict[str, Any] | None) -> None:
        self._ref = ref

    def run_ref(self) -> dict[str, Any]:
        return {"run_id": self._run_id, "experiment": self.experiment, "tracking_uri": self.tracking_uri}

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        client, run_id = self._open()
        had = client.get_run(run_id).data.params
        new = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in flatten(params).items() if k not in had]
        for i in range(0, len(new), _PARAMS_PER_BATCH):
            client.log_batch(run_id, params=new[i:i + _PARAMS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        client, run_id = self._open()
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_checkpoint(self, path: str, step: int) -> None:
        """A complete checkpoint (after ``step`` steps) into the run's artifacts, with ``log_checkpoints``."""
        if self.log_checkpoints:
            client, run_id = self._open()
            client.log_artifacts(run_id, path, artifact_path=f"checkpoints/{os.path.basename(path.rstrip('/'))}")

    def finalize(self, status: str) -> None:
        if self._client is not None and self._run_id is not None:
            self._client.set_terminated(self._run_id, "FAILED" if status == FAILED else "FINISHED")
        self._client, self._ref = None, None

    def _open(self) -> tuple[Any, str]:
        if self._client is None:
            self._client = self._connect()
            self._run_id = self._reopened() or self._created()
            for k, v in self.tags.items():
                self._client.set_tag(self._run_id, k, str(v))
        assert self._run_id is not None
        return self._client, self._run_id

    def _connect(self) -> Any:
        from mlflow.tracking import MlflowClient

        database = _sqlite_file(self.tracking_uri)
        if database is not None:
            os.makedirs(os.path.dirname(database) or ".", exist_ok=True)
            # The database's creation logs each schema migration at INFO: one run's output, not the user's.
            for name in ("alembic", "mlflow.store.db.utils"):
                logging.getLogger(name).setLevel(logging.WARNING)
        return MlflowClient(tracking_uri=self.tracking_uri)

    def _reopened(self) -> str | None:
        """The checkpoint's run, marked running again; None (with a warning) when this store lacks it."""
        run_id = (self._ref or {}).get("run_id")
        if not run_id:
            return None
        try:
            self._client.update_run(run_id, status="RUNNING")
        except Exception as e:  # MlflowException: no such run in this tracking store
            warnings.warn(f"the checkpoint's MLflow run {run_id} is not in {self.tracking_uri} ({e}); logging to "
                          "a new run", stacklevel=2)
            return None
        return str(run_id)

    def _created(self) -> str:
        """A new run in the experiment (created when missing)."""
        found = self._client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(
            self.experiment, artifact_location=self._artifacts())
        return str(self._client.create_run(experiment_id, run_name=self.run_name).info.run_id)

    def _artifacts(self) -> str | None:
        """A new experiment's artifacts: beside a SQLite database, not in the working directory (MLflow's
        default ./mlruns); a server's store decides for itself."""
        database = _sqlite_file(self.tracking_uri)
        return os.path.join(os.path.dirname(database), "mlartifacts") if database is not None else None


class WandB:
    """A Weights & Biases run: metrics logged at their step, hyperparameters in the run's config.

    ``mode``: ``"online"``, ``"offline"`` (no network: the run is written to ``<dir>/wandb/offline-run-*``,
    uploaded later by ``wandb sync``) or ``"disabled"``; None takes W&B's own choice (``$WANDB_MODE``, else
    online). ``dir``: where W&B writes (default ``shardwise_logs``). A resumed fit continues the run its
    checkpoint names (W&B's ``resume="allow"`` with that run id; offline, a second directory of the same run
    id, which ``wandb sync`` joins). W&B prints nothing and leaves the console alone. ``entity`` (the team or
    user), ``group``, ``tags`` and ``config`` (your values, beside the hyperparameters the run logs) go to
    ``wandb.init``. ``log_checkpoints``: each complete checkpoint is logged as a ``model`` artifact named
    ``checkpoint-<run id>``, with the aliases ``step-<n>`` and ``latest`` (off by default: a checkpoint is as
    large as the model and its optimizer).
    """

    name = "wandb"

    def __init__(self, project: str = "shardwise", mode: str | None = None, name: str | None = None,
                 dir: str | os.PathLike[str] = ROOT, *, entity: str | None = None, group: str | None = None,
                 tags: Sequence[str] | None = None, config: Mapping[str, Any] | None = None,
                 log_checkpoints: bool = False) -> None:
        require("sw.loggers.WandB", "wandb")
        self.project, self.mode, self.run_name = project, mode, name
        self.entity, self.group, self.tags = entity, group, list(tags) if tags is not None else None
        self.config, self.log_checkpoints = dict(config or {}), log_checkpoints
        self.dir = os.path.abspath(os.fspath(dir))
        self._ref: dict[str, Any] | None = None
        self._run: Any = None

    def resume(self, step: int, ref: dict[str, Any] | None) -> None:
        self._ref = ref

    def run_ref(self) -> dict[str, Any]:
        run = self._open()
        # The run's own directory (offline: what `wandb sync` takes); run.dir is its files/ inside.
        where = getattr(run.settings, "sync_dir", None) or os.path.dirname(run.dir)
        return {"run_id": run.id, "project": self.project, "dir": str(where)}

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._open().config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._open().log({k: float(v) for k, v in metrics.items()}, step=step)

    def log_checkpoint(self, path: str, step: int) -> None:
        """A complete checkpoint (after ``step`` steps) as a ``model`` artifact, with ``log_checkpoints``."""
        if self.log_checkpoints:
            import wandb

            run = self._open()
            artifact = wandb.Artifact(f"checkpoint-{run.id}", type="model", metadata={"step": step})
            artifact.add_dir(path)
            run.log_artifact(artifact, aliases=[f"step-{step}", "latest"])

    def finalize(self, status: str) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if status == FAILED else 0)
        self._run, self._ref = None, None

    def _open(self) -> Any:
        if self._run is None:
            import wandb

            run_id = (self._ref or {}).get("run_id")
            os.makedirs(self.dir, exist_ok=True)
            self._run = wandb.init(project=self.project, name=self.run_name, dir=self.dir, mode=self.mode,  # type: ignore[arg-type]
                                   entity=self.entity, group=self.group, tags=self.tags, config=self.config or None,
                                   id=run_id, resume="allow" if run_id else None,
                                   settings=wandb.Settings(silent=True, console="off"))
        return self._run


__all__ = ["MLflow", "WandB", "sqlite_uri"]
