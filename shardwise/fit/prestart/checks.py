"""Everything :meth:`shardwise.Trainer.fit` checks before any process starts or blocks.

Each check takes the run's :class:`~shardwise.fit.options.FitOptions` (the
Trainer's options as one value) and reads the strategy's capabilities
(:mod:`shardwise.strategies.base`) with isinstance, never its name. A run
refused here fails in the caller, with the fix in the message, instead of
deep inside a rank.
"""
from __future__ import annotations

import os
import shutil
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise import launch
from shardwise.checkpoint import resume
from shardwise.checkpoint import store as checkpoint
from shardwise.comm.topology import backend_for
from shardwise.data import DataSource, Kwargs
from shardwise.fit.callbacks import check_picklable
from shardwise.fit.evaluate import Validation, check_validation, make_validation
from shardwise.fit.options import RESUME_MODES, FitOptions
from shardwise.fit.prestart import preflight
from shardwise.fit.prestart.tp_check import check_plan
from shardwise.fit.progress import want_progress
from shardwise.fit.schedule import SchedulerFactory, When, unpack
from shardwise.optim.param_groups import GroupPlan, ParamGroupsFn, check_whole, plan_groups, splits_parameters
from shardwise.parallel.cp.apply import check_context_parallel, shard_batch
from shardwise.parallel.dp.sync_bn import batchnorm_layers
from shardwise.parallel.ep import warn_local_aux
from shardwise.step import LossFn, OptimizerFactory, StepFn, TrainingStep
from shardwise.strategies.base import HasServers, HasTPPlan, OwnDevices, SplitsModel, Strategy


def looks_like_lightning(model: Any) -> bool:
    """Whether ``model`` is a LightningModule, told by its methods: ``training_step`` and ``configure_optimizers``
    of its own class (Lightning need not be installed, nor imported here)."""
    return isinstance(model, nn.Module) and all(
        callable(getattr(type(model), m, None)) for m in ("training_step", "configure_optimizers"))


def refuse_lightning_module(model: Any) -> None:
    """A LightningModule given to ``fit`` without the loss and optimizer, which ``sw.Trainer`` takes apart: say
    exactly what to pass."""
    if looks_like_lightning(model):
        raise TypeError(f"{type(model).__name__} is a LightningModule (it has training_step and "
                        "configure_optimizers): shardwise's fit takes the pieces apart: fit(model, dataset, "
                        "loss_fn=fn(output, target), optimizer=functools.partial(torch.optim.AdamW, lr=...), "
                        "batch_size=...), or fit(..., training_step=fn(model, batch) -> loss, optimizer=...) for a "
                        "step of your own; the model's forward is used as it is (docs: migrate/lightning)")


def given_model(model: Any, loss_fn: Any, optimizer: Any, training_step: Any) -> Any:
    """fit's ``model`` as the run takes it: out of a ``torch.compile`` wrapper, and refused when it is a
    LightningModule given without the loss and the optimizer that shardwise takes apart."""
    model = uncompiled(model, "fit")
    if optimizer is None or (loss_fn is None and training_step is None):
        refuse_lightning_module(model)
    return model


def uncompiled(model: Any, what: str) -> Any:
    """The module inside a ``torch.compile(model)`` wrapper (an ``OptimizedModule``: its ``_orig_mod``, which
    holds the same parameters), with a warning naming ``Trainer(compile=True)``; any other model as it is."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing can be compiled yet
    wrapper = getattr(dynamo, "OptimizedModule", None)
    if wrapper is None or not isinstance(model, wrapper):
        return model
    warnings.warn(f"{what} got a torch.compile(model) wrapper: it runs the model inside it (its _orig_mod, the "
                  "same parameters), uncompiled; pass the model itself, with Trainer(compile=True) to compile each "
                  "block after the strategy wraps it", stacklevel=4)  # (fit or validate/test/predict, then yours)
    return model._orig_mod


def check_step(t: FitOptions, loss_fn: LossFn | None, training_step: StepFn | None, optimizer: Any,
               batch_size: Any, val_dataset: Any) -> TrainingStep | None:
    """fit's loss: ``loss_fn``, or a ``training_step`` (then ``loss_fn``, if given, is validation's loss); the
    arguments fit cannot default; and where a training_step cannot run (a pipeline: the loss is the last stage's)."""
    for name, v in (("optimizer", optimizer), ("batch_size", batch_size)):
        if v is None:
            raise TypeError(f"fit() needs {name}=")
    if training_step is None:
        if loss_fn is None:
            raise TypeError("fit() needs the loss: loss_fn(output, target), or training_step(model, batch) "
                            "returning it")
        return None
    if not callable(training_step):
        raise TypeError(f"training_step must be a function fn(model, batch) -> loss (or a dict with 'loss'), got "
                        f"{type(training_step).__name__}")
    strat = t.strategy
    if isinstance(strat, SplitsModel) and (t.layout.pp > 1 or isinstance(strat, OwnDevices)):
        split = f"pp={t.layout.pp}" if t.layout.pp > 1 else "its model split over devices"
        raise ValueError(f"training_step is not supported by strategy {strat.name!r} with {split}: the model is cut "
                         "into stages that run one after another, so no call of the model runs the whole of it, and "
                         "the loss is computed on the last stage from that stage's output alone; pass "
                         "loss_fn(output, target) instead (with dict samples it gets the whole batch as target), or "
                         "use a layout without pipeline stages (pp=1) for training_step")
    if val_dataset is not None and loss_fn is None:
        raise ValueError("val_dataset with training_step needs loss_fn too: validation computes val_loss = "
                         "loss_fn(output, target) on the model's output; or evaluate with trainer.validate(...) "
                         "after fit")
    return TrainingStep(training_step)


def validate(t: FitOptions, model: nn.Module, dataset: Any, batch_size: int, max_steps: int,
             optimizer: OptimizerFactory, loss_fn: LossFn | None, lr_scheduler: SchedulerFactory | None = None,
             param_groups: ParamGroupsFn | None = None) -> tuple[dict[str, Any], GroupPlan, When | None]:
    """Everything that can be checked before any process starts or blocks; returns the run's record
    for checkpoints (:func:`shardwise.checkpoint.run_info`), the optimizer's parameter groups and when the
    schedule steps (None: no schedule)."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a factory that builds the optimizer from parameters (each rank builds "
                        f"its own, over the parameters it holds), not a built {type(optimizer).__name__}; pass "
                        f"e.g. functools.partial(torch.optim.{type(optimizer).__name__}, lr=...)")
    preflight.check_source(dataset, batch_size)  # map-style or a stream, with at least one global batch
    dp, k = t.layout.batch_shards, t.accumulate_grad_batches
    if batch_size % (dp * k):
        raise ValueError(
            f"batch_size={batch_size} is not divisible by data-parallel size {dp} x "
            f"accumulate_grad_batches {k} = {dp * k}; the global batch must split evenly "
            f"(try batch_size={max(dp * k, batch_size // (dp * k) * dp * k)})")
    # One micro-batch of the real data (at most 64 samples: only shapes matter); lazy modules are initialised on it,
    # before anything reads the model's shapes.
    batch = preflight.first_batch(dataset, max(1, min(64, batch_size // (dp * k))))
    preflight.materialize_lazy(model, batch, t.precision)
    backend = backend_for(torch.device("cuda" if t.on_cuda else "cpu"))
    t.strategy.check_model(model, t.devices, batch_size, t.accumulate_grad_batches, backend)
    check_batchnorm(t, model)
    warn_local_aux(model, t.layout.dp * t.layout.cp)  # a Hugging Face MoE's own per-rank router loss
    if isinstance(t.strategy, HasServers) and (t.precision == "16-mixed" or t.on_nonfinite == "skip"):
        # Both make every training rank agree each step, in an all-reduce over the world
        # that the server ranks, busy in their own loop, never join: the job would hang.
        what = "precision='16-mixed'" if t.precision == "16-mixed" else "on_nonfinite='skip'"
        raise ValueError(f"strategy {t.strategy.name!r} does not support {what}: the loss-scale overflow and "
                         "skip decisions are agreed by every rank each step, and the server ranks take no part "
                         "in training steps; use precision='bf16-mixed' (no loss scaling) or "
                         "on_nonfinite='error' with it")
    if not launch.follower():
        check_running_model(t, model, batch, loss_fn)
    groups, probe = plan_groups(model, optimizer, param_groups)  # the groups, on the unsplit model
    check_groups(t, probe, groups)
    when = check_scheduler(lr_scheduler, probe, t.strategy) if lr_scheduler is not None else None
    info = resume.run_info(model, probe, batch_size, t.precision, groups.record())
    if t.checkpoint_dir is not None:
        resume.check_directory(t.checkpoint_dir)
    check_resume(t, info, max_steps)
    summary = t.enable_model_summary and want_progress(t.progress)
    if (t.memory_check != "off" or summary) and not launch.follower():  # rank 0 plans (once), for both
        try:
            plan = plan_memory(t, model, probe, batch_size, max_steps)
        except Exception as e:
            if t.memory_check != "off":
                raise
            plan = f"{type(e).__name__}: {e}"  # memory_check='off' asked for no plan: the summary says why none
        if t.memory_check != "off":
            check_memory(t, plan)
        if summary:
            print(model_summary(model, plan), file=sys.stderr, flush=True)
    return info, groups, when


def check_resume(t: FitOptions, info: dict[str, Any], max_steps: int) -> None:
    """``Trainer(resume=)`` against the checkpoints there are: ``"auto"`` continues only the same run, ``"must"``
    needs a checkpoint, ``"never"`` starts over (the earlier run's checkpoints in ``checkpoint_dir`` are removed,
    so that its newer steps are neither resumed later nor kept in place of this run's)."""
    if t.resume == "never":
        if t.checkpoint_dir is not None and not launch.follower():
            start_over(t.checkpoint_dir)
        return
    where = t.checkpoint_dir if t.resume in RESUME_MODES else t.resume
    if where is None:
        return
    if resume.check_resume(where, info, max_steps, explicit=t.resume != "auto") is None and t.resume == "must":
        raise ValueError(f"resume='must' but checkpoint_dir={t.checkpoint_dir!r} holds no checkpoint to resume; pass "
                         "resume='auto' to start when there is none")


def start_over(directory: str) -> None:
    """Remove the checkpoints (and the best one) of an earlier run in ``directory``, saying so in one line."""
    old = checkpoint.checkpoints(directory)
    best = os.path.join(directory, "best")
    if not old and not os.path.isdir(best):
        return
    print(f"shardwise: resume='never': removing {len(old)} checkpoint(s) of an earlier run in {directory}",
          file=sys.stderr, flush=True)
    for path in old + ([best] if os.path.isdir(best) else []):
        shutil.rmtree(path)


def check_running_model(t: FitOptions, model: nn.Module, batch: Any, loss_fn: LossFn | None) -> None:
    """The checks that run the model (on meta copies) and the layout's warnings. Under a launcher only rank 0 runs
    them: every rank would reach the same verdict, print the same warnings, and pay the meta forward's first use
    (torch imports torch._dynamo for its Python meta kernels: about 1.5 s of CPU per process) — 8 ranks on one
    host, 8 times. The launcher ends the other ranks when rank 0 refuses the run."""
    if loss_fn is not None:  # (a training_step alone: the model is checked when its step runs)
        preflight.check_loss(model, batch, loss_fn, t.precision)  # the model and loss on meta (what fails, on CPU)
    if t.layout.cp > 1:  # attention it can replace, positions it can pass, a sequence that splits, heads
        check_context_parallel(model, t.layout.cp, t.layout.cp_mode, t.layout.tp, batch[0])
    if t.layout.tp > 1:  # the plan, applied to a meta copy, and the split forward, before any rank exists
        # The split forward sees what a rank sees: under cp, its S/cp tokens (sequence parallelism splits those).
        check_plan(model, tp_plan(t.strategy), t.layout.tp, shard_batch(batch[0], t.layout.cp, 0),
                   sequence_parallel=t.layout.sequence_parallel)
    check_devices(t)


def check_groups(t: FitOptions, probe: torch.optim.Optimizer, groups: GroupPlan) -> None:
    """The optimizer runs the same maths on what this strategy gives it as on whole parameters."""
    t.strategy.check_optimizer(probe)
    check_whole(probe, t.strategy.name, splits_parameters(t.layout))
    if t.layout.servers and groups.distinct() > 1:
        raise ValueError(f"strategy {t.strategy.name!r} steps one flat range of every parameter per server, so it "
                         f"cannot give parameter groups different settings ({groups.distinct()} here); use 'ddp', "
                         "'zero1'/'zero2' or 'fsdp', which carry each group onto the pieces of its parameters")


def run_steps(t: FitOptions, max_steps: int | None, data: DataSource, batch_size: int) -> int:
    """The run's optimizer steps: ``max_steps``, or ``max_epochs`` passes of whole global batches (those
    ``limit_train_batches`` keeps), or the fewer."""
    if t.limit_train_batches is not None and data.streaming:
        name = "overfit_batches" if t.overfit_batches is not None else "limit_train_batches"
        raise ValueError(f"{name} needs a map-style dataset (len and index): an iterable dataset is read as one "
                         "stream; bound the run with fit(max_steps=) instead")
    max_epochs, dataset = t.max_epochs, data.dataset
    max_steps = max_steps if max_steps is not None else t.max_steps  # fit's, else Trainer(max_steps=)
    if t.limit_train_batches is not None:
        t.epoch_steps(dataset, batch_size)  # a fraction that keeps no batch is refused here
    if max_steps is None and max_epochs is None:
        raise TypeError("say how long to train: fit(..., max_steps=N) optimizer steps, or Trainer(max_epochs=N) "
                        "passes over the dataset")
    if max_epochs is None:
        return max_steps  # type: ignore[return-value]
    try:
        samples = len(dataset)
    except TypeError:
        raise ValueError(f"Trainer(max_epochs={max_epochs}) needs the dataset's length, and this "
                         f"{type(dataset).__name__} has no __len__: give it one (its samples per pass), or train for "
                         "fit(max_steps=N) optimizer steps") from None
    if samples // batch_size < 1:
        raise ValueError(f"an epoch of {samples} samples holds no whole global batch of batch_size={batch_size}; "
                         "lower batch_size or use more data")
    per_epoch: int = t.epoch_steps(dataset, batch_size)  # type: ignore[assignment]
    return min(max_epochs * per_epoch, max_steps) if max_steps is not None else max_epochs * per_epoch


def check_batchnorm(t: FitOptions, model: nn.Module) -> None:
    """Say once what BatchNorm computes under this layout, or refuse sync_batchnorm where it cannot work."""
    layers = batchnorm_layers(model)
    dp = t.layout.dp
    several = t.layout.batch_shards > 1 and t.layout.processes > 1
    if t.sync_batchnorm and t.layout.processes == 1 and t.devices > 1:
        raise ValueError(f"sync_batchnorm is not supported by strategy {t.strategy.name!r}: one process "
                         "drives every device, so there is no group to synchronise over; use 'ddp'")
    if layers and several and dp > 1 and not t.sync_batchnorm:
        shown = ", ".join(layers[:5]) + (f" and {len(layers) - 5} more" if len(layers) > 5 else "")
        warnings.warn(f"the model has BatchNorm layers ({shown}): under {t.strategy.name!r} each of the "
                      f"{dp} data-parallel ranks normalises with the statistics of its own part of the batch, so "
                      "training differs from one device, and the running statistics are those of rank 0 "
                      "(broadcast after every step). Trainer(sync_batchnorm=True) normalises with the whole "
                      "batch's statistics, equal to single-device training", stacklevel=4)


def plan_memory(t: FitOptions, model: nn.Module, probe: torch.optim.Optimizer, batch_size: int,
                max_steps: int = 0) -> Any:
    """The planner's plan of exactly this run (a :class:`~shardwise.plan.run.RunPlan`), or why it has none (a str).

    The strategy describes its whole layout (sizes, zero stage, HSDP
    replicas, offload, pipeline micro-batches); the run adds precision and
    activation checkpointing. The planner lays the model states out rank by
    rank on a meta copy of the model (exact, see :mod:`shardwise.plan.states`)
    and adds activations and buffers for this batch, and with ``checkpoint_async``
    the host memory a save stages (its last, after ``max_steps``; on a CPU run
    that is the memory the ranks train in).
    """
    from shardwise.plan import NotModelled, plan_run

    layout = t.layout.with_run(t.precision, bool(t.activation_checkpointing))
    memory = t.device_memory or device_memory(t.accelerator, t.layout.processes)
    split = tp_plan(t.strategy)
    try:
        return plan_run(model, layout, memory, batch_size, probe, accumulate_grad_batches=t.accumulate_grad_batches,
                        batch_shards=t.layout.batch_shards, tp_plan=split,
                        split_points=t.strategy.split_points if isinstance(t.strategy, SplitsModel) else None,
                        checkpoint_async=t.checkpoint_async, steps=max_steps, host_is_device=not t.on_cuda)
    except NotModelled as e:
        return str(e)


def check_memory(t: FitOptions, plan: Any) -> None:
    """Whether exactly this run fits, before anything starts (``plan``: :func:`plan_memory`'s). A run the planner
    cannot model is said so in a warning, never silently waved through."""
    if isinstance(plan, str):
        warnings.warn(f"memory check skipped: the planner cannot model this run ({plan}); "
                      "Trainer(memory_check='off') silences this", stacklevel=3)
        return
    if not plan.fits:
        text = f"the planner predicts this run will not fit in device memory: {plan.message()}"
        if t.memory_check == "error":
            raise MemoryError(text + " (Trainer(memory_check='warn') to try anyway)")
        warnings.warn(text, stacklevel=3)
        return
    # A part the planner could not estimate must not pass as zero bytes without a word.
    for note in plan.notes:
        if note.startswith("activations and buffers not estimated"):
            warnings.warn(f"memory check incomplete: {note}; only parameters, gradients and optimizer states "
                          "were checked (Trainer(memory_check='off') silences this)", stacklevel=3)


def model_summary(model: nn.Module, plan: Any) -> str:
    """Lightning's model summary, ours: the model's parameters in total, and per rank under the layout with the
    planner's memory per rank (``plan``: :func:`plan_memory`'s; a str: why there is none)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head = f"shardwise: model {type(model).__name__}: {total:,} parameters ({trainable:,} trainable)"
    if isinstance(plan, str):
        return f"{head}\nshardwise: memory per rank not planned: {plan}"
    low, high = min(plan.params), max(plan.params)
    held = f"{high:,}" if low == high else f"{low:,} to {high:,}"
    return f"{head}; per rank: {held}\nshardwise: planned memory per rank: {plan.summary()}"


def check_devices(t: FitOptions) -> None:
    nprocs = t.layout.processes
    if t.accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("accelerator='cuda' but no CUDA device is available; use accelerator='cpu' "
                         "(or 'auto', which picks CUDA only when present)")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", nprocs)) if launch.under_torchrun() else nprocs
    cuda = t.on_cuda
    if cuda and local > torch.cuda.device_count():
        raise ValueError(f"devices={t.devices} needs {local} CUDA devices on this machine but only "
                         f"{torch.cuda.device_count()} exist; lower devices or add machines (--nnodes)")
    cores = os.cpu_count() or 1
    bound = t.max_processes_per_core
    if not cuda and bound is not None and local > bound * cores:
        raise ValueError(f"devices={t.devices} would start {local} processes on {cores} CPU cores, more than "
                         f"max_processes_per_core={bound} per core: each rank is a whole Python process with its "
                         "own copy of the model, so this many would thrash or exhaust memory; lower devices, or "
                         "pass Trainer(max_processes_per_core=None) to start them anyway")
    if not cuda and local > cores:
        warnings.warn(f"devices={t.devices} starts {local} processes on {cores} CPU cores: ranks will "
                      "share cores, which is correct but slower than fewer ranks", stacklevel=4)


def tp_plan(strategy: Strategy) -> Any:
    # How the strategy will split this model: not part of RunLayout (they describe the model, not the run).
    return strategy.tensor_parallel_plan() if isinstance(strategy, HasTPPlan) else None


def device_memory(accelerator: str, nprocs: int) -> int:
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


def parse_inputs(inputs: Any) -> str | tuple[str, ...] | None:
    """fit's ``inputs`` (dict samples): None, one key, or a list of keys."""
    if inputs is None or isinstance(inputs, str):
        return inputs
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(k, str) for k in inputs):
        return tuple(inputs)
    raise TypeError(f"inputs must be a key of the dict samples, a list of keys, or None, got {inputs!r}")


def check_fit_options(trainer: FitOptions, model: nn.Module, loss_fn: LossFn | None, data: DataSource, batch_size: int,
                      val_dataset: Any, val_every: int | None, val_metrics: dict[str, Any] | None,
                      val_batch_size: int | None, checkpoint_best: Any,
                      training_step: TrainingStep | None = None) -> Validation | None:
    """fit's data, validation and callback options, checked before any process starts; the run's validation."""
    strat = trainer.strategy
    val_data = None if val_dataset is None else DataSource(val_dataset, data.loader, data.inputs)
    val = make_validation(val_data, val_every, val_metrics, val_batch_size, checkpoint_best, batch_size,
                          trainer.checkpoint_dir, strat)
    if val is not None:
        val.limit = trainer.val_batches(val_dataset, val.batch_size)  # (fast_dev_run, limit_val_batches)
    if val is not None and not launch.follower():  # runs the model on meta: rank 0's verdict is every rank's
        check_validation(model, loss_fn, val)  # type: ignore[arg-type]
    for cb in trainer.callbacks:
        if hasattr(cb, "check"):
            cb.check(val.names if val is not None else [])
    x = preflight.first_batch(data, 1)[0]
    if isinstance(x, Kwargs) and isinstance(strat, SplitsModel) and training_step is None:
        raise ValueError(f"strategy {strat.name!r} feeds the model's input through its layers as one tensor, but the "
                         f"dict samples pass keyword inputs ({', '.join(x)}); pass inputs='<key>' (e.g. "
                         "inputs='input_ids') to call the model with that tensor")
    if trainer.layout.processes > 1 and not (dist.is_initialized() or launch.under_torchrun()):
        # Spawned ranks receive these pickled: name the one that is not, with the fix, before anything starts.
        check_picklable(trainer.callbacks)
        named = {"collate_fn": data.loader.collate_fn, "val_dataset": val_dataset, "training_step": training_step,
                 **{f"val_metrics[{k!r}]": f for k, f in (val.metrics.items() if val is not None else [])},
                 **{k: v for k, v in data.loader.extra.items() if callable(v)}}
        launch.require_picklable({f"fit's {k}": v for k, v in named.items()})
    return val


def check_scheduler(factory: SchedulerFactory, probe: torch.optim.Optimizer, strategy: Strategy) -> When:
    """Before any process starts: the factory builds a schedule this strategy can drive (tried on the probe
    optimizer the other checks use); returns when it steps (:mod:`shardwise.fit.schedule`)."""
    if isinstance(strategy, HasServers):
        raise ValueError(f"strategy {strategy.name!r} does not support lr_scheduler: its optimizer runs on the "
                         "server ranks, which take no part in the trainer's steps")
    return unpack(factory(probe))[1]
