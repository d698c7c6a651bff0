"""The fit loop: the same optimisation problem, whatever the strategy.

``Trainer(strategy, devices).fit(...)`` trains with a GLOBAL batch of
``batch_size`` per optimizer step. It starts its own worker processes when
called from a plain python process, or joins the group when torchrun started
it (``shardwise run``).
"""
from __future__ import annotations

import copy
import inspect
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise import launch
from shardwise.checkpoint import store as checkpoint
from shardwise.comm.topology import pick_device, teardown
from shardwise.data import DataSource, loader_options
from shardwise.fit.infer import Inference, check_inference, resolve_checkpoint, spawned_inference
from shardwise.fit.job import (
    FitResult,
    Job,
    SchedulerFactory,
    leave_after_error,
    pickled,
    spawned_fit,
)
from shardwise.fit.options import FitOptions, lightning_arguments
from shardwise.fit.prestart import preflight
from shardwise.fit.prestart.checks import (
    check_fit_options,
    check_step,
    given_model,
    parse_inputs,
    run_steps,
    uncompiled,
    validate,
)
from shardwise.fit.replicas import fit_replicas
from shardwise.fit.schedule import check_schedule
from shardwise.ft.options import FaultTolerance
from shardwise.init_from import InitFrom, OwnInit, materialize
from shardwise.loggers import Logger, check_hparams
from shardwise.optim.param_groups import ParamGroupsFn
from shardwise.pool import KeptRanks
from shardwise.step import LossFn, OptimizerFactory, StepFn
from shardwise.strategies.base import OwnDevices, Strategy
from shardwise.strategies.single import Single

__all__ = ["FitResult", "SchedulerFactory", "Trainer", "trained_into"]


class Trainer:
    """Train one model with any strategy; ``strategy`` and ``devices`` are the whole switch.

    Args:
        strategy: a name (``"single"``, ``"ddp"``, ...) or a strategy object such as ``sw.DDP(...)``.
        devices: number of devices (one process each, except ``dp``: one process drives them all), or
            ``"auto"`` (the default): the world size under ``shardwise run``/torchrun; else every GPU when
            CUDA is used; else the fewest devices the strategy's sizes allow (1 for most, ``dp*tp*pp`` for
            a ``Parallel`` with fixed sizes). A distributed strategy on one device warns. On CUDA,
            Lightning's ``-1`` is every GPU and a list of GPU indices (``[0, 1]``) is those GPUs, one rank
            each (refused on CPU).
        accelerator: ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"`` (``"gpu"`` is ``"cuda"``).
        accumulate_grad_batches: micro-batches per optimizer step; the global batch is split
            into this many parts and gradients accumulate without communication until the last.
        gradient_clip_val: clip the global gradient norm (over all shards) to this value, or with
            ``gradient_clip_algorithm="value"`` every gradient element to ``[-value, value]``.
        gradient_clip_algorithm: ``"norm"`` (the default) or ``"value"``.
        fast_dev_run: a smoke test of the script: one optimizer step and one validation batch, with no
            checkpoint, logger or profiler (nothing is written under ``checkpoint_dir``).
        limit_val_batches: validate on the first this many global batches of ``val_dataset`` only (a float: that
            fraction of its batches, rounded down).
        limit_train_batches: an epoch is the first this many global batches of its order (a float: that fraction
            of the epoch's whole batches, rounded down); ``max_epochs`` counts such epochs, and per-epoch hooks and
            schedules follow them. A map-style dataset only.
        overfit_batches: train on the same first global batches every epoch, in the dataset's own order (as
            ``shuffle=False``), and validate on as many (unless ``limit_val_batches`` is given): a model that
            cannot drive their loss down has a bug. An int or a fraction, as ``limit_train_batches``.
        detect_anomaly: torch's anomaly detection in the ranks' backward (slow): the operation whose backward
            produced a NaN is named, with the forward's traceback.
        seed: seeds the data order, and Python's ``random``, numpy and torch on every rank before the model is
            built (:func:`shardwise.seed_everything`); DataLoader workers are seeded from it by torch. The data
            order does not depend on ``devices``. Seed before building the model too, for its initial weights.
        shuffle: False reads a map-style dataset in its own order, every epoch: global batch ``w`` is samples
            ``w*B .. (w+1)*B - 1``, whatever the device count (Lightning's order for a plain DataLoader).
        deterministic: torch's deterministic algorithms on every rank (an operation without one raises), cuDNN
            without benchmarking, and the cuBLAS workspace that needs.
        progress: ``"auto"`` shows a rich progress bar on rank 0 when stderr is a terminal, and plain lines
            (step, loss, step time, memory, elapsed, ETA; every tenth of the run) when it is not (a log, a
            pipe, CI); ``"bar"`` or ``"lines"`` choose; False shows nothing.
        metrics_path: write one JSON line per logged step (rank 0) to this file: the global loss, each
            parameter group's lr, the global gradient norm (before clipping; measured on logged steps
            only) and whether a clip by norm applied, step time, tokens/s (for integer token inputs), model FLOPs
            utilisation (with ``peak_flops``), resident memory, bytes sent by group; and a line per validation. A
            shorthand for ``logger=sw.loggers.JSONL(path)``.
        tensorboard_dir: also log those scalars to TensorBoard (when tensorboard is installed; a warning
            otherwise): a shorthand for ``logger=sw.loggers.TensorBoard(dir)``.
        peak_flops: peak FLOP/s of ONE device, for model FLOPs utilisation (6 x parameters x tokens,
            Kaplan et al. 2020, divided by the peak of all devices).
        timeout_s: how long a collective may wait before the run fails with its name.
        checkpoint_dir: where sharded checkpoints go (torch.distributed.checkpoint, see
            :mod:`shardwise.checkpoint`); training continues from the newest intact checkpoint there (see
            ``resume``), with any strategy and device count.
        resume: ``"auto"`` (True) continues an interrupted run of the same configuration from ``checkpoint_dir``
            and refuses a checkpoint written with other optimizer settings or precision, naming each change (a
            run already complete says so in one line and returns its result); ``"never"`` (False) trains from
            scratch, removing an earlier run's checkpoints there; ``"must"`` refuses to start without a
            checkpoint, and continues one of other settings with a warning; a path (a ``step_*`` directory, or a
            checkpoint directory: its newest) continues that checkpoint, saving to ``checkpoint_dir``.
        checkpoint_every: save every this many optimizer steps (and after the last step).
        checkpoint_keep: how many of the newest checkpoints to keep (None keeps all).
        checkpoint_async: write checkpoints beside training: the loop stops only while this rank's share is
            copied to host memory (pinned on CUDA), and a thread writes and hashes the files on a gloo group of
            its own; one save at most is in flight (the next one, the end of the fit and SIGTERM wait for it).
            ``FitResult.stats`` reports the seconds each save blocked and the step slowdown during a write.
        memory_check: before starting, the planner (:mod:`shardwise.plan`) predicts the per-device
            memory of this layout; ``"error"`` stops with its breakdown when it will not fit,
            ``"warn"`` warns, ``"off"`` skips the check.
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (Lightning's ``32``, ``16`` and ``"bf16"`` too):
            autocast for the forward and loss, fp32 master weights (the parameters; sharded under ZeRO), and
            for fp16 a dynamic loss scaler whose overflow check is agreed by every rank.
        compile: compile each block of the model (every entry of its ModuleLists) in place with
            ``torch.compile`` before the strategy wraps it, so names and checkpoints are unchanged; ``True`` is
            inductor, a string another backend (``"aot_eager"``). Refused for the split-backward pipeline
            schedules (``"zb-h1"``, ``"zbv"``, ``"dualpipev"``). Compilations and recompilations are counted in
            ``FitResult.stats`` and recompilations reported on rank 0.
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
            (:class:`~shardwise.parallel.dp.sync_bn.SyncBatchNorm`, over the data-parallel group), which
            equals single-device training. Without it each rank normalises with its own part of the
            batch, and the running statistics of data-parallel rank 0 are every rank's (broadcast after
            each step, as torch DDP's ``broadcast_buffers``); a warning says so once.
        callbacks: objects with ``on_step_end``, ``on_validation_end``, ``on_checkpoint_saved``, ``on_fit_end``
            (:class:`shardwise.Callback`, e.g. :class:`shardwise.EarlyStopping`), called on
            every rank (pickled into spawned ranks: they must be picklable); any rank's ``info.stop()`` stops
            every rank after the same step.
        max_epochs: train this many passes over the dataset (Lightning's name): ``epochs x (len(dataset) //
            batch_size)`` optimizer steps, each epoch one reshuffled permutation of whole global batches (the
            last partial one is dropped). ``fit(max_steps=)`` may be given instead, or as well: the run stops
            at whichever comes first. An iterable dataset needs ``__len__`` for it (its length in samples).
            Resuming mid-epoch continues at the step the checkpoint holds, in the same epoch's order.
        dataloader_kwargs: DataLoader options for the training and validation data (``num_workers``,
            ``collate_fn``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``,
            ``multiprocessing_context``, ``timeout``); workers load exactly the batches the main process would.
        profiler: ``"simple"`` times every rank's profiled steps in parts (data, forward, backward, optimizer,
            other) and each collective by name beside its bytes; rank 0 prints the table at the end and
            ``FitResult.profile`` holds each rank's figures. ``"pytorch"`` writes a torch.profiler Chrome trace
            per rank, ``<profiler_dir>/rank<r>.json``, for Perfetto (:mod:`shardwise.fit.profiler`).
        profile_steps: the steps profiled, ``range(start, stop)`` or ``(start, stop)``; by default every step
            for ``"simple"`` and steps 1 and 2 for ``"pytorch"``.
        profiler_dir: where the traces go (default ``<checkpoint_dir>/profiles``, else ``./shardwise_profiles``).
        logger: where rank 0 (under ``fault_tolerance``, the first rank of the first live replica group, which
            reopens the loggers when rank 0's group dies) writes the run's hyperparameters (strategy, sizes, global
            batch, precision, optimizer and its groups, seed, max_steps) and its scalars (those of ``metrics_path``,
            as ``train/<name>``, and each validation's, as ``val/<name>``): a name (``"csv"``, ``"tensorboard"``,
            ``"mlflow"``, ``"wandb"``, writing under ``<checkpoint_dir>/logs``, else ``./shardwise_logs``), a logger
            object (:mod:`shardwise.loggers`: ``CSV``, ``TensorBoard``, ``JSONL``, ``MLflow``, ``WandB``, or your
            own of the ``Logger`` protocol; pickled into spawned ranks), or a list of them (None or False: none).
            ``result.loggers`` says where each run is (the MLflow run id, the W&B run directory); checkpoints keep
            it, and a resumed run logs into the same tracker run.
        log_every_n_steps: log the step scalars of every n-th optimizer step (steps n-1, 2n-1, ... and the last);
            50 by default, as Lightning's (1 writes a row per step). Loggers write on a thread of their own, so a
            logged step does not wait for a tracker; rows are still cheap to skip. Validations are logged whenever
            they run.
        engine: ``"shardwise"`` (our mechanisms; the default) or ``"torch"``: PyTorch's own engines under the
            same Trainer (``ddp``: DistributedDataParallel, with ZeroRedundancyOptimizer for ``zero1``;
            ``zero2``/``zero3``/``fsdp``/``hsdp``: FSDP2 ``fully_shard``; ``tp``: ``parallelize_module``), see
            ``shardwise.strategies.torch_engine.wrappers`` and docs/how-to/engines.md. A strategy object's own
            ``engine=`` wins; both given and different is refused.
        fault_tolerance: ``True`` or ``sw.FaultTolerance(min_replicas=, timeout_s=)``: a replica group (a rank
            under ``ddp``) that dies or stops answering leaves the run, and the live groups compute its share of
            every later step, so the model ends as an uninterrupted run's; a step is applied only when every live
            group completed its reduction (:mod:`shardwise.ft`, docs/concepts/fault-tolerance.md). The ranks are
            started here, from a plain ``python script.py``. ``FitResult.stats`` gains ``failures``,
            ``steps_recomputed`` and ``seconds_lost``.
        sample_ledger: with ``fault_tolerance``, a JSON-lines file where the launcher writes, per committed step,
            which replica group computed which sample indices.
        max_steps: the run's optimizer steps when ``fit`` is given no ``max_steps`` (Lightning's place for it;
            ``-1``, Lightning's "no bound", is None).
        benchmark: ``torch.backends.cudnn.benchmark`` on every rank (cuDNN times its algorithms for each new input
            shape); None leaves torch's setting. Refused with ``deterministic=True``.
        enable_model_summary: rank 0 prints, once before the first step when progress is shown, the model's
            parameters in total and per rank under the layout, and the planner's memory per rank
            (:mod:`shardwise.plan`, the memory check's own plan).
        **lightning: Lightning's other Trainer arguments: ``enable_progress_bar`` (False is ``progress=False``),
            ``num_nodes=1``, ``num_sanity_val_steps=0`` and ``enable_checkpointing`` (True with ``checkpoint_dir``,
            False without) are taken; the others (``val_check_interval``, ``check_val_every_n_epoch``,
            ``default_root_dir``, ``min_epochs``, ``max_time``, ...) are refused in one line that names what does
            their work here (:func:`shardwise.fit.options.lightning_arguments`).

    :func:`shardwise.log` (``sw.log(name, value, reduce=)``) adds your own scalars to the step log, from a loss
    function, a model's forward or a callback (:mod:`shardwise.loggers.scalars`).
    """

    def __init__(self, strategy: str | Strategy = "single", devices: int | str | list[int] = "auto",
                 accelerator: str = "auto", *,
                 accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None, seed: int = 0,
                 progress: bool | str = "auto", metrics_path: str | os.PathLike[str] | None = None,
                 timeout_s: float = 300.0, checkpoint_dir: str | os.PathLike[str] | None = None,
                 checkpoint_every: int | None = None,
                 resume: bool | str | os.PathLike[str] = "auto", debug: bool = False,
                 on_nonfinite: str = "error", checkpoint_keep: int | None = 3, memory_check: str = "error",
                 device_memory: int | None = None, precision: str | int = "32",
                 activation_checkpointing: bool | tuple[type[nn.Module], ...] = False,
                 tensorboard_dir: str | os.PathLike[str] | None = None, peak_flops: float | None = None,
                 max_processes_per_core: int | None = 8, sync_batchnorm: bool = False,
                 callbacks: list[Any] | None = None, dataloader_kwargs: dict[str, Any] | None = None,
                 max_epochs: int | None = None, logger: str | Logger | list[str | Logger] | None = None,
                 log_every_n_steps: int = 50, profiler: str | None = None,
                 profile_steps: range | tuple[int, int] | None = None,
                 profiler_dir: str | os.PathLike[str] | None = None, engine: str | None = None,
                 checkpoint_async: bool = False, compile: bool | str = False,
                 fault_tolerance: bool | FaultTolerance | None = None,
                 sample_ledger: str | os.PathLike[str] | None = None, deterministic: bool = False,
                 shuffle: bool = True, gradient_clip_algorithm: str = "norm", fast_dev_run: bool = False,
                 limit_val_batches: int | float | None = None, detect_anomaly: bool = False,
                 limit_train_batches: int | float | None = None, overfit_batches: int | float | None = None,
                 max_steps: int | None = None, benchmark: bool | None = None, enable_model_summary: bool = True,
                 **lightning: Any) -> None:
        if lightning:  # Lightning's other arguments: ours for them, or one line naming what does their work
            ours = lightning_arguments(lightning, _PARAMETERS, checkpoint_dir)
            progress = ours.get("progress", progress)
        self.options = FitOptions.build(
            strategy, devices, accelerator, accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val, seed=seed, progress=progress, metrics_path=metrics_path,
            timeout_s=timeout_s, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
            debug=debug, on_nonfinite=on_nonfinite, checkpoint_keep=checkpoint_keep, memory_check=memory_check,
            device_memory=device_memory, precision=precision, activation_checkpointing=activation_checkpointing,
            tensorboard_dir=tensorboard_dir, peak_flops=peak_flops, max_processes_per_core=max_processes_per_core,
            sync_batchnorm=sync_batchnorm, callbacks=callbacks, dataloader_kwargs=dataloader_kwargs,
            max_epochs=max_epochs, logger=logger, log_every_n_steps=log_every_n_steps, profiler=profiler,
            profile_steps=profile_steps, profiler_dir=profiler_dir, engine=engine, checkpoint_async=checkpoint_async,
            compile=compile, fault_tolerance=fault_tolerance, sample_ledger=sample_ledger,
            deterministic=deterministic, shuffle=shuffle, gradient_clip_algorithm=gradient_clip_algorithm,
            fast_dev_run=fast_dev_run, limit_val_batches=limit_val_batches, detect_anomaly=detect_anomaly,
            limit_train_batches=limit_train_batches, overfit_batches=overfit_batches, max_steps=max_steps,
            benchmark=benchmark, enable_model_summary=enable_model_summary)
        # The ranks a call starts here serve this Trainer's later calls too (fit, then validate, predict).
        self._ranks = KeptRanks()
        weakref.finalize(self, self._ranks.close)
        o = self.options
        if o.devices == 1 and not isinstance(o.strategy, (Single, OwnDevices)):
            # Trainer("ddp") alone used to run one process without a word: nothing is split then.
            warnings.warn(f"strategy {o.strategy.name!r} with devices=1 runs one process on one device: nothing "
                          "is split or communicated; pass devices=N (devices='auto' takes the world size under "
                          "`shardwise run`, or every GPU)", stacklevel=2)

    def __getattr__(self, name: str) -> Any:
        # trainer.devices, trainer.strategy, trainer.sizes, ...: read-only views of the options.
        view = name in FitOptions.__dataclass_fields__ or isinstance(getattr(FitOptions, name, None), property)
        if name == "options" or not view:
            # "options" not set yet (unpickling, copying): no recursion; a typo names the Trainer, not FitOptions
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.options, name)

    # ------------------------------------------------------------------
    def fit(self, model: nn.Module, dataset: Any, loss_fn: LossFn | None = None,
            optimizer: OptimizerFactory | None = None, batch_size: int | None = None, max_steps: int | None = None,
            lr_scheduler: SchedulerFactory | None = None, *,
            val_dataset: Any = None, val_every: int | None = None,
            val_metrics: dict[str, Callable[[Any, Any], Any]] | None = None, val_batch_size: int | None = None,
            checkpoint_best: str | tuple[str, str] | None = None, num_workers: int | None = None,
            collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool | None = None,
            inputs: str | list[str] | tuple[str, ...] | None = None,
            param_groups: ParamGroupsFn | None = None, training_step: StepFn | None = None,
            init_from: str | os.PathLike[str] | None = None, init_allow_missing: list[str] | tuple[str, ...] = (),
            return_state_dict: bool = True, hparams: Mapping[str, Any] | None = None) -> FitResult:
        """Train for ``max_steps`` optimizer steps of global batch ``batch_size`` (or ``Trainer(max_epochs=)``).

        The run trains a copy of ``model`` (strategies shard, wrap and split what they are given) and loads the
        final weights back into ``model``: after ``fit`` the model passed in is trained, under every strategy
        and launch (in this process, spawned ranks, or ``shardwise run``), and equals ``result.state_dict``.
        The full state dict is gathered once per process that called ``fit``: the one that started the ranks
        (the ranks it started gather none), or each rank of ``shardwise run``, whose model is its own.

        ``optimizer``: a factory called with the parameters each rank holds, e.g.
        ``functools.partial(torch.optim.AdamW, lr=1e-3)``. The groups it builds (by ``p.dim()``, shape or
        identity), or those of ``param_groups``, are decided on the unsplit model and carried onto the shards
        and slices of every strategy (:mod:`shardwise.optim.param_groups`). ``param_groups``: ``fn(model)`` returns
        torch's list of group dicts over the model's parameters (or their names), e.g. no weight decay for
        biases and norms; the factory builds over them.

        ``lr_scheduler``: a factory taking the optimizer, e.g.
        ``functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=1e-2, total_steps=100)``;
        stepped once per optimizer step (a skipped step included), the same under
        every strategy, and restored on resume by replaying that many steps. It may return Lightning's dict
        instead: ``{"scheduler": s, "interval": "step" | "epoch", "frequency": n, "monitor": name}`` (a function
        defined at module level, to reach spawned ranks): ``"epoch"`` steps after every ``n``-th epoch. A
        ``ReduceLROnPlateau`` steps after every validation on ``monitor`` (default ``"val_loss"``; any
        ``val_metrics`` name), with rank 0's value on every rank, and is replayed on resume from the validation
        history the checkpoint holds (:mod:`shardwise.fit.schedule`).

        ``dataset``: a map-style dataset (``len`` and index) or an iterable one (``IterableDataset``: each
        data-parallel rank keeps its positions of every global batch of the stream); samples are
        (input, target) pairs or dicts. ``num_workers``, ``collate_fn``, ``pin_memory`` override
        ``Trainer(dataloader_kwargs=)``. ``inputs`` (dict samples): what the model is called with: None
        passes every key but ``labels``/``label`` as keyword arguments, a key name passes that tensor
        positionally, a list of keys passes those as keyword arguments; the loss gets ``loss_fn(output,
        batch)``, the whole batch dict (see :mod:`shardwise.data`).

        Validation (:mod:`shardwise.fit.evaluate`): with ``val_dataset``, every ``val_every`` optimizer steps
        and after the last step the model is evaluated under the run's own strategy (eval mode, no grad)
        in batches of ``val_batch_size`` (default ``batch_size``): ``val_loss`` and each ``val_metrics``
        ``{name: fn(output, target)}``, ``fn`` returning the batch's MEAN, are averaged over the whole set
        weighting each batch by its samples: global values, equal to one device's. They go to the progress
        output, the loggers (``val/<name>``) and ``result.val_metrics``. ``checkpoint_best``
        (``"val_loss"``, ``(name, "min" | "max")``, or ``(name, mode, k)``: the ``k`` best) keeps the best
        validation's checkpoint in ``<checkpoint_dir>/best``, beside the last ones.

        ``training_step``: ``fn(model, batch)`` returns the step's loss (the batch's mean), or a dict with
        ``"loss"`` and other scalars to log, instead of ``loss_fn(model(x), y)``: it gets the strategy's model and
        this rank's part of the collated batch. Refused under pp > 1 (docs: how-to/custom-step).

        ``init_from`` (:mod:`shardwise.init_from`): start from pretrained weights (a Hugging Face directory, a
        ``.safetensors`` file or a shardwise checkpoint), each rank reading only what it holds; names and shapes
        are matched before any process starts, ``init_allow_missing`` (fnmatch patterns) names new tensors. A
        checkpoint in ``checkpoint_dir`` to resume wins over ``init_from``.

        ``return_state_dict=False``: no rank gathers the full state dict at the end; ``result.state_dict`` is
        empty, ``model`` is left as it was, and the trained weights are in the run's checkpoints. ``hparams``:
        your hyperparameters (nested allowed), logged by every logger beside the run's own.
        """
        model = given_model(model, loss_fn, optimizer, training_step)
        step = check_step(self.options, loss_fn, training_step, optimizer, batch_size, val_dataset)
        assert optimizer is not None and batch_size is not None  # check_step refused None: typed from here
        data = self._source(dataset, inputs, num_workers, collate_fn, pin_memory)
        max_steps = 1 if self.options.fast_dev_run else run_steps(self.options, max_steps, data, batch_size)
        info, groups, when = validate(self.options, model, data, batch_size, max_steps, optimizer, loss_fn,
                                      lr_scheduler, param_groups)
        init = InitFrom.checked(init_from, init_allow_missing, model)
        val = check_fit_options(self.options, model, loss_fn, data, batch_size, val_dataset, val_every, val_metrics,
                                val_batch_size, checkpoint_best, step)
        check_schedule(when, val.names if val is not None else None, self.options.epoch_steps(dataset, batch_size))
        job = Job(self.options, model, data, loss_fn, optimizer, batch_size, max_steps, info, lr_scheduler, val,
                  groups, step, init, return_state_dict, hparams=check_hparams(hparams))
        return self._trained(job, model)

    def _source(self, dataset: Any, inputs: Any, num_workers: int | None,
                collate_fn: Callable[[list[Any]], Any] | None, pin_memory: bool | None = None) -> DataSource:
        """``dataset`` as the ranks read it: the Trainer's loader options, those given here winning."""
        return DataSource(dataset, loader_options(self.dataloader_kwargs, num_workers=num_workers,
                                                  collate_fn=collate_fn, pin_memory=pin_memory), parse_inputs(inputs))

    def _trained(self, job: Job, model: nn.Module) -> FitResult:
        """Run ``job``, then load its final weights into ``model``, the one the user passed. One semantics
        whatever the launch: the run itself trains a copy (strategies shard, wrap and split the model they are
        given), and the model passed in ends trained (unless ``return_state_dict=False``)."""
        result = self._launch(job)
        if job.return_state_dict:
            trained_into(model, result.state_dict)
        return result

    def _run_here(self, job: Job | Inference) -> Any:
        """Run ``job`` (a fit or an evaluation pass) in the running group, joined here when a launcher started this
        process, or in this process when the layout has one; ``_SPAWN`` when its ranks must be started here.
        The job runs on a copy of its model (strategies shard and wrap what they are given)."""
        nprocs = self.layout.processes
        if dist.is_initialized() or launch.under_torchrun():
            owned = not dist.is_initialized()
            device = launch.init(self.options.rank_accelerator, self.timeout)
            world = dist.get_world_size()
            if world != nprocs:
                raise ValueError(f"devices={self.devices} needs {nprocs} processes but the running process group "
                                 f"has {world}; launch with --nproc {nprocs}, or pass devices='auto' (the default)")
            job.model = _copy_model(job.model)
            try:
                result = job.run(device)
            except BaseException as e:
                if owned:
                    leave_after_error(e)
                raise
            if owned:
                teardown()
            return result
        if nprocs == 1:
            job.model = _copy_model(job.model)
            return job.run(pick_device(self.options.rank_accelerator, 0))
        return _SPAWN

    def _launch(self, job: Job) -> FitResult:
        """Run ``job`` in this process, in the running group, or in rank processes started here."""
        if self.options.replicas is not None:
            return fit_replicas(job)
        here = self._run_here(job)
        if here is not _SPAWN:
            return here  # type: ignore[no-any-return]
        nprocs = self.layout.processes
        job.result_from_rank0 = True  # the other ranks' results are dropped: they gather no full state dict
        payload = pickled(job)
        with launch.result_dir() as tmp:
            path = os.path.join(tmp, "result.pt")
            try:
                self._ranks.spawn(spawned_fit, nprocs, args=(payload, path),
                                  accelerator=self.options.rank_accelerator, timeout=self.timeout)
            except launch.WorkerFailed as e:
                # The cause first, before the traceback that ends in this many-line message.
                print(f"shardwise: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
                raise
            saved = torch.load(path, weights_only=True)
        return FitResult(**saved)

    # ---- evaluation and inference after training (shardwise.fit.infer) ---------------------------------
    def predict(self, model: nn.Module, dataset: Any, batch_size: int, *,
                ckpt_path: str | os.PathLike[str] | None = None, inputs: str | list[str] | None = None,
                num_workers: int | None = None, collate_fn: Callable[[list[Any]], Any] | None = None
                ) -> torch.Tensor | None:
        """The model's output for every sample of ``dataset``, once each, in dataset order (stacked along dim 0),
        computed under this trainer's strategy: fsdp, tp, pp, cp and ep models infer sharded, never gathered
        whole. ``ckpt_path``: a checkpoint directory (a ``step_*`` one, or a run's ``checkpoint_dir``: its newest)
        whose weights replace ``model``'s, whatever layout wrote it. A Hugging Face output gives its ``logits``
        (its first tensor). Batches as in :meth:`fit` (``inputs`` for dict samples); the last may be partial.
        Returned in the calling process (on rank 0 under ``shardwise run``; None on the other ranks)."""
        return self._infer(  # type: ignore[no-any-return]
            "predict",
            model,
            dataset,
            batch_size,
            None,
            None,
            ckpt_path,
            inputs,
            num_workers,
            collate_fn,
        )

    def validate(self, model: nn.Module, dataset: Any, loss_fn: LossFn | None = None,
                 metrics: dict[str, Any] | None = None, batch_size: int = 32, *,
                 ckpt_path: str | os.PathLike[str] | None = None, inputs: str | list[str] | None = None,
                 num_workers: int | None = None, collate_fn: Callable[[list[Any]], Any] | None = None
                 ) -> dict[str, float]:
        """Global metrics of ``model`` (or of the checkpoint at ``ckpt_path``) on ``dataset`` under this
        trainer's strategy: ``val_loss`` (with ``loss_fn``) and each of ``metrics``: ``fn(output, target)``
        returning the batch's mean, or a torchmetrics ``Metric`` (any object with ``update(output, target)``
        and ``compute()``), updated on the ranks that hold each sample and synced over them, so F1 or AUC equal
        one device's on the whole set. See :mod:`shardwise.fit.infer`."""
        return self._infer("validate", model, dataset, batch_size, loss_fn, metrics,  # type: ignore[no-any-return]
                           ckpt_path, inputs, num_workers, collate_fn)

    def test(self, model: nn.Module, dataset: Any, loss_fn: LossFn | None = None,
             metrics: dict[str, Any] | None = None, batch_size: int = 32, *,
             ckpt_path: str | os.PathLike[str] | None = None, inputs: str | list[str] | None = None,
             num_workers: int | None = None, collate_fn: Callable[[list[Any]], Any] | None = None
             ) -> dict[str, float]:
        """:meth:`validate` on a test set: the loss is ``test_loss``."""
        return self._infer("test", model, dataset, batch_size, loss_fn, metrics,  # type: ignore[no-any-return]
                           ckpt_path, inputs, num_workers, collate_fn)

    def _infer(self, kind: str, model: nn.Module, dataset: Any, batch_size: int, loss_fn: LossFn | None,
               metrics: dict[str, Any] | None, ckpt_path: str | os.PathLike[str] | None, inputs: Any,
               num_workers: int | None, collate_fn: Callable[[list[Any]], Any] | None) -> Any:
        """One pass of ``kind`` (:class:`shardwise.fit.infer.Inference`), checked here, run on the ranks."""
        model = uncompiled(model, kind)
        checked = check_inference(self.options, kind, batch_size, loss_fn, metrics)
        data = self._source(dataset, inputs, num_workers, collate_fn)
        preflight.check_source(data, 1, what="dataset")
        path = resolve_checkpoint(ckpt_path) if ckpt_path is not None else None
        if path is not None:
            checkpoint.check_compatible(path, checkpoint.model_shapes(model))
        job = Inference(self.options, model, data, batch_size, kind, loss_fn, checked, path)
        return self._launch_pass(job)

    def _launch_pass(self, job: Inference) -> Any:
        """Run ``job`` as :meth:`_launch` runs a fit: in this process, in the running group, or in rank processes
        started here (rank 0's result comes back)."""
        here = self._run_here(job)
        if here is not _SPAWN:
            return here
        sent = {"model": job.model, "dataset": job.data.dataset, "loss_fn": job.loss_fn, "metrics": job.metrics}
        payload = launch.pickled_for_ranks(job, lambda: {f"{job.kind}'s {k}": v for k, v in sent.items()})
        with launch.result_dir() as tmp:
            out = os.path.join(tmp, "result.pt")
            self._ranks.spawn(spawned_inference, self.layout.processes, args=(payload, out),
                              accelerator=self.options.rank_accelerator, timeout=self.timeout)
            return torch.load(out, weights_only=True)["result"]


_SPAWN = object()  # _run_here's answer when the job's ranks must be started here
_PARAMETERS = tuple(inspect.signature(Trainer.__init__).parameters)[1:-1]  # (a typo's nearest names)


def _copy_model(model: nn.Module) -> nn.Module:
    try:
        return copy.deepcopy(model)
    except Exception as e:
        raise TypeError(f"fit trains a copy of the model (the strategy shards and wraps it) and loads the result "
                        f"back into yours, but {type(model).__name__} could not be copied with copy.deepcopy: "
                        f"{type(e).__name__}: {e}") from e


def trained_into(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a run's final full state dict into the model the user passed (every key, strictly); a meta-device
    model gets CPU memory for it first."""
    materialize(model, "cpu", OwnInit(model))  # (only a meta tensor changes: buffers outside the state dict)
    with torch.no_grad():
        model.load_state_dict(state_dict, strict=True)
