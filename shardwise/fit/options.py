"""The Trainer's options as one frozen value: what every rank of a fit needs to know about the run.

``Trainer(...)`` validates its arguments into a :class:`FitOptions` (the checks
below are the Trainer's, in one place); the rank job (:class:`~shardwise.fit.job.Job`)
carries this value into every process, not the Trainer object. The strategy's
:class:`~shardwise.layout.RunLayout` for the device count is part of it, so
every rank builds the same :class:`~shardwise.comm.topology.Topology`.
"""
from __future__ import annotations

import datetime as _dt
import difflib
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise import launch
from shardwise import loggers as loggers_mod
from shardwise import precision as precision_mod
from shardwise.checkpoint import store as checkpoint
from shardwise.comm.topology import accelerator_name, uses_cuda
from shardwise.data import as_source, loader_options
from shardwise.extras import installed, message
from shardwise.fit.callbacks import check_callbacks
from shardwise.fit.profiler import PROFILERS
from shardwise.ft.options import FaultTolerance, ReplicaPlan, plan_replicas
from shardwise.layout import RunLayout
from shardwise.strategies.base import Strategy, compile_backend
from shardwise.strategies.registry import resolve
from shardwise.strategies.torch_engine.choice import engine_for


@dataclass(frozen=True)
class FitOptions:
    """Every option of :class:`~shardwise.fit.trainer.Trainer`, validated (see its docstring for each)."""

    strategy: Strategy
    devices: int
    layout: RunLayout
    accelerator: str
    device_ids: tuple[int, ...] | None  # devices=[0, 1]: the GPUs listed, local rank r on the r-th
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    seed: int
    progress: bool | str
    metrics_path: str | None
    timeout: _dt.timedelta
    checkpoint_dir: str | None
    checkpoint_every: int | None
    checkpoint_keep: int | None
    resume: str  # "auto", "never", "must" or the checkpoint resumed (resume_mode)
    debug: bool
    on_nonfinite: str
    memory_check: str
    device_memory: int | None
    precision: str
    activation_checkpointing: bool | tuple[type[nn.Module], ...]
    tensorboard_dir: str | None
    peak_flops: float | None
    max_processes_per_core: int | None
    sync_batchnorm: bool
    callbacks: tuple[Any, ...]
    dataloader_kwargs: dict[str, Any]
    max_epochs: int | None = None
    profiler: str | None = None  # "simple" or "pytorch" (shardwise.fit.profiler)
    profile_steps: tuple[int, int] | None = None  # the steps [start, stop) profiled; None: the profiler's default
    profiler_dir: str | None = None  # where "pytorch" writes its traces (absolute: every rank agrees)
    # Every logger rank 0 writes to: Trainer(logger=)'s, then metrics_path's JSONL and tensorboard_dir's TensorBoard.
    loggers: tuple[Any, ...] = ()
    log_every_n_steps: int = 50
    checkpoint_async: bool = False
    compile: bool | str = False
    fault_tolerance: FaultTolerance | None = None
    replicas: ReplicaPlan | None = None  # the replica groups fault tolerance keeps (shardwise.ft.options)
    sample_ledger: str | None = None  # where the launcher writes which group computed which samples, per step
    config: dict[str, Any] | None = None  # a configured run's resolved configuration (shardwise.fit.config)
    deterministic: bool = False  # torch's deterministic algorithms on every rank (shardwise.seeding.deterministic)
    shuffle: bool = True  # False: a map-style dataset is read in its own order, each epoch
    gradient_clip_algorithm: str = "norm"  # "norm": the global norm; "value": every element (Lightning's names)
    fast_dev_run: bool = False  # one step, one validation batch; no checkpoint, logger or profiler
    limit_val_batches: int | float | None = None  # validate on the first this many global batches (or fraction)
    limit_train_batches: int | float | None = None  # an epoch is its first this many global batches (or fraction)
    overfit_batches: int | float | None = None  # train on the same first batches every epoch (limit_train_batches)
    detect_anomaly: bool = False  # torch.autograd's anomaly detection around the steps
    max_steps: int | None = None  # Trainer(max_steps=): fit's max_steps when fit is given none
    benchmark: bool | None = None  # torch.backends.cudnn.benchmark on every rank (None: torch's own setting)
    enable_model_summary: bool = True  # the model's parameters and the planner's memory per rank, at the start

    @property
    def clip_norm(self) -> float | None:
        """``gradient_clip_val`` when it clips by norm (the step log's ``clipped`` compares with it), else None."""
        return self.gradient_clip_val if self.gradient_clip_algorithm == "norm" else None

    def val_batches(self, dataset: Any, batch_size: int) -> int | None:
        """How many global batches a validation of ``dataset`` reads (None: the whole set)."""
        if self.fast_dev_run or self.limit_val_batches is None:
            return 1 if self.fast_dev_run else None
        if isinstance(self.limit_val_batches, int):
            return self.limit_val_batches
        try:
            total = -(-len(as_source(dataset).dataset) // batch_size)  # the last batch may be partial
        except TypeError:
            raise ValueError(f"limit_val_batches={self.limit_val_batches} is a fraction of the validation set, and "
                             "val_dataset has no __len__: pass a number of batches") from None
        return limited("limit_val_batches", self.limit_val_batches, total)

    def epoch_steps(self, dataset: Any, batch_size: int) -> int | None:
        """Optimizer steps an epoch: ``len(dataset) // batch_size`` whole global batches, or those
        ``limit_train_batches`` keeps; None without a length."""
        try:
            whole = len(as_source(dataset).dataset) // batch_size
        except TypeError:
            return None
        if self.limit_train_batches is None or whole == 0:
            return whole or None
        return limited("overfit_batches" if self.overfit_batches else "limit_train_batches", self.limit_train_batches,
                       whole)

    @property
    def on_cuda(self) -> bool:
        """Whether the ranks will run on CUDA (and talk over NCCL)."""
        return uses_cuda(self.accelerator)

    @property
    def step_rows(self) -> bool:
        """Whether rank 0 writes a row per step (any logger: ``logger=``, a metrics file, TensorBoard): the same
        answer on every rank, so every rank joins the reductions a row needs (``sw.log``'s)."""
        return bool(self.loggers)

    @property
    def rank_accelerator(self) -> str:
        """What each rank picks its device by (:func:`~shardwise.comm.topology.pick_device`): the accelerator,
        with the GPUs of ``devices=[...]`` listed (``"cuda:1,3"``)."""
        return f"cuda:{','.join(map(str, self.device_ids))}" if self.device_ids else self.accelerator

    @property
    def engine(self) -> str:
        """Whose mechanisms run the strategy, ``"shardwise"`` or ``"torch"``: its layout's (the one source)."""
        return self.layout.engine

    @property
    def sizes(self) -> dict[str, int]:
        """``{"pp", "dp", "tp"}`` of the run (see :meth:`shardwise.dims.ParallelDims.sizes`)."""
        return self.layout.dims.sizes()

    @classmethod
    def build(cls, strategy: str | Strategy, devices: int | str | list[int], accelerator: str, *,
              accumulate_grad_batches: int, gradient_clip_val: float | None, seed: int, progress: bool | str,
              metrics_path: str | os.PathLike[str] | None, timeout_s: float,
              checkpoint_dir: str | os.PathLike[str] | None, checkpoint_every: int | None,
              resume: bool | str | os.PathLike[str],
              debug: bool, on_nonfinite: str, checkpoint_keep: int | None, memory_check: str,
              device_memory: int | None, precision: str | int,
              activation_checkpointing: bool | tuple[type[nn.Module], ...],
              tensorboard_dir: str | os.PathLike[str] | None, peak_flops: float | None,
              max_processes_per_core: int | None, sync_batchnorm: bool, callbacks: list[Any] | None,
              dataloader_kwargs: dict[str, Any] | None, max_epochs: int | None, logger: Any,
              log_every_n_steps: int, profiler: str | None, profile_steps: range | tuple[int, int] | None,
              profiler_dir: str | os.PathLike[str] | None, engine: str | None, checkpoint_async: bool,
              compile: bool | str, fault_tolerance: bool | FaultTolerance | None = None,
              sample_ledger: str | os.PathLike[str] | None = None, deterministic: bool = False,
              shuffle: bool = True, gradient_clip_algorithm: str = "norm", fast_dev_run: bool = False,
              limit_val_batches: int | float | None = None, detect_anomaly: bool = False,
              limit_train_batches: int | float | None = None,
              overfit_batches: int | float | None = None, max_steps: int | None = None,
              benchmark: bool | None = None, enable_model_summary: bool = True) -> FitOptions:
        """The Trainer's arguments, each by its name, checked: a ValueError names the first one that is wrong."""
        if fast_dev_run:  # nothing written: no checkpoint, logger, metrics file, TensorBoard or profile
            checkpoint_dir = metrics_path = tensorboard_dir = profiler = logger = None
            checkpoint_every, checkpoint_async = None, False
        limits = batch_limits(limit_train_batches, limit_val_batches, overfit_batches, shuffle)
        strat = engine_for(resolve(strategy), engine, sync_batchnorm=sync_batchnorm,
                           cuda=uses_cuda(accelerator_name(accelerator)))
        checked_callbacks = check_callbacks(callbacks)
        loaders = dict(dataloader_kwargs or {})
        loader_options(loaders)  # an unknown or refused option fails here
        accelerator = accelerator_name(accelerator)
        # Checked in this order: the first wrong option is the one named.
        if max_processes_per_core is not None and max_processes_per_core < 1:
            raise ValueError(f"max_processes_per_core must be >= 1 (or None for no bound), got "
                             f"{max_processes_per_core}")
        check_checkpointing(checkpoint_every, checkpoint_dir, None, None)
        if resume == "must" and checkpoint_dir is None:
            raise ValueError("resume='must' was given without checkpoint_dir: say where the run's checkpoints are")
        compile_backend(strat, compile)  # a wrong value, or a schedule that cannot run compiled blocks
        check_checkpointing(None, checkpoint_dir, checkpoint_async, checkpoint_keep)
        if memory_check not in ("error", "warn", "off"):
            raise ValueError(f"memory_check must be 'error', 'warn' or 'off', got {memory_check!r}")
        checked_precision = precision_mod.check(precision)
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}")
        if on_nonfinite not in ("error", "skip"):
            raise ValueError(f"on_nonfinite must be 'error' or 'skip', got {on_nonfinite!r}")
        count, device_ids = device_count(strat, devices, accelerator)
        check_positive("max_epochs", max_epochs, "a positive integer (or None)")
        max_steps = lightning_values(max_steps, benchmark, deterministic, fast_dev_run)
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}")
        paths = {k: os.fspath(v) if v is not None else None
                 for k, v in (("checkpoint_dir", checkpoint_dir), ("tensorboard_dir", tensorboard_dir),
                              ("metrics_path", metrics_path))}
        profiled = profiling(profiler, profile_steps, profiler_dir, checkpoint_dir)
        check_positive("log_every_n_steps", log_every_n_steps, "a positive integer", optional=False)
        loggers = run_loggers(logger, paths["metrics_path"], paths["tensorboard_dir"], paths["checkpoint_dir"])
        layout, timeout = strat.layout(count), _dt.timedelta(seconds=timeout_s)
        replicas = fault_tolerant(strat, layout, timeout, fault_tolerance, sample_ledger, paths["checkpoint_dir"])
        return cls(strategy=strat, devices=count, layout=layout, accelerator=accelerator,
                   device_ids=device_ids, accumulate_grad_batches=accumulate_grad_batches,
                   gradient_clip_val=gradient_clip_val, seed=seed, progress=progress,
                   metrics_path=paths["metrics_path"], timeout=timeout,
                   checkpoint_dir=paths["checkpoint_dir"], checkpoint_every=checkpoint_every,
                   checkpoint_keep=checkpoint_keep, resume=resume_mode(resume), debug=debug, on_nonfinite=on_nonfinite,
                   memory_check=memory_check, device_memory=device_memory, precision=checked_precision,
                   activation_checkpointing=activation_checkpointing, tensorboard_dir=paths["tensorboard_dir"],
                   peak_flops=peak_flops, max_processes_per_core=max_processes_per_core,
                   sync_batchnorm=sync_batchnorm, callbacks=tuple(checked_callbacks), dataloader_kwargs=loaders,
                   max_epochs=max_epochs, profiler=profiler, profile_steps=profiled["profile_steps"],
                   profiler_dir=profiled["profiler_dir"], loggers=tuple(loggers),
                   log_every_n_steps=log_every_n_steps, checkpoint_async=checkpoint_async, compile=compile,
                   deterministic=deterministic, gradient_clip_algorithm=gradient_clip_algorithm,
                   fast_dev_run=bool(fast_dev_run), detect_anomaly=detect_anomaly, max_steps=max_steps,
                   benchmark=benchmark, enable_model_summary=enable_model_summary, **limits, **replicas)


# Lightning's Trainer arguments that have no parameter here, and what does their work ("{v}": the value given).
REFUSED = {
    "val_check_interval": "is fit(val_every=N) here: validate every N optimizer steps (an epoch is "
                          "len(dataset) // batch_size of them)",
    "check_val_every_n_epoch": "is fit(val_every=N) here, in optimizer steps: N = {v!r} x (len(dataset) // "
                               "batch_size)",
    "default_root_dir": "is checkpoint_dir={v!r} here: checkpoints there, and the logs of logger='csv' (or another "
                        "name) under <checkpoint_dir>/logs",
    "min_epochs": "has no equivalent here: a run trains until max_epochs or max_steps, or until a callback stops "
                  "it (shardwise.EarlyStopping's patience, info.stop)",
    "min_steps": "has no equivalent here: a run trains until max_epochs or max_steps, or until a callback stops it "
                 "(shardwise.EarlyStopping's patience, info.stop)",
    "max_time": "has no equivalent here: bound the run with max_steps= or max_epochs=, or stop it from a callback "
                "(info.stop) when its time is up",
    "limit_test_batches": "has no equivalent here: test on a part of the set, trainer.test(model, "
                          "torch.utils.data.Subset(dataset, range(n)), ...)",
    "limit_predict_batches": "has no equivalent here: predict a part of the set, trainer.predict(model, "
                             "torch.utils.data.Subset(dataset, range(n)), ...)",
    "use_distributed_sampler": "has no equivalent here: each rank reads its part of every global batch, without a "
                               "sampler; Trainer(shuffle=False) keeps the dataset's order",
    "num_nodes": "is the launcher's here: it starts the nodes (shardwise run --nnodes {v!r}, or srun), and "
                 "devices='auto' (the default) takes its world size",
    "num_sanity_val_steps": "has no equivalent here: the model, the loss and the validation metrics are checked "
                            "on meta before any process starts, and fast_dev_run=True runs one step and one "
                            "validation batch",
    "enable_checkpointing": "disagrees with checkpoint_dir=, which says whether and where checkpoints are written, "
                            "e.g. Trainer(checkpoint_dir='checkpoints', checkpoint_every=100)",
}
# Accepted because the value means what the run does anyway (no sanity pass, one node, no checkpoint_dir).
NOTHING_TO_DO = {"num_sanity_val_steps": 0, "num_nodes": 1}


def lightning_arguments(given: Mapping[str, Any], ours: Iterable[str], checkpoint_dir: Any) -> dict[str, Any]:
    """Trainer keyword arguments that are not its own: Lightning's, as our arguments (the returned dict), or
    refused in one line (ValueError) that names ours; any other name is Python's TypeError, with the nearest
    names."""
    out: dict[str, Any] = {}
    for name, value in given.items():
        if name == "enable_progress_bar":
            if not value:
                out["progress"] = False
        elif name == "enable_checkpointing" and bool(value) == (checkpoint_dir is not None):
            continue  # True with checkpoint_dir, False without: what the run does
        elif name in NOTHING_TO_DO and value == NOTHING_TO_DO[name]:
            continue
        elif name in REFUSED:
            raise ValueError(f"Trainer({name}={value!r}) {REFUSED[name].format(v=value)}")
        else:
            known = [*ours, *REFUSED, "enable_progress_bar"]
            near = difflib.get_close_matches(name, known, n=1)
            raise TypeError(f"Trainer() got an unexpected keyword argument {name!r}"
                            + (f"; did you mean {near[0]!r}?" if near else ""))
    return out


def lightning_values(max_steps: int | None, benchmark: bool | None, deterministic: bool, fast_dev_run: Any
                     ) -> int | None:
    """The values Lightning gives these arguments, checked: ``max_steps`` (``-1``, "no bound", is None),
    ``benchmark`` beside ``deterministic``, and ``fast_dev_run`` (a number of batches there, one step here)."""
    max_steps = None if max_steps == -1 else max_steps
    check_positive("max_steps", max_steps, "a positive integer (or None)")
    if benchmark and deterministic:
        raise ValueError("benchmark=True lets cuDNN pick its fastest algorithms, which deterministic=True "
                         "forbids: pass one of them")
    if not isinstance(fast_dev_run, bool) and fast_dev_run not in (0, 1):
        raise ValueError(f"fast_dev_run={fast_dev_run!r}: here fast_dev_run=True runs one step and one "
                         f"validation batch; for {fast_dev_run} steps pass fit(max_steps={fast_dev_run}) and "
                         f"limit_val_batches={fast_dev_run}")
    return max_steps


def check_checkpointing(every: int | None, directory: Any, in_background: bool | None, keep: int | None) -> None:
    """``checkpoint_every``, ``checkpoint_async`` and ``checkpoint_keep`` (each None: not checked here), beside
    ``checkpoint_dir``."""
    if every is not None and every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {every}")
    if every is not None and directory is None:
        raise ValueError("checkpoint_every was given without checkpoint_dir: say where checkpoints go")
    if in_background and directory is None:
        raise ValueError("checkpoint_async=True was given without checkpoint_dir: say where checkpoints go")
    if keep is not None and keep < 1:
        raise ValueError(f"checkpoint_keep must be >= 1 (or None to keep all), got {keep}")


RESUME_MODES = ("auto", "never", "must")


def resume_mode(value: Any) -> str:
    """``Trainer(resume=)``: ``"auto"`` (True), ``"never"`` (False), ``"must"``, or a checkpoint (a ``step_*``
    directory, or a run's checkpoint directory: its newest intact one) as an absolute path."""
    if isinstance(value, bool):
        return "auto" if value else "never"
    if isinstance(value, str) and value in RESUME_MODES:
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"resume must be 'auto', 'never', 'must' or a checkpoint path, got {value!r}")
    path = os.path.abspath(os.fspath(value))
    chosen = path if os.path.exists(os.path.join(path, checkpoint.MANIFEST)) else checkpoint.latest_valid(path)
    if chosen is None:
        raise ValueError(f"resume={os.fspath(value)!r} is neither 'auto', 'never', 'must' nor a checkpoint (a "
                         "step_* directory, or a checkpoint_dir holding one)")
    return chosen


def batch_limits(train: Any, val: Any, overfit: Any, shuffle: bool) -> dict[str, Any]:
    """``limit_train_batches``, ``limit_val_batches`` and ``overfit_batches`` checked (Lightning's meanings: an int
    is that many global batches, a float that fraction); ``overfit_batches`` is the first two, in the dataset's
    own order."""
    for name, value in (("limit_train_batches", train), ("limit_val_batches", val), ("overfit_batches", overfit)):
        ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or \
            (isinstance(value, float) and 0 < value <= 1)
        if value is not None and not ok:
            raise ValueError(f"{name} must be a positive integer (global batches) or a fraction in (0, 1] (or None), "
                             f"got {value!r}")
    if overfit is not None:
        if train is not None:
            raise ValueError(f"overfit_batches={overfit} trains on the same first batches every epoch, and "
                             f"limit_train_batches={train} limits the epoch: pass one of them")
        train, shuffle, val = overfit, False, overfit if val is None else val
    return {"limit_train_batches": train, "limit_val_batches": val, "overfit_batches": overfit, "shuffle": shuffle}


def limited(name: str, limit: int | float, total: int) -> int:
    """How many of ``total`` batches a limit keeps: an int that many (at most all), a float that fraction of them
    (rounded down, as Lightning does); none is refused."""
    if isinstance(limit, int):
        return min(limit, total)
    if int(total * limit) < 1:
        raise ValueError(f"{name}={limit} keeps no whole batch of the {total} there are: raise it, or pass a number "
                         "of batches")
    return int(total * limit)


def check_positive(name: str, value: Any, what: str, optional: bool = True) -> None:
    """Refuse ``value`` unless it is a positive integer (or None where ``optional``): "``name`` must be ``what``"."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def device_count(strategy: Strategy, devices: Any, accelerator: str) -> tuple[int, tuple[int, ...] | None]:
    """``devices`` as a count of devices (``"auto"`` resolved for ``strategy``), and the GPUs a list named."""
    devices, device_ids = gpus_given(devices, accelerator)
    if devices == "auto":
        devices = auto_devices(strategy, accelerator)
    elif not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive integer, 'auto', -1 (every GPU) or a list of GPU "
                         f"indices, got {devices!r}")
    return devices, device_ids


def fault_tolerant(strategy: Strategy, layout: RunLayout, timeout: _dt.timedelta, value: Any, ledger: Any,
                   checkpoint_dir: str | None) -> dict[str, Any]:
    """``fault_tolerance``, its replica groups and ``sample_ledger``, checked
    (:func:`shardwise.ft.options.plan_replicas` says what a layout can survive)."""
    ft = FaultTolerance.of(value)
    if ft is None:
        if ledger is not None:
            raise ValueError("sample_ledger= records which replica group computed which samples of each step: it "
                             "needs fault_tolerance=True (or sw.FaultTolerance(...))")
        return {}
    if checkpoint_dir is not None:
        raise ValueError("fault_tolerance does not write checkpoints yet (checkpoint_dir=): a dead replica group "
                         "no longer stops the run; drop checkpoint_dir, or fault_tolerance")
    return {"fault_tolerance": ft, "replicas": plan_replicas(strategy, layout, ft, timeout),
            "sample_ledger": os.fspath(ledger) if ledger is not None else None}


def run_loggers(logger: Any, metrics_path: str | None, tensorboard_dir: str | None,
                checkpoint_dir: str | None) -> list[Any]:
    """``Trainer(logger=)`` (names write under ``<checkpoint_dir>/logs``, or ``shardwise_logs``), then the
    shorthands: ``metrics_path`` a :class:`~shardwise.loggers.JSONL`, ``tensorboard_dir`` a
    :class:`~shardwise.loggers.TensorBoard` (without tensorboard installed: a warning, and no TensorBoard)."""
    root = os.path.join(checkpoint_dir, "logs") if checkpoint_dir is not None else loggers_mod.ROOT
    out = loggers_mod.resolve(logger, root)
    if metrics_path is not None:
        out.append(loggers_mod.JSONL(metrics_path))
    if tensorboard_dir is not None:
        if installed("tensorboard"):
            out.append(loggers_mod.TensorBoard(tensorboard_dir))
        else:
            warnings.warn(f"{message('Trainer(tensorboard_dir=)', 'tensorboard')}; logging without TensorBoard",
                          stacklevel=4)
    return out


def profiling(profiler: str | None, steps: Any, directory: Any, checkpoint_dir: Any) -> dict[str, Any]:
    """``profiler``, ``profile_steps`` (a ``range`` of step 1 or ``(start, stop)``, as a pair) and
    ``profiler_dir`` (default ``<checkpoint_dir>/profiles``, else ``./shardwise_profiles``), checked."""
    if profiler not in (None, *PROFILERS):
        raise ValueError(f"profiler must be 'simple', 'pytorch' or None, got {profiler!r}")
    if steps is not None:
        if isinstance(steps, range) and steps.step == 1:
            steps = (steps.start, steps.stop)
        if not (isinstance(steps, (tuple, list)) and len(steps) == 2 and all(
                isinstance(s, int) and not isinstance(s, bool) for s in steps) and 0 <= steps[0] < steps[1]):
            raise ValueError(f"profile_steps must be a range of steps or (start, stop) with 0 <= start < stop, "
                             f"got {steps!r}")
        steps = (steps[0], steps[1])
    if profiler is None:
        return {"profile_steps": steps, "profiler_dir": None}
    if directory is None:
        directory = os.path.join(checkpoint_dir, "profiles") if checkpoint_dir is not None else "shardwise_profiles"
    return {"profile_steps": steps, "profiler_dir": os.path.abspath(os.fspath(directory))}


def gpus_given(devices: Any, accelerator: str) -> tuple[Any, tuple[int, ...] | None]:
    """Lightning's GPU spellings of ``devices``: ``-1`` is every GPU (the world size under a launcher),
    ``[0, 1]`` those GPUs (one rank each, local rank r on the r-th listed); refused, with the reason, where
    the run is not on CUDA. Returns the device count (anything else unchanged) and the listed GPUs."""
    listed = isinstance(devices, (list, tuple))
    if devices != -1 and not listed:
        return devices, None
    what = "means every GPU" if devices == -1 else "lists GPU indices"
    if not uses_cuda(accelerator) or not torch.cuda.is_available():
        why = "accelerator='cpu'" if accelerator == "cpu" else "no CUDA device is available"
        instead = f"devices={len(devices)}" if listed and devices else "e.g. devices=2"
        raise ValueError(f"devices={devices!r} {what}, but this run is on CPU ({why}): pass the number of "
                         f"processes, {instead}")
    if devices == -1:
        return (_launcher_world() if launch.under_torchrun() else torch.cuda.device_count()), None
    count = torch.cuda.device_count()
    if not devices or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < count for i in devices) \
            or len(set(devices)) != len(devices):
        raise ValueError(f"devices={devices!r} {what}: they must be distinct, from 0 to {count - 1} (this machine "
                         f"has {count} GPUs)")
    return len(devices), tuple(devices)


def auto_devices(strategy: Strategy, accelerator: str) -> int:
    """What ``devices="auto"`` means for this strategy (see :class:`~shardwise.fit.trainer.Trainer`)."""
    if launch.under_torchrun():
        world = _launcher_world()
        return next((d for d in range(1, world + 1) if strategy.processes(d) == world), world)
    first = torch.cuda.device_count() if uses_cuda(accelerator) else 1
    for d in [first, *range(1, 65)]:
        try:
            strategy.layout(d)
        except ValueError:
            continue
        return d  # type: ignore[no-any-return]
    return first


def _launcher_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


__all__ = ["FitOptions", "auto_devices", "gpus_given", "lightning_arguments", "profiling", "run_loggers"]
