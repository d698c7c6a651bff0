"""Loggers that write files on the machine of rank 0: :class:`JSONL`, :class:`CSV` and :class:`TensorBoard`.

A resumed run keeps the rows of the steps before its checkpoint and drops those
an interrupted attempt wrote past it (they are trained again); a fresh run
starts the file anew.
"""
from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Mapping
from typing import IO, Any

from shardwise.extras import require
from shardwise.loggers.base import flatten

# Where a logger built without a directory writes (relative to the working directory of the run).
ROOT = "shardwise_logs"


def bare(name: str) -> str:
    """A metric's name without its ``train/`` or ``val/`` namespace (the metrics file's names)."""
    return name.partition("/")[2] if name.startswith(("train/", "val/")) else name


def kept_before(path: str, start: int, step_of: Callable[[str], int]) -> list[str]:
    """The lines of ``path`` whose step (``step_of(line)``) is below ``start``: what a run resumed at step
    ``start`` keeps (nothing for a fresh run, ``start`` 0)."""
    if start <= 0 or not os.path.exists(path):
        return []
    with open(path) as f:
        return [line for line in f if line.strip() and step_of(line) < start]


class JSONL:
    """One JSON object per line, the format of ``Trainer(metrics_path=)``: ``{"step": s, "loss": ...,
    "lr/0": ..., ...}`` for each logged step and ``{"step": s, "val_loss": ..., <val_metrics>}`` for each
    validation; names without their ``train/``/``val/`` namespace. Hyperparameters are not written."""

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self._start = 0
        self._file: IO[str] | None = None

    def resume(self, step: int, ref: dict[str, Any] | None) -> None:
        self._start = step

    def run_ref(self) -> dict[str, Any]:
        return {"path": self.path}

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._open()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        f = self._open()
        f.write(json.dumps({"step": step, **{bare(k): v for k, v in metrics.items()}}) + "\n")
        f.flush()  # a row per line as it comes: `tail -f` and a killed run see every step logged

    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._start = None, 0

    def _open(self) -> IO[str]:
        if self._file is None:
            kept = kept_before(self.path, self._start, lambda line: json.loads(line).get("step", -1))
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "w")
            self._file.writelines(kept)
        return self._file


class CSV:
    """``<dir>/metrics.csv``: a ``step`` column and one per metric name, a row per logged step and one per
    validation (empty where a row has no value; flags as 0 and 1); ``<dir>/hparams.json``: the
    hyperparameters. A new metric name rewrites the file with the wider header, so it always loads whole with
    the ``csv`` module."""

    name = "csv"
    FILE = "metrics.csv"

    def __init__(self, dir: str | os.PathLike[str] = os.path.join(ROOT, "csv")) -> None:
        self.dir = os.path.abspath(os.fspath(dir))
        self._start = 0
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None
        self._columns: list[str] = []

    @property
    def path(self) -> str:
        return os.path.join(self.dir, self.FILE)

    def resume(self, step: int, ref: dict[str, Any] | None) -> None:
        self._start = step

    def run_ref(self) -> dict[str, Any]:
        return {"path": self.path}

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "hparams.json"), "w") as f:
            json.dump(dict(params), f, indent=1, default=str)
        self._open()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._open()
        row = {"step": step, **{k: int(v) if isinstance(v, bool) else v for k, v in metrics.items()}}
        new = [k for k in row if k not in self._columns]
        if new:
            self._rewrite(self._columns + new, self._rows())
        assert self._writer is not None and self._file is not None
        self._writer.writerow(row)
        self._file.flush()

    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._writer, self._columns, self._start = None, None, [], 0

    def _open(self) -> None:
        if self._file is not None:
            return
        rows = [r for r in self._rows() if int(r["step"]) < self._start] if self._start > 0 else []
        columns = ["step", *dict.fromkeys(k for r in rows for k in r if k != "step")]
        os.makedirs(self.dir, exist_ok=True)
        self._rewrite(columns, rows)

    def _rows(self) -> list[dict[str, str]]:
        if self._file is not None:
            self._file.flush()
        if not os.path.exists(self.path):
            return []
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f))

    def _rewrite(self, columns: list[str], rows: list[dict[str, str]]) -> None:
        if self._file is not None:
            self._file.close()
        self._file = open(self.path, "w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=columns)
        self._writer.writeheader()
        self._writer.writerows(rows)
        self._columns = columns


class TensorBoard:
    """Event files in ``dir`` (``tensorboard --logdir dir``): each metric a scalar under its name
    (``train/loss``, ``val/val_loss``, ...), the hyperparameters in the HPARAMS tab. A resumed run purges the
    events an interrupted attempt wrote at or past its checkpoint's step."""

    name = "tensorboard"

    def __init__(self, dir: str | os.PathLike[str] = os.path.join(ROOT, "tensorboard")) -> None:
        require("sw.loggers.TensorBoard", "tensorboard")
        self.dir = os.path.abspath(os.fspath(dir))
        self._start = 0
        self._writer: Any = None

    def resume(self, step: int, ref: dict[str, Any] | None) -> None:
        self._start = step

    def run_ref(self) -> dict[str, Any]:
        return {"dir": self.dir}

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in flatten(params).items()}
        writer = self._open()
        for summary in hparams(flat, {}):
            writer.file_writer.add_summary(summary)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        writer = self._open()
        for k, v in metrics.items():
            writer.add_scalar(k, float(v), step)

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer, self._start = None, 0

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.dir, purge_step=self._start or None)
        return self._writer


__all__ = ["CSV", "JSONL", "ROOT", "TensorBoard", "bare", "kept_before"]
