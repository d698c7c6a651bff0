"""Callbacks: code of yours that the fit loop calls at fixed points, and :class:`EarlyStopping` built on them.

``Trainer(callbacks=[...])`` takes objects with any of the hooks below (subclass
:class:`Callback` and override what you need); each gets a
:class:`CallbackInfo`:

* ``on_step_end(info)`` after every optimizer step: ``info.step`` steps done,
  ``info.loss`` this rank's loss of the step (None on a rank that computes
  none: a pipeline stage but the last, a tensor-parallel rank but the first),
  ``info.optimizer`` this rank's optimizer: its ``param_groups`` are the run's
  groups on every rank and strategy (a group this rank holds nothing of is
  empty), so setting ``g["lr"]`` there changes the run, and checkpoints keep it;
* ``on_validation_end(info)`` after each validation: ``info.metrics`` the
  GLOBAL metrics of this validation (``val_loss`` and each ``val_metrics``
  name; equal on every rank), ``info.history`` every validation of the run so
  far (a resumed run's included);
* ``on_checkpoint_saved(info)`` after a checkpoint is complete: ``info.path``,
  ``info.kind`` (``"periodic"``, ``"final"``: the save of a run stopped early,
  or ``"best"``: ``<checkpoint_dir>/best``);
* ``on_fit_end(info)`` once at the end: ``info.losses`` the global losses of
  every step, ``info.history``, ``info.stop_reason`` (None unless stopped early).

Epoch hooks (a dataset with a length: ``len(dataset) // batch_size`` steps an
epoch): ``on_train_epoch_start(info)`` before an epoch's first step and
``on_train_epoch_end(info)`` after its last (and its validation, when one is
due), ``info.epoch`` counting from 0; ``on_validation_epoch_end(info)`` after
each validation, as ``on_validation_end``. Every hook's ``info.model`` is the
prepared model, whose forward every rank calls alike.

Also ``on_fit_start``, ``on_step_start``, ``on_before_optimizer_step`` (the
gradients of ``info.optimizer`` are this rank's part of the global gradient)
and ``on_exception`` (``info.exception``). A callback with ``state_dict()`` and
``load_state_dict(state)`` keeps its state in every checkpoint (JSON values,
in the manifest) and gets it back on resume.

Every rank calls its callbacks (each rank has its own copy: callbacks are
pickled into spawned rank processes, so they must be picklable: defined at the
top level of a module, no lambdas or open files); print or write files on
``info.rank == 0`` only. A parameter server's server ranks run no steps: they
call ``on_fit_start`` and ``on_fit_end`` only.

Stopping: ``info.stop(reason)`` asks the run to stop. The request is agreed by
every rank at the end of the step (one tiny all-reduce per step while
callbacks are set), so all ranks stop after the same step even when only one
asked; a request made in ``on_checkpoint_saved`` or after the agreement takes
effect at the end of the next step. A decision made from global values
(``info.metrics``, ``info.history``, ``info.step``) is the same on every rank
anyway. A run that stops early saves a final checkpoint (with
``checkpoint_dir``), which marks it as stopped: running the script again
returns its result instead of training on.
"""
from __future__ import annotations

import inspect
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.launch import require_picklable
from shardwise.strategies.base import HasServers

HOOKS = ("on_fit_start", "on_step_start", "on_before_optimizer_step", "on_step_end", "on_validation_end",
         "on_checkpoint_saved", "on_fit_end", "on_exception")
ALL_HOOKS = (*HOOKS, "on_train_epoch_start", "on_train_epoch_end", "on_validation_epoch_end")


class Callback:
    """Base class: every hook does nothing; override the ones you need."""

    def on_fit_start(self, info: CallbackInfo) -> None:
        """Once, before the first step this run takes (``info.step``: steps a resumed run already took)."""

    def on_step_start(self, info: CallbackInfo) -> None:
        """Before each optimizer step's forward (``info.step`` steps done)."""

    def on_before_optimizer_step(self, info: CallbackInfo) -> None:
        """After backward, before clipping and the optimizer step (a step skipped for fp16 overflow or a
        non-finite loss calls none): ``info.optimizer``'s parameters hold in ``.grad`` this rank's part of the
        global, averaged gradient (its shards under ZeRO/FSDP, its slices under tp, all of it under ddp)."""

    def on_exception(self, info: CallbackInfo) -> None:
        """When the run fails on this rank (``info.exception``); the exception is raised again after it."""

    def on_step_end(self, info: CallbackInfo) -> None:
        """After every optimizer step (``info.step`` steps done, ``info.loss`` this rank's loss)."""

    def on_validation_end(self, info: CallbackInfo) -> None:
        """After each validation (``info.metrics``: the global metrics of this one)."""

    def on_checkpoint_saved(self, info: CallbackInfo) -> None:
        """After a checkpoint is complete on disk (``info.path``, ``info.kind``)."""

    def on_fit_end(self, info: CallbackInfo) -> None:
        """Once, when the run ends (``info.losses``, ``info.stop_reason``)."""

    def check(self, metrics: Sequence[str]) -> None:
        """Before any process starts: refuse a configuration that cannot work (``metrics``: the names each
        validation produces, empty without a validation set)."""


class Control:
    """A rank's pending stop request, shared by the infos of one run."""

    def __init__(self) -> None:
        self.reason: str | None = None


@dataclass
class CallbackInfo:
    """What a hook is told (see the module docstring for which fields each hook fills)."""

    step: int
    max_steps: int
    rank: int
    world_size: int
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    path: str | None = None
    kind: str | None = None
    losses: list[float] | None = None
    stop_reason: str | None = None
    control: Control | None = field(default=None, repr=False)
    optimizer: torch.optim.Optimizer | None = field(default=None, repr=False)
    exception: BaseException | None = None
    # The prepared model (sharded and wrapped by the strategy), called like yours: every rank must call its forward
    # alike (a collective inside, under fsdp or tp), e.g. to sample at an epoch's end.
    model: Any = field(default=None, repr=False)
    epoch: int | None = None  # on_train_epoch_start / _end: the epoch (from 0)

    def stop(self, reason: str = "stopped by a callback") -> None:
        """Ask the run to stop after this step (every rank stops at the same step; see the module docstring)."""
        if self.control is not None and self.control.reason is None:
            self.control.reason = reason


@dataclass
class EarlyStopping(Callback):
    """Stop when the validation metric ``monitor`` has not improved for ``patience`` validations in a row.

    Improved means below the best so far by more than ``min_delta`` (``mode="min"``), or above it by more
    than ``min_delta`` (``"max"``); a NaN never improves. The decision is made from ``info.history``, the
    global metrics of every validation of the run (a resumed run's earlier ones included), so it is the same
    on every rank and survives a restart.
    """

    monitor: str = "val_loss"
    patience: int = 3
    min_delta: float = 0.0
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"EarlyStopping patience must be an integer >= 1, got {self.patience!r}")
        if self.min_delta < 0:
            raise ValueError(f"EarlyStopping min_delta must be >= 0, got {self.min_delta}")

    def check(self, metrics: Sequence[str]) -> None:
        if not metrics:
            raise ValueError(f"EarlyStopping monitors {self.monitor!r}, a validation metric, but fit has no "
                             "val_dataset: pass val_dataset= (and val_every=)")
        if self.monitor not in metrics:
            raise ValueError(f"EarlyStopping monitors {self.monitor!r}, which validation does not compute; it "
                             f"computes {', '.join(metrics)}")

    def on_validation_end(self, info: CallbackInfo) -> None:
        best, at, waited = self.best(info.history)
        if waited >= self.patience:
            shown = "nan" if best is None else f"{best:.6g}"
            info.stop(f"early stopping: {self.monitor} did not improve by more than {self.min_delta:g} in "
                      f"{waited} validations (best {shown} after step {at})")

    def best(self, history: Sequence[dict[str, float]]) -> tuple[float | None, int, int]:
        """(best value, its step, validations since it) over ``history``."""
        best: float | None = None
        at, waited = 0, 0
        for h in (h for h in history if self.monitor in h):  # (a resumed run's history may predate the metric)
            v = h[self.monitor]
            if improved(v, best, self.mode, self.min_delta):
                best, at, waited = v, int(h["step"]), 0
            else:
                waited += 1
        return best, at, waited


def improved(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` (None: nothing yet) by more than ``min_delta``; NaN never does."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


def check_callbacks(callbacks: Any) -> list[Any]:
    """``Trainer(callbacks=)`` as a list, each entry an object with at least one hook method."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of callback objects, got {type(callbacks).__name__}")
    for cb in callbacks:
        if isinstance(cb, type):
            raise TypeError(f"callbacks holds the class {cb.__name__}, not an instance: pass {cb.__name__}(...)")
        lightning = from_lightning(cb)
        if lightning is not None:
            base = lightning.rpartition(".")[2]
            raise TypeError(f"callback {type(cb).__name__} is a Lightning callback ({lightning}): its hooks take "
                            f"(trainer, pl_module), shardwise's take (info); "
                            f"{LIGHTNING_CALLBACKS.get(base, 'port it to a subclass of shardwise.Callback')}")
        if not any(callable(getattr(cb, h, None)) for h in ALL_HOOKS):
            raise TypeError(f"callback {cb!r} has none of the hooks {', '.join(HOOKS)}; subclass "
                            "shardwise.Callback")
        check_signatures(cb)
    return list(callbacks)


# Lightning's callbacks, by class name, and what does their work here.
LIGHTNING_CALLBACKS = {
    "EarlyStopping": "use shardwise.EarlyStopping(monitor=, patience=, mode=, min_delta=)",
    "ModelCheckpoint": "use Trainer(checkpoint_dir=, checkpoint_every=) and fit(checkpoint_best=(monitor, mode, k))",
    "LearningRateMonitor": "each parameter group's lr is in the step log already (Trainer(logger=) or metrics_path=)",
    "TQDMProgressBar": "use Trainer(progress='bar')",
    "RichProgressBar": "use Trainer(progress='bar')",
    "ModelSummary": "the model summary is Trainer(enable_model_summary=True), the default",
    "RichModelSummary": "the model summary is Trainer(enable_model_summary=True), the default",
}
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def from_lightning(obj: Any) -> str | None:
    """The Lightning class ``obj`` is an instance of (its own class or a base), as ``module.Class``, or None.
    Told by module name: Lightning need not be installed, nor imported here."""
    for klass in type(obj).__mro__:
        module = getattr(klass, "__module__", "") or ""
        if module.partition(".")[0] in LIGHTNING_PACKAGES:
            return f"{module}.{klass.__qualname__}"
    return None


def check_signatures(cb: Any) -> None:
    """Every hook ``cb`` has can be called as ``hook(info)``: one written for Lightning's ``(trainer, pl_module)``
    is refused before any process starts, instead of failing inside a rank."""
    for hook in ALL_HOOKS:
        fn = getattr(cb, hook, None)
        if not callable(fn):
            continue
        try:
            signature = inspect.signature(fn).replace(return_annotation=inspect.Signature.empty)
        except (TypeError, ValueError):  # a builtin or C function: nothing to tell
            continue
        try:
            signature.bind(None)
        except TypeError:
            raise TypeError(f"callback {type(cb).__name__}.{hook}{signature} cannot be called as {hook}(info), "
                            "as shardwise calls every hook: info.model is the model, with info.step, info.epoch, "
                            "info.metrics (see shardwise.Callback)") from None


def check_picklable(callbacks: Sequence[Any]) -> None:
    """Spawned ranks receive the callbacks pickled: refuse one that is not, naming it and the fix."""
    require_picklable({f"callback {type(cb).__name__}": cb for cb in callbacks},
                      "its class must be defined at the top level of a module and hold no lambdas, open files or locks")


def agree_stop(control: Control, strategy: Any, topo: Any) -> str | None:
    """Whether any rank's callbacks asked to stop, the same answer on every rank (one flag all-reduce over the
    world): the reason (this rank's, or that another rank asked), or None."""
    mine = control.reason
    if isinstance(strategy, HasServers):
        if mine is not None:  # the servers run their own loop for max_steps and join no agreement
            raise RuntimeError(f"strategy {strategy.name!r} cannot stop early (asked: {mine}): its server ranks "
                               "serve a fixed number of steps")
        return None

    flag = torch.tensor([0.0 if mine is None else 1.0], device=topo.device)
    topo.comm("world").all_reduce(flag, name="callbacks.stop")
    if float(flag) == 0.0:
        return None
    return mine or "stopped by a callback on another rank"


def states(callbacks: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """``state_dict()`` of every callback that has one, by position, for a checkpoint's manifest (JSON)."""
    out: dict[str, dict[str, Any]] = {}
    for i, cb in enumerate(callbacks):
        if callable(getattr(cb, "state_dict", None)):
            state = cb.state_dict()
            try:
                json.dumps(state)
            except (TypeError, ValueError) as e:
                raise TypeError(f"callback {type(cb).__name__}'s state_dict() must hold JSON values (numbers, "
                                f"strings, lists, dicts), to be kept in a checkpoint's manifest: {e}") from None
            out[str(i)] = {"class": type(cb).__qualname__, "state": state}
    return out


def load_states(callbacks: Sequence[Any], saved: dict[str, dict[str, Any]]) -> None:
    """Give each callback the state saved for it (same position, same class)."""
    for i, cb in enumerate(callbacks):
        entry = saved.get(str(i))
        if entry is not None and entry["class"] == type(cb).__qualname__ and \
                callable(getattr(cb, "load_state_dict", None)):
            cb.load_state_dict(entry["state"])


def call(callbacks: Sequence[Any], hook: str, info: CallbackInfo) -> None:
    """Call ``hook`` on every callback that has it, in order."""
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(info)


def call_on_exception(callbacks: Sequence[Any], info: CallbackInfo) -> None:
    """``on_exception`` of every callback, none of which may hide the run's error (``info.exception``, raised
    again after this): a hook that fails (another signature, a bug of its own) is told as a note on that error,
    and the next callbacks are still called."""
    error = info.exception
    for cb in callbacks:
        fn = getattr(cb, "on_exception", None)
        if fn is None:
            continue
        try:
            fn(info)
        except Exception as e:
            note = (f"callback {type(cb).__name__}'s on_exception(info) failed while handling this error: "
                    f"{type(e).__name__}: {e}")
            if error is not None and hasattr(error, "add_note"):
                error.add_note(note)
            else:  # Python 3.10: no notes on exceptions
                warnings.warn(note, stacklevel=2)


__all__ = ["Callback", "CallbackInfo", "EarlyStopping", "check_callbacks", "improved"]
