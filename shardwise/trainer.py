"""The fit loop: the same optimisation problem, whatever the strategy.

``Trainer(strategy, devices).fit(...)`` trains with a GLOBAL batch of
``batch_size`` per optimizer step. It starts its own worker processes when
called from a plain python process, or joins the group when torchrun started
it (``shardwise run``).
"""
from __future__ import annotations

import copy
import datetime as _dt
import os
import pickle
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field, fields
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise import checkpoint, launch
from shardwise import precision as precision_mod
from shardwise.callbacks import CallbackInfo, Control, agree_stop, call, check_callbacks, improved
from shardwise.data import DataSource, Kwargs, as_source, leaves, loader_options
from shardwise.evaluate import Validation, best_so_far, evaluate, history_from, history_tensors, save_best
from shardwise.progress import StepLog, batch_tokens, progress_bar, total_numel, want_progress
from shardwise.stats import cuda_peak_bytes, peak_rss_bytes, reset_cuda_peak, reset_peak_rss, unique_bytes
from shardwise.strategy import HasServers, LossFn, OptimizerFactory, StepRun, Strategy, iter_chunks, resolve
from shardwise.topology import Topology, pick_device, teardown

# Builds the run's learning-rate schedule from its optimizer, e.g. partial(lr_scheduler.OneCycleLR, ...).
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` returns (the public contract in DESIGN.md)."""

    losses: list[float]
    state_dict: dict[str, torch.Tensor]
    stats: list[dict[str, Any]] = field(default_factory=list)
    # One entry per validation: {"step": optimizer steps done, "val_loss": ..., <each val_metrics name>: ...}.
    val_metrics: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    """Train one model with any strategy; ``strategy`` and ``devices`` are the whole switch.

    Args:
        strategy: a name (``"single"``, ``"ddp"``, ...) or a strategy object such as ``sw.DDP(...)``.
        devices: number of devices (one process each, except ``dp``: one process drives them all), or
            ``"auto"`` (the default): the world size under ``shardwise run``/torchrun; else every GPU when
            CUDA is used; else the fewest devices the strategy's sizes allow (1 for most, ``dp*tp*pp`` for
            a ``Parallel`` with fixed sizes). A distributed strategy on one device warns.
        accelerator: ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"``.
        accumulate_grad_batches: micro-batches per optimizer step; the global batch is split
            into this many parts and gradients accumulate without communication until the last.
        gradient_clip_val: clip the global gradient norm (over all shards) to this value.
        seed: seeds the data order and torch's RNG; the data order does not depend on ``devices``.
        progress: ``"auto"`` shows a rich progress bar on rank 0 when stderr is a terminal, and plain lines
            (step, loss, step time, memory, elapsed, ETA; every tenth of the run) when it is not (a log, a
            pipe, CI); ``"bar"`` or ``"lines"`` choose; False shows nothing.
        metrics_path: write one JSON line per step (rank 0) to this file: loss, step time, tokens/s
            (for integer token inputs), model FLOPs utilisation (with ``peak_flops``), resident memory.
        tensorboard_dir: also log those scalars to TensorBoard (when tensorboard is installed).
        peak_flops: peak FLOP/s of ONE device, for model FLOPs utilisation (6 x parameters x tokens,
            Kaplan et al. 2020, divided by the peak of all devices).
        timeout_s: how long a collective may wait before the run fails with its name.
        checkpoint_dir: where sharded checkpoints go (torch.distributed.checkpoint, see
            :mod:`shardwise.checkpoint`); with ``resume=True`` training continues from the newest
            intact checkpoint there, with any strategy and device count.
        checkpoint_every: save every this many optimizer steps (and after the last step).
        checkpoint_keep: how many of the newest checkpoints to keep (None keeps all).
        memory_check: before starting, the planner (:mod:`shardwise.plan`) predicts the per-device
            memory of this layout; ``"error"`` stops with its breakdown when it will not fit,
            ``"warn"`` warns, ``"off"`` skips the check.
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``: autocast for the forward and loss,
            fp32 master weights (the parameters; sharded under ZeRO), and for fp16 a dynamic
            loss scaler whose overflow check is agreed by every rank.
        activation_checkpointing: recompute each block's forward in backward instead of keeping its
            activations: ``True`` for every entry of the model's ModuleLists, or a tuple of block classes.
        device_memory: bytes per device for that check (default: the GPU's memory, or this
            machine's RAM divided by the processes on it).
        debug: before every collective, check that all ranks of its group issue the same one
            (operation, name, sizes, step) and name the first rank that differs.
        on_nonfinite: a NaN/inf loss either stops training (``"error"``, naming step and rank) or
            skips that optimizer step on every rank (``"skip"``; costs one tiny all-reduce per step).
        max_processes_per_core: on CPU, refuse to start more than this many rank processes per core
            (each is a whole interpreter with its own model copy); None removes the bound.
        sync_batchnorm: BatchNorm layers normalise with the statistics of the whole global batch
            (:class:`~shardwise.parallel.sync_bn.SyncBatchNorm`, over the data-parallel group), which
            equals single-device training. Without it each rank normalises with its own part of the
            batch, and the running statistics of data-parallel rank 0 are every rank's (broadcast after
            each step, as torch DDP's ``broadcast_buffers``); a warning says so once.
        callbacks: objects with ``on_step_end``, ``on_validation_end``, ``on_checkpoint_saved``, ``on_fit_end``
            (:class:`shardwise.callbacks.Callback`, e.g. :class:`~shardwise.callbacks.EarlyStopping`), called on
            every rank (pickled into spawned ranks: they must be picklable); any rank's ``info.stop()`` stops
            every rank after the same step.
        dataloader_kwargs: DataLoader options for the training and validation data (``num_workers``,
            ``collate_fn``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``,
            ``multiprocessing_context``, ``timeout``); workers load exactly the batches the main process would.
    """

    def __init__(self, strategy: str | Strategy = "single", devices: int | str = "auto", accelerator: str = "auto", *,
                 accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None, seed: int = 0,
                 progress: bool | str = "auto", metrics_path: str | os.PathLike[str] | None = None,
                 timeout_s: float = 300.0, checkpoint_dir: str | os.PathLike[str] | None = None,
                 checkpoint_every: int | None = None, resume: bool = True, debug: bool = False,
                 on_nonfinite: str = "error", checkpoint_keep: int | None = 3, memory_check: str = "error",
                 device_memory: int | None = None, precision: str = "32",
                 activation_checkpointing: bool | tuple[type[nn.Module], ...] = False,
                 tensorboard_dir: str | os.PathLike[str] | None = None, peak_flops: float | None = None,
                 max_processes_per_core: int | None = 8, sync_batchnorm: bool = False,
                 callbacks: list[Any] | None = None, dataloader_kwargs: dict[str, Any] | None = None) -> None:
        self.strategy = resolve(strategy)
        self.callbacks = check_callbacks(callbacks)
        self.dataloader_kwargs = dict(dataloader_kwargs or {})
        loader_options(self.dataloader_kwargs)  # an unknown or refused option fails here
        if accelerator not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown accelerator {accelerator!r}; valid: 'auto', 'cpu', 'cuda'")
        if max_processes_per_core is not None and max_processes_per_core < 1:
            raise ValueError(f"max_processes_per_core must be >= 1 (or None for no bound), "
                             f"got {max_processes_per_core}")
        self.max_processes_per_core = max_processes_per_core
        self.sync_batchnorm = sync_batchnorm
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every was given without checkpoint_dir: say where checkpoints go")
        self.checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        if checkpoint_keep is not None and checkpoint_keep < 1:
            raise ValueError(f"checkpoint_keep must be >= 1 (or None to keep all), got {checkpoint_keep}")
        self.checkpoint_keep = checkpoint_keep
        if memory_check not in ("error", "warn", "off"):
            raise ValueError(f"memory_check must be 'error', 'warn' or 'off', got {memory_check!r}")
        self.memory_check = memory_check
        self.precision = precision_mod.check(precision)
        self.activation_checkpointing = activation_checkpointing
        self.tensorboard_dir = os.fspath(tensorboard_dir) if tensorboard_dir is not None else None
        self.peak_flops = peak_flops
        self.device_memory = device_memory
        self.debug = debug
        if on_nonfinite not in ("error", "skip"):
            raise ValueError(f"on_nonfinite must be 'error' or 'skip', got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        if devices == "auto":
            devices = auto_devices(self.strategy, accelerator)
        elif not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise ValueError(f"devices must be a positive integer or 'auto', got {devices!r}")
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}")
        self.devices = devices
        self.accelerator = accelerator
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.seed = seed
        self.progress = progress
        self.metrics_path = str(metrics_path) if metrics_path is not None else None
        self.timeout = _dt.timedelta(seconds=timeout_s)
        self.sizes = self.strategy.sizes(devices)
        if devices == 1 and self.strategy.name not in ("single", "naive_mp"):  # naive_mp lists its own devices
            # Trainer("ddp") alone used to run one process without a word: nothing is split then.
            warnings.warn(f"strategy {self.strategy.name!r} with devices=1 runs one process on one device: nothing "
                          "is split or communicated; pass devices=N (devices='auto' takes the world size under "
                          "`shardwise run`, or every GPU)", stacklevel=2)

    # ------------------------------------------------------------------
    def fit(self, model: nn.Module, dataset: Any, loss_fn: LossFn, optimizer: OptimizerFactory,
            batch_size: int, max_steps: int, lr_scheduler: SchedulerFactory | None = None, *,
            val_dataset: Any = None, val_every: int | None = None,
            val_metrics: dict[str, Callable[[Any, Any], Any]] | None = None, val_batch_size: int | None = None,
            checkpoint_best: str | tuple[str, str] | None = None, num_workers: int | None = None,
            collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool | None = None,
            inputs: str | list[str] | tuple[str, ...] | None = None) -> FitResult:
        """Train for ``max_steps`` optimizer steps of global batch ``batch_size``.

        The run trains a copy of ``model`` (strategies shard, wrap and split what they are given) and loads the
        final weights back into ``model``: after ``fit`` the model passed in is trained, under every strategy
        and launch (in this process, spawned ranks, or ``shardwise run``), and equals ``result.state_dict``.

        ``lr_scheduler``: a factory taking the optimizer, e.g.
        ``functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=1e-2, total_steps=100)``;
        stepped once per optimizer step (a skipped step included), the same under
        every strategy, and restored on resume by replaying that many steps.

        ``dataset``: a map-style dataset (``len`` and index) or an iterable one (``IterableDataset``: each
        data-parallel rank keeps its positions of every global batch of the stream); samples are
        (input, target) pairs or dicts. ``num_workers``, ``collate_fn``, ``pin_memory`` override
        ``Trainer(dataloader_kwargs=)``. ``inputs`` (dict samples): what the model is called with: None
        passes every key but ``labels``/``label`` as keyword arguments, a key name passes that tensor
        positionally, a list of keys passes those as keyword arguments; the loss gets ``loss_fn(output,
        batch)``, the whole batch dict (see :mod:`shardwise.data`).

        Validation (:mod:`shardwise.evaluate`): with ``val_dataset``, every ``val_every`` optimizer steps
        and after the last step the model is evaluated under the run's own strategy (eval mode, no grad)
        in batches of ``val_batch_size`` (default ``batch_size``): ``val_loss`` and each ``val_metrics``
        ``{name: fn(output, target)}``, ``fn`` returning the batch's MEAN, are averaged over the whole set
        weighting each batch by its samples: global values, equal to one device's. They go to the progress
        output, the metrics file, TensorBoard and ``result.val_metrics``. ``checkpoint_best``
        (``"val_loss"``, or ``(name, "min" | "max")``) keeps the best validation's checkpoint in
        ``<checkpoint_dir>/best``.
        """
        data = DataSource(dataset, loader_options(self.dataloader_kwargs, num_workers=num_workers,
                                                  collate_fn=collate_fn, pin_memory=pin_memory), _inputs(inputs))
        info = self._validate(model, data, batch_size, max_steps, optimizer, loss_fn, lr_scheduler)
        val = _check_fit_options(self, model, loss_fn, data, batch_size, val_dataset, val_every, val_metrics,
                                 val_batch_size, checkpoint_best)
        job = _Job(self, model, data, loss_fn, optimizer, batch_size, max_steps, info, lr_scheduler, val)
        result = self._launch(job)
        # One semantics whatever the launch: the model passed in ends trained. The run itself trains a copy
        # (strategies shard, wrap and split the model they are given), then the final weights go back here.
        trained_into(model, result.state_dict)
        return result

    def _launch(self, job: "_Job") -> FitResult:
        """Run ``job`` in this process, in the running group, or in rank processes started here."""
        nprocs = self.strategy.processes(self.devices)
        if dist.is_initialized() or launch.under_torchrun():
            owned = not dist.is_initialized()
            device = launch.init(self.accelerator, self.timeout)
            world = dist.get_world_size()
            if world != nprocs:
                raise ValueError(f"devices={self.devices} needs {nprocs} processes but the running process group "
                                 f"has {world}; launch with --nproc {nprocs}, or pass devices='auto' (the default)")
            job.model = _copy_model(job.model)
            try:
                result = job.run(device)
            except BaseException as e:
                if owned:
                    _leave_after_error(e)
                raise
            if owned:
                teardown()
            return result
        if nprocs == 1:
            job.model = _copy_model(job.model)
            return job.run(pick_device(self.accelerator, 0))
        payload = _pickled(job)
        with launch.result_dir() as tmp:
            path = os.path.join(tmp, "result.pt")
            try:
                launch.spawn(_spawned_fit, nprocs, args=(payload, path), accelerator=self.accelerator,
                             timeout=self.timeout)
            except launch.WorkerFailed as e:
                # The cause first, before the traceback that ends in this many-line message.
                print(f"shardwise: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
                raise
            saved = torch.load(path, weights_only=True)
        return FitResult(**saved)

    def _validate(self, model: nn.Module, dataset: Any, batch_size: int, max_steps: int,
                  optimizer: OptimizerFactory, loss_fn: LossFn,
                  lr_scheduler: SchedulerFactory | None = None) -> dict[str, Any]:
        """Everything that can be checked before any process starts or blocks; returns the run's record
        for checkpoints (:func:`shardwise.checkpoint.run_info`)."""
        from shardwise import preflight

        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a factory that builds the optimizer from parameters (each rank builds "
                            f"its own, over the parameters it holds), not a built {type(optimizer).__name__}; pass "
                            f"e.g. functools.partial(torch.optim.{type(optimizer).__name__}, lr=...)")
        preflight.check_source(dataset, batch_size)  # map-style or a stream, with at least one global batch
        dp, k = self.strategy.batch_shards(self.devices), self.accumulate_grad_batches
        if batch_size % (dp * k):
            raise ValueError(
                f"batch_size={batch_size} is not divisible by data-parallel size {dp} x "
                f"accumulate_grad_batches {k} = {dp * k}; the global batch must split evenly "
                f"(try batch_size={max(dp * k, batch_size // (dp * k) * dp * k)})")
        self.strategy.check_model(model, self.devices, batch_size, self.accumulate_grad_batches)
        self._check_batchnorm(model)
        if isinstance(self.strategy, HasServers) and (self.precision == "16-mixed" or self.on_nonfinite == "skip"):
            # Both make every training rank agree each step, in an all-reduce over the world
            # that the server ranks, busy in their own loop, never join: the job would hang.
            what = "precision='16-mixed'" if self.precision == "16-mixed" else "on_nonfinite='skip'"
            raise ValueError(f"strategy {self.strategy.name!r} does not support {what}: the loss-scale overflow and "
                             "skip decisions are agreed by every rank each step, and the server ranks take no part "
                             "in training steps; use precision='bf16-mixed' (no loss scaling) or "
                             "on_nonfinite='error' with it")
        # One micro-batch of the real data (at most 64 samples: only shapes matter), then the model and loss on meta.
        batch = preflight.first_batch(dataset, max(1, min(64, batch_size // (dp * k))))
        preflight.check_loss(model, batch, loss_fn)
        if self.sizes["tp"] > 1:  # the plan, applied to a meta copy, and the split forward, before any rank exists
            from shardwise.parallel.tp_check import check_plan

            check_plan(model, _tp_plan(self.strategy), self.sizes["tp"], batch[0])
        self._check_devices()
        probe = optimizer([nn.Parameter(torch.zeros(1))])
        if not isinstance(probe, torch.optim.Optimizer):
            raise TypeError("optimizer must be a factory that returns a torch.optim.Optimizer when called with "
                            "parameters, e.g. functools.partial(torch.optim.AdamW, lr=1e-3); got "
                            f"{type(probe).__name__}")
        self.strategy.check_optimizer(probe)
        if lr_scheduler is not None:
            _check_scheduler(lr_scheduler, probe, self.strategy)
        info = checkpoint.run_info(model, probe, batch_size, self.precision)
        if self.checkpoint_dir is not None:
            checkpoint.check_directory(self.checkpoint_dir)
            if self.resume:
                checkpoint.check_resume(self.checkpoint_dir, info, max_steps)
        if self.memory_check != "off":
            self._check_memory(model, probe, batch_size)
        return info

    def _check_batchnorm(self, model: nn.Module) -> None:
        """Say once what BatchNorm computes under this layout, or refuse sync_batchnorm where it cannot work."""
        from shardwise.parallel.sync_bn import batchnorm_layers

        layers = batchnorm_layers(model)
        dp = self.strategy.sizes(self.devices)["dp"]
        several = self.strategy.batch_shards(self.devices) > 1 and self.strategy.processes(self.devices) > 1
        if self.sync_batchnorm and self.strategy.processes(self.devices) == 1 and self.devices > 1:
            raise ValueError(f"sync_batchnorm is not supported by strategy {self.strategy.name!r}: one process "
                             "drives every device, so there is no group to synchronise over; use 'ddp'")
        if layers and several and dp > 1 and not self.sync_batchnorm:
            shown = ", ".join(layers[:5]) + (f" and {len(layers) - 5} more" if len(layers) > 5 else "")
            warnings.warn(f"the model has BatchNorm layers ({shown}): under {self.strategy.name!r} each of the "
                          f"{dp} data-parallel ranks normalises with the statistics of its own part of the batch, so "
                          "training differs from one device, and the running statistics are those of rank 0 "
                          "(broadcast after every step). Trainer(sync_batchnorm=True) normalises with the whole "
                          "batch's statistics, equal to single-device training", stacklevel=4)

    def _check_memory(self, model: nn.Module, probe: torch.optim.Optimizer, batch_size: int) -> None:
        """Ask the planner whether exactly this run fits before anything starts.

        The strategy describes its whole layout (sizes, zero stage, HSDP
        replicas, offload, pipeline micro-batches); the run adds precision and
        activation checkpointing. The planner lays the model states out rank by
        rank on a meta copy of the model (exact, see :mod:`shardwise.plan.states`)
        and adds activations and buffers for this batch. A run it cannot model
        is said so in a warning, never silently waved through.
        """
        from shardwise.plan import NotModelled, plan_run

        layout = self.strategy.describe(self.devices).with_run(self.precision, bool(self.activation_checkpointing))
        memory = self.device_memory or _device_memory(self.accelerator, self.strategy.processes(self.devices))
        tp_plan = _tp_plan(self.strategy)
        try:
            plan = plan_run(model, layout, memory, batch_size, probe,
                            accumulate_grad_batches=self.accumulate_grad_batches,
                            batch_shards=self.strategy.batch_shards(self.devices), tp_plan=tp_plan,
                            split_points=getattr(self.strategy, "split_points", None))
        except NotModelled as e:
            warnings.warn(f"memory check skipped: the planner cannot model this run ({e}); "
                          "Trainer(memory_check='off') silences this", stacklevel=3)
            return
        if not plan.fits:
            text = f"the planner predicts this run will not fit in device memory: {plan.message()}"
            if self.memory_check == "error":
                raise MemoryError(text + " (Trainer(memory_check='warn') to try anyway)")
            warnings.warn(text, stacklevel=3)
            return
        # A part the planner could not estimate must not pass as zero bytes without a word.
        for note in plan.notes:
            if note.startswith("activations and buffers not estimated"):
                warnings.warn(f"memory check incomplete: {note}; only parameters, gradients and optimizer states "
                              "were checked (Trainer(memory_check='off') silences this)", stacklevel=3)

    def _check_devices(self) -> None:
        nprocs = self.strategy.processes(self.devices)
        if self.accelerator == "cuda" and not torch.cuda.is_available():
            raise ValueError("accelerator='cuda' but no CUDA device is available; use accelerator='cpu' "
                             "(or 'auto', which picks CUDA only when present)")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", nprocs)) if launch.under_torchrun() else nprocs
        cuda = self.accelerator == "cuda" or (self.accelerator == "auto" and torch.cuda.is_available())
        if cuda and local > torch.cuda.device_count():
            raise ValueError(f"devices={self.devices} needs {local} CUDA devices on this machine but only "
                             f"{torch.cuda.device_count()} exist; lower devices or add machines (--nnodes)")
        cores = os.cpu_count() or 1
        bound = self.max_processes_per_core
        if not cuda and bound is not None and local > bound * cores:
            raise ValueError(f"devices={self.devices} would start {local} processes on {cores} CPU cores, more than "
                             f"max_processes_per_core={bound} per core: each rank is a whole Python process with its "
                             "own copy of the model, so this many would thrash or exhaust memory; lower devices, or "
                             "pass Trainer(max_processes_per_core=None) to start them anyway")
        if not cuda and local > cores:
            warnings.warn(f"devices={self.devices} starts {local} processes on {cores} CPU cores: ranks will "
                          "share cores, which is correct but slower than fewer ranks", stacklevel=3)


def _tp_plan(strategy: Strategy) -> Any:
    # How the strategy will split this model: not part of RunLayout (they describe the model, not the run).
    return getattr(strategy, "tp_plan", None) or getattr(strategy, "plan", None)


def _copy_model(model: nn.Module) -> nn.Module:
    try:
        return copy.deepcopy(model)
    except Exception as e:
        raise TypeError(f"fit trains a copy of the model (the strategy shards and wraps it) and loads the result "
                        f"back into yours, but {type(model).__name__} could not be copied with copy.deepcopy: "
                        f"{type(e).__name__}: {e}") from e


def trained_into(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a run's final full state dict into the model the user passed (every key, strictly)."""
    with torch.no_grad():
        model.load_state_dict(state_dict, strict=True)


def _pickled(job: "_Job") -> bytes:
    """The job for the rank processes, in plain pickle (not multiprocessing's: torch's multiprocessing
    pickler would move the parameters into shared memory, and every rank would then step the same storage).
    What cannot be pickled is named, with the fix, instead of a bare PicklingError."""
    try:
        return pickle.dumps(job)
    except Exception as e:  # PicklingError, AttributeError ("Can't pickle local object"), TypeError
        for what in ("loss_fn", "optimizer_fn", "lr_scheduler", "model", "dataset"):
            try:
                pickle.dumps(getattr(job, what))
            except Exception:
                arg = {"optimizer_fn": "optimizer"}.get(what, what)
                raise TypeError(f"fit's {arg} cannot be sent to the rank processes ({type(e).__name__}: {e}): "
                                "each rank is a fresh process that receives it pickled, so it must be defined at "
                                "the top level of a module (a `def`, a class, or functools.partial of one), not a "
                                "lambda or a function defined inside another; or launch with `shardwise run`, "
                                "where every rank builds it itself") from None
        raise


def auto_devices(strategy: Strategy, accelerator: str) -> int:
    """What ``devices="auto"`` means for this strategy (see :class:`Trainer`)."""
    if launch.under_torchrun():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return next((d for d in range(1, world + 1) if strategy.processes(d) == world), world)
    cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
    first = torch.cuda.device_count() if cuda else 1
    for d in [first, *range(1, 65)]:
        try:
            strategy.sizes(d)
        except ValueError:
            continue
        return d
    return first


def _device_memory(accelerator: str, nprocs: int) -> int:
    """Bytes one rank may use: its GPU's memory, or this machine's RAM shared by the ranks on this machine."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", nprocs)) if launch.under_torchrun() else nprocs
    if accelerator in ("cuda", "auto") and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
        return int(torch.cuda.get_device_properties(index).total_memory)
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        ram = 1 << 40  # unknown: do not block
    return int(ram // max(1, local))


def _inputs(inputs: Any) -> str | tuple[str, ...] | None:
    """fit's ``inputs`` (dict samples): None, one key, or a list of keys."""
    if inputs is None or isinstance(inputs, str):
        return inputs
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(k, str) for k in inputs):
        return tuple(inputs)
    raise TypeError(f"inputs must be a key of the dict samples, a list of keys, or None, got {inputs!r}")


def _check_fit_options(trainer: Trainer, model: nn.Module, loss_fn: LossFn, data: DataSource, batch_size: int,
                       val_dataset: Any, val_every: int | None, val_metrics: dict[str, Any] | None,
                       val_batch_size: int | None, checkpoint_best: Any) -> Validation | None:
    """fit's data, validation and callback options, checked before any process starts; the run's validation."""
    from shardwise import preflight
    from shardwise.callbacks import check_picklable
    from shardwise.evaluate import check_validation, make_validation

    strat = trainer.strategy
    val_data = None if val_dataset is None else DataSource(val_dataset, data.loader, data.inputs)
    val = make_validation(val_data, val_every, val_metrics, val_batch_size, checkpoint_best, batch_size,
                          trainer.checkpoint_dir, strat)
    if val is not None:
        check_validation(model, loss_fn, val)
    for cb in trainer.callbacks:
        if hasattr(cb, "check"):
            cb.check(val.names if val is not None else [])
    x = preflight.first_batch(data, 1)[0]
    if isinstance(x, Kwargs) and strat.name in ("pp", "parallel", "naive_mp"):
        raise ValueError(f"strategy {strat.name!r} feeds the model's input through its layers as one tensor, but the "
                         f"dict samples pass keyword inputs ({', '.join(x)}); pass inputs='<key>' (e.g. "
                         "inputs='input_ids') to call the model with that tensor")
    if strat.processes(trainer.devices) > 1 and not (dist.is_initialized() or launch.under_torchrun()):
        # Spawned ranks receive these pickled: name the one that is not, with the fix, before anything starts.
        check_picklable(trainer.callbacks)
        named = {"collate_fn": data.loader.collate_fn, "val_dataset": val_dataset,
                 **{f"val_metrics[{k!r}]": f for k, f in (val.metrics.items() if val is not None else [])},
                 **{k: v for k, v in data.loader.extra.items() if callable(v)}}
        for what, obj in named.items():
            try:
                pickle.dumps(obj)
            except Exception as e:
                raise TypeError(f"fit's {what} cannot be sent to the rank processes ({type(e).__name__}: {e}): each "
                                "rank is a fresh process that receives it pickled, so define it at the top level of "
                                "a module (a `def`, a class, or functools.partial of one), not a lambda or a local "
                                "function; or launch with `shardwise run`") from None
    return val


def _spawned_fit(rank: int, device: torch.device, job: bytes, path: str) -> None:
    reset_peak_rss()  # peak_rss_bytes is this run's, also on a process that ran jobs before (WorkerPool)
    result = pickle.loads(job).run(device)
    if rank == 0:
        torch.save({f.name: getattr(result, f.name) for f in fields(result)}, path)


@dataclass
class _Job:
    """Everything one rank needs to train; pickled into spawned workers."""

    trainer: Trainer
    model: nn.Module
    dataset: Any
    loss_fn: LossFn
    optimizer_fn: OptimizerFactory
    batch_size: int
    max_steps: int
    info: dict[str, Any]  # what checkpoints record about the run (checkpoint.run_info)
    lr_scheduler: SchedulerFactory | None = None
    validation: Validation | None = None

    def run(self, device: torch.device) -> FitResult:
        t = self.trainer
        topo = Topology.create(device, timeout=t.timeout, debug=t.debug, **t.sizes)
        try:
            return self._run(topo)
        finally:
            topo.close()

    def _run(self, topo: Topology) -> FitResult:
        t, strat = self.trainer, self.trainer.strategy
        torch.manual_seed(t.seed)
        reset_cuda_peak(topo.device)  # cuda_peak_*_bytes are this run's (a no-op on CPU)
        shapes = checkpoint.model_shapes(self.model)
        self.aliases = checkpoint.tied_aliases(self.model)
        if t.activation_checkpointing:
            from shardwise.parallel.checkpointing import apply_activation_checkpointing

            classes = None if t.activation_checkpointing is True else t.activation_checkpointing
            apply_activation_checkpointing(self.model, classes)  # type: ignore[arg-type]
        if t.sync_batchnorm and topo.size("dp") > 1:
            from shardwise.parallel.sync_bn import convert_sync_batchnorm

            convert_sync_batchnorm(self.model, topo.comm("dp"))
        model, opt = strat.setup(self.model, self.optimizer_fn, topo)
        prev: list[float] = []
        extra: dict[str, torch.Tensor] = {}
        self.control, self.stop_reason = Control(), None
        if t.checkpoint_dir is not None and t.resume:
            path = checkpoint.resume_point(t.checkpoint_dir, topo)
            if path is not None:
                restored = checkpoint.load(path, strat, model, opt, topo, shapes)
                prev, extra = restored.losses[:self.max_steps], restored.extra
            if "stopped" in extra:  # a run that stopped early is complete: rerunning it returns its result
                self.stop_reason = f"stopped early at step {len(prev)} (by a callback; the checkpoint's run)"
            if topo.rank == 0:  # resuming is the default: say what it does, also when there is nothing to do
                line = _resume_line(path, len(prev), self.max_steps) if self.stop_reason is None else \
                    f"shardwise: already complete: {path} {self.stop_reason.partition(' (')[0]}, 0 steps to run"
                print(line, file=sys.stderr, flush=True)
        self.history = history_from(extra)  # validations of the run so far (a resumed run's included)
        sent_after_setup = topo.stats.sent
        received_after_setup = topo.stats.received
        server = isinstance(strat, HasServers) and strat.is_server(topo)
        if server:
            times = self._serve(model, opt, topo, prev, shapes)
            losses = [0.0] * (self.max_steps - len(prev))  # a server owns no loss: zeros in the all-reduce
            state_bytes = _count_state(strat, model, opt)
        else:
            losses, times, state_bytes = self._loop(model, opt, topo, prev, shapes, extra)
        steps_run = max(1, len(losses))
        train_sent = topo.stats.sent - sent_after_setup
        train_received = topo.stats.received - received_after_setup
        global_losses = prev + _global_losses(losses, strat, topo)
        state_dict = strat.full_state_dict(model, topo)
        mine = {
            "rank": topo.rank,
            "peak_rss_bytes": peak_rss_bytes(),
            **cuda_peak_bytes(topo.device),  # cuda_peak_allocated_bytes, cuda_peak_reserved_bytes (CUDA only)
            "model_state_bytes": sum(state_bytes.values()),
            **{f"{k}_bytes": v for k, v in state_bytes.items()},
            "comm_bytes": topo.stats.sent,
            "comm_bytes_per_step": train_sent / steps_run,
            "comm_received_bytes_per_step": train_received / steps_run,
            "comm_by_name": dict(topo.stats.by_name),
            "comm_by_group": dict(topo.stats.by_group),
            # The first step pays one-off costs (allocations, lazy initialisation): left out when there are more.
            "step_time_s": statistics.median(times[1:] if len(times) > 1 else times) if times else 0.0,
            "activation_bytes": getattr(self, "activation_bytes", 0),
            # The sum of every buffer this rank holds (running statistics...): equal on replicas.
            "buffers_sum": float(sum(float(b.double().sum()) for b in model.buffers()
                                     if b.is_floating_point() and b.device.type != "meta")),  # (ps servers: meta)
            **(strat.rank_stats(model, topo) if isinstance(strat, HasServers) else {}),
        }
        stats = topo.comm("world").all_gather_object(mine, name="stats")
        result = FitResult(losses=global_losses, state_dict=state_dict, stats=stats, val_metrics=list(self.history))
        call(t.callbacks, "on_fit_end", CallbackInfo(len(global_losses), self.max_steps, topo.rank, topo.world_size,
                                                     history=list(self.history), losses=list(global_losses),
                                                     stop_reason=self.stop_reason, control=self.control))
        return result

    def _serve(self, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology, prev: list[float],
               shapes: dict[str, list[int]]) -> list[float]:
        """A server rank's part from step ``len(prev)`` (a resumed run starts at its checkpoint's step).

        It serves up to each step at which the workers save (every
        ``checkpoint_every`` steps and after the last), then saves with them:
        the same :func:`checkpoint.save` call and, before it, the same loss
        all-reduce, to which a server contributes zeros. Returns the per-step times.
        """
        t, strat = self.trainer, self.trainer.strategy
        times: list[float] = []
        done = len(prev)
        while done < self.max_steps:
            stop = self.max_steps
            if t.checkpoint_dir is not None and t.checkpoint_every is not None:
                stop = min(stop, (done // t.checkpoint_every + 1) * t.checkpoint_every)
            times += strat.serve(model, opt, topo, stop - done)  # type: ignore[attr-defined]
            done = stop
            if t.checkpoint_dir is not None:
                self._save(done, prev, [0.0] * (done - len(prev)), model, opt, topo, shapes, None)
        return times

    def _save(self, done: int, prev: list[float], losses: list[float], model: nn.Module, opt: torch.optim.Optimizer,
              topo: Topology, shapes: dict[str, list[int]], extra: dict[str, torch.Tensor] | None,
              directory: str | None = None, run: dict[str, Any] | None = None) -> str:
        """Checkpoint after ``done`` steps, on every rank: this run's ``losses`` made global (an all-reduce in
        which servers add zeros) follow the restored ``prev``. ``directory`` (the best checkpoint's) and ``run``
        replace the checkpoint directory and the run record; returns the checkpoint's path."""
        t = self.trainer
        so_far = prev + _global_losses(losses, t.strategy, topo)
        return checkpoint.save(directory or t.checkpoint_dir, done, so_far, t.strategy, model, opt,  # type: ignore
                               topo, shapes, keep=t.checkpoint_keep if directory is None else None,
                               aliases=self.aliases, run=run or self.info, extra=extra)

    def _loop(self, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology, prev: list[float],
              shapes: dict[str, list[int]], restored: dict[str, torch.Tensor]) -> tuple[list[float], list[float],
                                                                                      dict[str, int]]:
        """The step loop of a training rank from step ``len(prev)``: data, forward/backward, clip, step; after
        each step :meth:`_after_step` (callbacks, validation, checkpoints) may end it early."""
        t, strat, device = self.trainer, self.trainer.strategy, topo.device
        shards, shard = strat.data_parallel(topo)
        source = as_source(self.dataset)
        end = len(prev) if self.stop_reason is not None else self.max_steps  # a stopped run stays stopped
        data = source.train_batches(self.batch_size, shards, shard, seed=t.seed, start=len(prev), stop=end)
        k = t.accumulate_grad_batches
        rank0 = topo.rank == 0
        losses: list[float] = []  # floats, not tensors: a long run must not accumulate tensor objects
        times: list[float] = []
        state_bytes: dict[str, int] = {}
        log = StepLog(t.metrics_path, t.tensorboard_dir, t.peak_flops, total_numel(shapes), topo.world_size,
                      start=len(prev)) \
            if rank0 and (t.metrics_path or t.tensorboard_dir) else None
        scaler = precision_mod.LossScaler() if t.precision == "16-mixed" else None
        bn_buffers = _unsynced_batchnorm_buffers(model) if topo.size("dp") > 1 else []
        sched = _scheduler(self.lr_scheduler, opt, len(prev)) if self.lr_scheduler is not None else None
        if scaler is not None and "scaler" in restored:
            scaler.load_tensor(restored["scaler"])  # the scale and clean-step count the checkpoint's run had
        with progress_bar(rank0 and want_progress(t.progress), self.max_steps) as advance:
            advance.skip(len(prev))  # type: ignore[attr-defined]
            for step in range(len(prev), end):
                if topo.diag is not None:
                    topo.diag.step = step
                start = time.perf_counter()
                x, y = source.split(data.batch(step, device))
                micro = list(zip(iter_chunks(x, k), iter_chunks(y, k)))
                run = StepRun(t.precision, scaler.scale if scaler is not None else 1.0)
                if step == len(prev):
                    # Once, on the first step: the peak bytes autograd holds for backward
                    # (activations; parameters and the batch excluded), FitResult.stats["activation_bytes"].
                    from shardwise.parallel.checkpointing import track_saved_activations

                    with track_saved_activations(model.parameters(), leaves(x) + leaves(y)) as saved:
                        loss = strat.train_step(model, micro, self.loss_fn, topo, run)
                    self.activation_bytes = saved.peak
                else:
                    loss = strat.train_step(model, micro, self.loss_fn, topo, run)
                # Both checks agree across ranks, so every rank skips the same steps.
                skip = (scaler is not None and _overflow(scaler, opt, topo)) or \
                    not _finite(loss, step, t.on_nonfinite, topo)
                if not skip:
                    if t.gradient_clip_val is not None:
                        strat.clip_grad_norm(model, t.gradient_clip_val, topo)
                    opt.step()
                    if step == self.max_steps - 1:
                        # Counted at the high point of a step: gradients and optimizer states both live.
                        state_bytes = _count_state(strat, model, opt)
                opt.zero_grad(set_to_none=True)
                for b in bn_buffers:  # rank 0's running statistics are every replica's, as torch DDP's
                    topo.comm("dp").broadcast(b, src=0, name="batchnorm.buffers")
                if sched is not None:
                    _step_schedule(sched, 1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
                local = float(loss) if loss is not None else None
                losses.append(0.0 if local is None else local)
                tokens = batch_tokens(x.get("input_ids") if isinstance(x, Kwargs) else x) * shards
                advance(local, times[-1])
                if log is not None:
                    log.write(step, local, times[-1], tokens)
                if self._after_step(step + 1, local, model, opt, topo, prev, losses, shapes, scaler, log):
                    state_bytes = state_bytes or _count_state(strat, model, opt)  # stopped early
                    break
        data.close()
        if log is not None:
            log.close()
        return losses, times, state_bytes

    def _after_step(self, done: int, local: float | None, model: nn.Module, opt: torch.optim.Optimizer,
                    topo: Topology, prev: list[float], losses: list[float], shapes: dict[str, list[int]],
                    scaler: precision_mod.LossScaler | None, log: StepLog | None) -> bool:
        """After ``done`` optimizer steps, on every training rank: ``on_step_end``, validation when due, the
        agreement on a stop any callback asked for (with callbacks only: one flag all-reduce), then the periodic
        checkpoint, or the final one of a run that stops here. Returns whether the run stops."""
        t = self.trainer
        call(t.callbacks, "on_step_end", self._info(done, topo, loss=local))
        validated = self.validation is not None and self.validation.due(done, self.max_steps)
        if validated:
            self._validate_now(done, model, opt, topo, prev, losses, shapes, scaler, log)
        stop = agree_stop(self.control, t.strategy, topo) if t.callbacks and done < self.max_steps else None
        if stop is not None and self.validation is not None and not validated:
            self._validate_now(done, model, opt, topo, prev, losses, shapes, scaler, log)  # the run's last step
        if t.checkpoint_dir is not None and (done == self.max_steps or stop is not None or (
                t.checkpoint_every is not None and done % t.checkpoint_every == 0)):
            path = self._save(done, prev, losses, model, opt, topo, shapes, self._extra(scaler, done, stop))
            call(t.callbacks, "on_checkpoint_saved",
                 self._info(done, topo, path=path, kind="final" if stop is not None else "periodic"))
        if stop is not None:
            self.stop_reason = stop
            if topo.rank == 0 and want_progress(t.progress):
                print(f"shardwise: stopping after step {done}/{self.max_steps}: {stop}", file=sys.stderr, flush=True)
        return stop is not None

    def _info(self, done: int, topo: Topology, **kw: Any) -> CallbackInfo:
        return CallbackInfo(done, self.max_steps, topo.rank, topo.world_size, history=list(self.history),
                            control=self.control, **kw)

    def _validate_now(self, done: int, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology,
                      prev: list[float], losses: list[float], shapes: dict[str, list[int]],
                      scaler: precision_mod.LossScaler | None, log: StepLog | None) -> None:
        """Evaluate (:func:`shardwise.evaluate.evaluate`), record and show the metrics, tell the callbacks, and
        save ``<checkpoint_dir>/best`` when this validation is the best so far."""
        t, val = self.trainer, self.validation
        assert val is not None
        metrics = evaluate(model, t.strategy, val, self.loss_fn, topo, StepRun(t.precision), seed=t.seed)
        before = list(self.history)
        self.history.append({"step": done, **metrics})
        if log is not None:
            log.write_validation(done - 1, metrics)  # the row of the step whose weights were evaluated
        if topo.rank == 0 and want_progress(t.progress):
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            print(f"shardwise: validation after step {done}/{self.max_steps}: {shown}", file=sys.stderr, flush=True)
        call(t.callbacks, "on_validation_end", self._info(done, topo, metrics=dict(metrics)))
        if val.best is not None and improved(metrics[val.best[0]], best_so_far(before, val.best), val.best[1]):
            name, mode = val.best
            run = {**self.info, "best": {"metric": name, "mode": mode, "value": metrics[name]}}
            path = save_best(t.checkpoint_dir, lambda d: self._save(  # type: ignore[arg-type]
                done, prev, losses, model, opt, topo, shapes, self._extra(scaler, done, None), directory=d, run=run),
                topo)
            call(t.callbacks, "on_checkpoint_saved", self._info(done, topo, path=path, kind="best"))

    def _extra(self, scaler: precision_mod.LossScaler | None, done: int,
               stop: str | None) -> dict[str, torch.Tensor] | None:
        """Run state a checkpoint keeps beside the model: the fp16 scaler, the validation history, whether the
        run stopped early (then a resume finds it complete)."""
        extra = {"scaler": scaler.as_tensor()} if scaler is not None else {}
        extra.update(history_tensors(self.history))
        if stop is not None:
            extra["stopped"] = torch.tensor([done], dtype=torch.int64)
        return extra or None


def _resume_line(path: str | None, done: int, max_steps: int) -> str:
    if path is None:
        return f"shardwise: no checkpoint to resume from: training steps 0 to {max_steps}"
    if done >= max_steps:
        return f"shardwise: already complete: {path} is at step {done} of max_steps={max_steps}, 0 steps to run"
    return f"shardwise: resuming from step {done} of {path}: {max_steps - done} steps to run"


def _unsynced_batchnorm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The running statistics of BatchNorm layers that normalise with their own rank's batch."""
    return [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for b in m.buffers()]


def _check_scheduler(factory: SchedulerFactory, probe: torch.optim.Optimizer, strategy: Strategy) -> None:
    """Before any process starts: the factory builds a per-step schedule this strategy can drive (tried on
    the probe optimizer the other checks use)."""
    if isinstance(strategy, HasServers):
        raise ValueError(f"strategy {strategy.name!r} does not support lr_scheduler: its optimizer runs on the "
                         "server ranks, which take no part in the trainer's steps")
    made = factory(probe)
    if isinstance(made, torch.optim.lr_scheduler.ReduceLROnPlateau) or \
            not isinstance(made, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(f"lr_scheduler must build a torch.optim.lr_scheduler.LRScheduler stepped once per "
                        f"optimizer step, got {type(made).__name__} (ReduceLROnPlateau needs a metric: not supported)")


def _scheduler(factory: SchedulerFactory, opt: torch.optim.Optimizer, done: int) -> Any:
    """The run's schedule, advanced by the ``done`` steps a resumed run already took (a schedule is a function
    of the step count, so replaying the count restores it exactly, under any layout)."""
    sched = factory(opt)
    _step_schedule(sched, done)
    return sched


def _step_schedule(sched: Any, steps: int) -> None:
    """``steps`` steps of the schedule. torch warns when the first one comes before an optimizer step;
    here that is meant (a replay on resume, or a step skipped for an fp16 overflow is a step all the same)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
        for _ in range(steps):
            sched.step()


def _leave_after_error(e: BaseException) -> None:
    """A rank failed under torchrun: say so in one line first, and leave the group without a barrier.

    The peers may never reach a barrier (they wait in a collective for this
    rank), so a barrier here would hold the job until the collective timeout;
    leaving at once lets this process exit and the launcher stop the others
    within seconds. The one line (rank and error) comes before the traceback
    and before the peers' lost-connection errors, so the cause reads first.
    """
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    first = (str(e).splitlines() or [""])[0]
    print(f"shardwise: rank {rank} failed: {type(e).__name__}: {first}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _overflow(scaler: precision_mod.LossScaler, opt: torch.optim.Optimizer, topo: Topology) -> bool:
    """Unscale fp16 gradients; every rank learns whether any rank overflowed (one flag all-reduce)."""
    flag = torch.tensor([1.0 if scaler.unscale(opt) else 0.0], device=topo.device)
    topo.comm("world").all_reduce(flag, name="metrics.overflow")
    found = float(flag) > 0
    scaler.update(found)
    return found


def _finite(loss: torch.Tensor | None, step: int, mode: str, topo: Topology) -> bool:
    """Whether to take this step; raises in ``"error"`` mode on a non-finite local loss.

    In ``"skip"`` mode every rank must agree (a rank that steps alone would
    desynchronise the replicas), hence one all-reduce of a flag.
    """
    bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
    if mode == "error":
        if bad:
            raise FloatingPointError(f"non-finite loss {float(loss):g} at step {step} on rank {topo.rank}; "
                                     "pass Trainer(on_nonfinite='skip') to skip such steps instead")
        return True
    flag = torch.tensor([1.0 if bad else 0.0], device=topo.device)
    topo.comm("world").all_reduce(flag, name="metrics.nonfinite")
    return float(flag) == 0.0


def _count_state(strat: Strategy, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    return {kind: unique_bytes(ts) for kind, ts in strat.state_tensors(model, opt).items()}


def _global_losses(losses: list[float], strat: Strategy, topo: Topology) -> list[float]:
    """Mean over data-parallel replicas of each step's loss, known on every rank.

    One all-reduce over the world at the end (not one per step): ranks that do
    not own a loss (non-last pipeline stages, tp ranks > 0) contribute zero.
    """
    if not losses:
        return []
    t = torch.tensor(losses, dtype=torch.float64, device=topo.device)
    shards, _ = strat.data_parallel(topo)
    t = t / shards if strat.owns_loss(topo) else torch.zeros_like(t)  # server ranks own no loss
    topo.comm("world").all_reduce(t, name="metrics.losses")
    return [float(v) for v in t.cpu()]


def setup(*args: Any, **kwargs: Any) -> Any:
    """Kept for ``from shardwise.trainer import setup``: see :func:`shardwise.loop.setup`."""
    from shardwise.loop import setup as loop_setup

    return loop_setup(*args, **kwargs)
