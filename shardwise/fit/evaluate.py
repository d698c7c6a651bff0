"""Validation: the model evaluated on a held-out set under the run's own strategy, reduced to GLOBAL metrics.

``fit(..., val_dataset=, val_every=, val_metrics=, val_batch_size=)`` evaluates
every ``val_every`` optimizer steps and after the last step (or the step a run
stops at). What is computed equals evaluating the same weights on one device:

* the set is read once, in order, in global batches of ``val_batch_size``
  (default: the training ``batch_size``; the last batch may be partial), each
  data-parallel rank its positions ``r, r + N, ...`` of every batch
  (:func:`shardwise.data.eval_batches`);
* each batch runs forward only, in eval mode (dropout off, BatchNorm on its
  running statistics), under ``torch.no_grad`` and the run's autocast, through
  the strategy's :meth:`~shardwise.strategies.base.Strategy.eval_step` (a pipeline
  runs the batch through its stages; ZeRO-3/FSDP gather and free their units);
* a metric object (torchmetrics' ``Metric``: ``update``/``compute``) is
  updated with every batch the rank owns and computed once at the end, its
  states synced over the data ranks: F1 or AUC equal one device's on the
  whole set, as in ``Trainer.validate``;
* ``val_loss`` is ``loss_fn(output, target)`` and each other metric is
  ``fn(output, target)``; both are the MEAN over the batch (one number per
  batch, as a loss is), weighted by the batch's sample count, summed over
  ranks (one all-reduce per validation, in float64) and divided by the
  set's size. So a last partial batch counts by its size, and the result is
  the exact mean over the samples, whatever the device count.

Metric names are ``val_loss`` and the keys of ``val_metrics`` as given
(``{"accuracy": fn}`` gives ``accuracy``). ``checkpoint_best="val_loss"`` or
``("accuracy", "max")`` keeps the checkpoint of the best validation in
``<checkpoint_dir>/best`` (:func:`save_best`).
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.data import DataSource, batch_len, eval_batches, leaves, to_device
from shardwise.dims import DP_CP
from shardwise.fit.prestart import preflight
from shardwise.precision import cast_batch
from shardwise.step import LossFn, StepRun
from shardwise.strategies.base import HasServers, Strategy

Metric = Callable[[Any, Any], Any]
_RESERVED = ("val_loss", "step")


@dataclass
class Validation:
    """How a run validates (checked by :func:`make_validation` before any process starts)."""

    data: DataSource
    batch_size: int
    every: int | None = None
    metrics: dict[str, Metric] = field(default_factory=dict)
    best: tuple[str, str] | None = None  # (metric, "min" | "max") for checkpoint_best
    best_k: int = 1  # how many of the best validations' checkpoints are kept (checkpoint_best's third item)
    limit: int | None = None  # the first this many global batches only (Trainer(limit_val_batches=, fast_dev_run=))

    @property
    def names(self) -> list[str]:
        return ["val_loss", *self.metrics]

    def due(self, done: int, max_steps: int) -> bool:
        """Whether to validate after ``done`` optimizer steps."""
        return done == max_steps or (self.every is not None and done % self.every == 0)


def make_validation(data: DataSource | None, every: int | None, metrics: Mapping[str, Metric] | None,
                    batch_size: int | None, best: str | tuple[str, str] | None, train_batch: int,
                    checkpoint_dir: str | None, strategy: Strategy) -> Validation | None:
    """fit's validation arguments, checked; None when there is no validation set."""
    if data is None:
        for name, v in (("val_every", every), ("val_metrics", metrics), ("val_batch_size", batch_size),
                        ("checkpoint_best", best)):
            if v is not None:
                raise ValueError(f"{name} was given without val_dataset: pass the validation set as val_dataset=")
        return None
    if isinstance(strategy, HasServers):
        raise ValueError(f"strategy {strategy.name!r} does not support validation (val_dataset): its weights live on "
                         "the server ranks, which serve training steps only; evaluate result.state_dict after fit")
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"val_every must be an integer >= 1 (or None: validate after the last step only), "
                         f"got {every!r}")
    size = train_batch if batch_size is None else batch_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"val_batch_size must be an integer >= 1, got {size!r}")
    if metrics is not None and not isinstance(metrics, Mapping):
        raise TypeError(f"val_metrics must be a dict {{name: fn(output, target)}}, got {type(metrics).__name__}")
    metrics = dict(metrics or {})
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name or name in _RESERVED:
            raise ValueError(f"val_metrics name {name!r} is not allowed: use a non-empty string other than "
                             f"{' and '.join(map(repr, _RESERVED))}")
        if not (callable(fn) or is_metric_object(fn)):
            raise TypeError(f"val_metrics[{name!r}] must be a function fn(output, target) -> the batch's mean, "
                            f"or a metric object with update() and compute() (torchmetrics), got {type(fn).__name__}")
    val = Validation(data, size, every, metrics)
    if best is not None:
        if checkpoint_dir is None:
            raise ValueError("checkpoint_best needs checkpoint_dir: the best checkpoint goes to <checkpoint_dir>/best")
        name, mode, k = best_parts(best)
        if name not in val.names:
            raise ValueError(f"checkpoint_best names {name!r}, which validation does not compute; it computes "
                             f"{', '.join(val.names)}")
        if mode not in ("min", "max"):
            raise ValueError(f"checkpoint_best mode must be 'min' or 'max', got {mode!r}")
        val.best, val.best_k = (name, mode), k
    return val


def best_parts(best: Any) -> tuple[Any, Any, int]:
    """``checkpoint_best``: a metric name (mode ``"min"``), ``(name, mode)`` or ``(name, mode, k)``."""
    if isinstance(best, str):
        return best, "min", 1
    if not isinstance(best, (tuple, list)) or len(best) not in (2, 3):
        raise ValueError(f"checkpoint_best must be a metric name, (name, 'min' | 'max') or (name, mode, k), got "
                         f"{best!r}")
    k = best[2] if len(best) == 3 else 1
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"checkpoint_best's k (how many of the best checkpoints to keep) must be a positive integer, "
                         f"got {k!r}")
    return best[0], best[1], k


def check_validation(model: nn.Module, loss_fn: LossFn, val: Validation) -> None:
    """Before any process starts: the validation set holds a sample, batches, and the loss and every metric take
    the model's output (on the meta device, as the training data is checked)."""
    preflight.check_source(val.data, 1, what="val_dataset")
    batch = preflight.first_batch(val.data, min(64, val.batch_size), what="val_dataset")
    preflight.check_loss(model, batch, loss_fn)
    for name, fn in val.metrics.items():
        if not is_metric_object(fn):  # (an object is updated, not called: its forward would change its state)
            preflight.check_metric(model, batch, fn, name)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode inside the block; each module's own mode restored after (a module kept in eval
    mode on purpose, a frozen BatchNorm, stays so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def is_metric_object(m: Any) -> bool:
    """A stateful metric (torchmetrics' ``Metric``): updated batch by batch, computed once."""
    return callable(getattr(m, "update", None)) and callable(getattr(m, "compute", None))


def output_tensor(out: Any) -> torch.Tensor:
    """The tensor of a model's output that predictions and metric objects take: the output itself, or its first
    tensor (a Hugging Face output's ``logits`` when no loss was computed)."""
    if isinstance(out, torch.Tensor):
        return out
    first = next(iter(leaves(out)), None)
    if first is None:
        raise TypeError(f"the model returned {type(out).__name__}, which holds no tensor to predict or measure")
    return first


def reset_objects(objects: Mapping[str, Any], topo: Topology) -> None:
    """Each metric object emptied, its states where the outputs are (torchmetrics' ``Metric.to``)."""
    for m in objects.values():
        m.reset()
        if callable(getattr(m, "to", None)):
            m.to(topo.device)


def computed_objects(objects: Mapping[str, Any], strat: Strategy, topo: Topology) -> dict[str, float]:
    """Each metric object computed once on the ranks that own outputs, its states synced over the ranks holding
    other samples or tokens (dp x cp; never tp or pp peers, which hold the same ones), and handed to every rank
    (a collective of the world)."""
    values: dict[str, float] | None = None
    if strat.owns_loss(topo):
        values = {}
        for name, m in objects.items():
            if topo.world_size > 1:
                m.process_group = topo.comm(DP_CP).group
            values[name] = float(m.compute())
    every = topo.comm("world").all_gather_object(values, name="metrics.objects")
    return next(v for v in every if v is not None)


def evaluate(model: nn.Module, strat: Strategy, val: Validation, loss_fn: LossFn, topo: Topology,
             run: StepRun = StepRun(), seed: int = 0) -> dict[str, float]:
    """One pass over the validation set on every rank; the global metrics, the same on every rank (module doc).
    A metric object (torchmetrics) is updated over the whole set and computed once, as in ``Trainer.validate``."""
    shards, shard = strat.data_parallel(topo)
    fns = [(k, m) for k, m in val.metrics.items() if not is_metric_object(m)]
    objects = {k: m for k, m in val.metrics.items() if is_metric_object(m)}
    reset_objects(objects, topo)
    counted = [False]  # whether the batch eval_step is running counts (this rank owns it, not padding)

    def per_batch(out: Any, y: Any) -> torch.Tensor:
        loss = loss_fn(out, y)
        values = [_number("val_loss", loss)] + [_number(name, fn(out, y)) for name, fn in fns]
        for m in objects.values() if counted[0] else ():
            m.update(output_tensor(out).detach(), y)  # type: ignore[attr-defined]
        return torch.stack([v.to(device=values[0].device, dtype=torch.float64) for v in values])

    owner = strat.owns_loss(topo)
    sums = torch.zeros(2 + len(fns), dtype=torch.float64, device=topo.device)  # samples, loss, metrics
    with eval_mode(model):
        for w, (batch, real) in enumerate(eval_batches(val.data, val.batch_size, shards, shard, seed)):
            if val.limit is not None and w >= val.limit:
                break  # (every rank at the same global batch)
            x, y = cast_batch(run.precision, val.data.split(to_device(batch, topo.device)))
            counted[0] = owner and real
            got = strat.eval_step(model, x, y, per_batch, topo, run)
            if got is not None and owner and real:
                k = batch_len(y) or batch_len(x)
                sums[0] += k
                sums[1:] += k * got.detach().to(device=topo.device, dtype=torch.float64)
    topo.comm("world").all_reduce(sums, name="metrics.validation")
    n = float(sums[0])
    means = dict(zip(["val_loss", *(k for k, _ in fns)], (float(s) / n for s in sums[1:].tolist())))
    given = computed_objects(objects, strat, topo) if objects else {}
    return {name: means[name] if name in means else given[name] for name in val.names}


def _number(name: str, v: Any) -> torch.Tensor:
    t = v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    if t.numel() != 1:
        raise ValueError(f"{'loss_fn' if name == 'val_loss' else f'val_metrics[{name!r}]'} must return one number "
                         f"per batch (the mean over the batch), got a tensor of shape {list(t.shape)}")
    return t.reshape(())


# ---- the best checkpoint and the history in checkpoints ----------------------------------------
def top_steps(history: list[dict[str, float]], best: tuple[str, str], k: int) -> list[int]:
    """The steps of the ``k`` best validations of ``history`` by ``best`` (metric, mode); of equal values the
    earliest first. A NaN never ranks, nor does a resumed run's validation that predates the metric."""
    name, mode = best
    ranked = sorted((h for h in history if name in h and not math.isnan(h[name])),
                    key=lambda h: h[name] if mode == "min" else -h[name])  # (stable: equal values in step order)
    return [int(h["step"]) for h in ranked[:k]]


def save_best(directory: str, save: Callable[[str], str], topo: Topology, keep: list[int]) -> str:
    """Save through ``save(best_directory)`` (the run's own checkpoint save, into ``<directory>/best``) and keep
    there only the checkpoints of the steps in ``keep`` (a worse one, or one of an earlier run, is removed)."""
    where = os.path.join(directory, "best")
    path = save(where)
    if topo.rank == 0:
        kept = {f"step_{s:08d}" for s in keep}
        for entry in os.listdir(where):
            if entry not in kept:
                shutil.rmtree(os.path.join(where, entry), ignore_errors=True)
    return path


def history_tensors(history: list[dict[str, float]]) -> dict[str, torch.Tensor]:
    """The validation history as checkpoint run state: ``val.<name>`` -> rows (step, value)."""
    out: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(k for h in history for k in h if k != "step"):
        rows = [[h["step"], h[name]] for h in history if name in h]
        out[f"val.{name}"] = torch.tensor(rows, dtype=torch.float64)
    return out


def history_from(extra: Mapping[str, torch.Tensor]) -> list[dict[str, float]]:
    """:func:`history_tensors` read back (one entry per step, in step order)."""
    by_step: dict[int, dict[str, float]] = {}
    for key, rows in extra.items():
        if key.startswith("val."):
            for step, value in rows.tolist():
                by_step.setdefault(int(step), {"step": int(step)})[key[4:]] = value
    return [by_step[s] for s in sorted(by_step)]


__all__ = ["Validation", "check_validation", "computed_objects", "eval_mode", "evaluate", "is_metric_object",
           "make_validation", "output_tensor", "reset_objects"]
