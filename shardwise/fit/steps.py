"""The step loop of a training rank: data, forward and backward, clipping, the optimizer step.

:func:`train_loop` is :class:`shardwise.fit.job.Job`'s loop, kept in a module
of its own with the per-step helpers it calls (loss scaling, the non-finite
check, the schedule, the state count and the global losses), so that each
piece of the fit stays small enough to read in one sitting.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from shardwise import precision as precision_mod
from shardwise.comm.topology import Topology
from shardwise.data import DataSource, GlobalBatches, Kwargs, StreamBatches, as_source, leaves
from shardwise.dims import CP, DP
from shardwise.fit import profiler
from shardwise.fit.options import FitOptions
from shardwise.fit.progress import (
    StepLog,
    batch_tokens,
    hyperparameters,
    logged_step,
    progress_bar,
    total_numel,
    want_progress,
)
from shardwise.fit.schedule import Schedule
from shardwise.loggers import FAILED, SUCCESS
from shardwise.loggers.scalars import Reducer, Scalars, recording
from shardwise.loggers.scalars import log as log_scalar
from shardwise.optim.param_groups import apply_hyper
from shardwise.parallel.checkpointing import track_saved_activations
from shardwise.stats import unique_bytes
from shardwise.step import LossFn, StepRun, TrainingStep, after_optimizer_step, iter_chunks
from shardwise.strategies.base import HasServers, Strategy
from shardwise.torch_private import BatchNormBase


class BatchHost(Protocol):
    """What reading a step's batches needs from the run (:class:`~shardwise.fit.job.Job`)."""

    options: FitOptions
    training_step: TrainingStep | None  # fit(training_step=): the step's loss instead of loss_fn
    batch_size: int
    epoch_len: int | None  # optimizer steps an epoch (Trainer(limit_train_batches=) included); None: no length


class StepHost(BatchHost, Protocol):
    """What the loop needs from the run it belongs to (:class:`~shardwise.fit.job.Job`): its options and data,
    and the decision after each step. A protocol, so the loop does not import the job that calls it."""

    dataset: Any
    loss_fn: LossFn
    max_steps: int
    schedule: Schedule | None  # the run's lr schedule (fit(lr_scheduler=)), replayed to where a resumed run stands
    stop_reason: str | None
    activation_bytes: int
    restored_groups: list[dict[str, Any]] | None  # a resumed run's group hyperparameters, set after the schedule
    profile: dict[str, Any] | None  # this rank's profiler figures (Trainer(profiler=)), set by the loop
    info: dict[str, Any]  # the run record of checkpoints (the loggers' hyperparameters come from it)
    restored_loggers: dict[str, dict[str, Any]]  # the checkpoint's logger runs (their run_ref), reopened
    logger_refs: dict[str, dict[str, Any]]  # this run's logger runs, for checkpoints and the result
    hparams: dict[str, Any] | None  # fit(hparams=): the user's hyperparameters, beside the run's own
    step_log: StepLog | None  # rank 0's while open: the loggers that keep artifacts get each complete checkpoint

    def hook(self, name: str, done: int, topo: Topology, **kw: Any) -> None: ...

    def after_step(self, done: int, model: nn.Module, opt: torch.optim.Optimizer,
                   topo: Topology, prev: list[float], losses: list[float], shapes: dict[str, list[int]],
                   scaler: precision_mod.LossScaler | None, log: StepLog | None) -> bool: ...


def train_loop(job: StepHost, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology, prev: list[float],
               shapes: dict[str, list[int]], restored: dict[str, torch.Tensor]
               ) -> tuple[list[float], list[float], dict[str, int]]:
    """The step loop of a training rank from step ``len(prev)``: data, forward/backward, clip, step; after
    each step :meth:`StepHost.after_step` (callbacks, validation, checkpoints) may end it early."""
    t, strat, device = job.options, job.options.strategy, topo.device
    shards, shard = strat.train_shards(topo)
    source = as_source(job.dataset)
    end = len(prev) if job.stop_reason is not None else job.max_steps  # a stopped run stays stopped
    data = train_batches(job, source, shards, shard, start=len(prev), stop=end)
    losses: list[float] = []  # floats, not tensors: a long run must not accumulate tensor objects
    times: list[float] = []
    state_bytes: dict[str, int] = {}
    reducer = Reducer(topo) if t.step_rows and not isinstance(strat, HasServers) else None  # sw.log's values
    prof = profiler.make(t.profiler, t.profile_steps, job.max_steps, topo.stats, device, t.profiler_dir or "",
                         topo.rank)
    # "simple" counts the loss's time as forward's; a training_step (forward and loss in one) is forward's whole.
    loss_fn = job.training_step or prof.loss(job.loss_fn)
    scaler = precision_mod.LossScaler() if t.precision == "16-mixed" else None
    bn_buffers = unsynced_batchnorm_buffers(model) if topo.size(DP) > 1 else []
    # One all-reduce per step where a loss is shown (the options decide: every rank alike); servers join none.
    shows = bool(t.progress or t.loggers) and not isinstance(strat, HasServers)
    sent = dict(topo.stats.by_group)  # bytes sent so far, by group: the step log's comm_bytes are differences
    restore_run_state(job, opt, scaler, restored)
    with contextlib.ExitStack() as logs, \
            progress_bar(topo.rank == 0 and want_progress(t.progress), job.max_steps) as advance, \
            recording(Scalars()) as logged, prof:
        log = logs.enter_context(opened_log(job, topo, shapes, len(prev)))
        row: tuple[Any, ...] | None = None  # the last step row, for a rank that takes the loggers over
        advance.skip(len(prev))
        for step in range(len(prev), end):
            prof.step_start(step)
            logged.clear()  # sw.log's values of this step
            if topo.diag is not None:
                topo.diag.step = step
            job.hook("on_step_start", step, topo, optimizer=opt)
            start = time.perf_counter()
            x, y = step_inputs(job, source, data.batch(step, device))
            run = StepRun(t.precision, scaler.scale if scaler is not None else 1.0)
            prof.mark("data")
            loss = forward_backward(job, model, (x, y), t.accumulate_grad_batches, loss_fn, topo, run,
                                    first=step == len(prev))
            log = log or take_over_log(job, topo, shapes, logs, step, row)  # the logging rank's group died
            prof.compute()
            if job.training_step is not None:  # its dict's other scalars, each its micro-batches' mean: as sw.log's
                log_scalars(job.training_step)
            skip = skipped(t.on_nonfinite, scaler, opt, loss, topo)
            prof.mark("other")
            due = logged_step(step, end - 1, t.log_every_n_steps)  # a logged step's values cost collectives
            norm = None if skip else optimizer_step(job, model, opt, topo, step, measure=reducer is not None and due)
            if not skip and step == job.max_steps - 1:
                # Counted at the high point of a step: gradients and optimizer states both live.
                state_bytes = count_state(strat, model, opt)
            opt.zero_grad(set_to_none=True)
            prof.mark("optimizer")
            lrs = after_update(opt, topo, bn_buffers, job.schedule, step + 1)
            times.append(time.perf_counter() - start)
            local = checked_loss(loss, t.on_nonfinite, step, topo)
            losses.append(0.0 if local is None else local)
            # What the progress line and the step log show: the global loss fit returns, not rank 0's share.
            shown = global_losses(losses[-1:], strat, topo)[0] if shows and (t.progress or due) else local
            advance(shown, times[-1])
            job.hook("on_step_end", step + 1, topo, loss=local, optimizer=opt)  # before the row: its sw.log joins it
            mine = reducer.reduce(logged) if reducer is not None and due else {}
            if due and t.loggers:
                tokens = batch_tokens(token_ids(x, job.training_step is not None)) * shards
                row = (step, shown, times[-1], tokens, {**step_scalars(lrs, norm, t.clip_norm, topo, sent), **mine})
                if log is not None:
                    log.write(*row)
            sent = dict(topo.stats.by_group)
            stop = job.after_step(step + 1, model, opt, topo, prev, losses, shapes, scaler, log)
            prof.step_end(step)
            if stop:
                state_bytes = state_bytes or count_state(strat, model, opt)  # stopped early
                break
    job.profile = prof.figures
    data.close()
    return losses, times, state_bytes


def train_batches(job: BatchHost, source: DataSource, shards: int, shard: int, start: int,
                  stop: int) -> GlobalBatches | StreamBatches:
    """Sample shard ``shard`` of ``shards`` of each global batch of steps ``start .. stop - 1``, in the run's
    order (``Trainer(shuffle=)``, the epoch ``limit_train_batches`` keeps)."""
    t = job.options
    return source.train_batches(job.batch_size, shards, shard, seed=t.seed, start=start, stop=stop,
                                shuffle=t.shuffle, epoch=job.epoch_len)


def step_inputs(job: BatchHost, source: DataSource, batch: Any) -> tuple[Any, Any]:
    """A read batch as the step takes it: (input, target), cast to the run's precision."""
    # A training_step takes the whole batch: it comes as the target, beside itself as the input.
    x, y = precision_mod.cast_batch(job.options.precision, (batch, batch) if job.training_step else source.split(batch))
    return x, y


def micro_batches(x: Any, y: Any, k: int) -> list[tuple[Any, Any]]:
    """``(input, target)`` of each of the ``k`` micro-batches of ``accumulate_grad_batches``."""
    return list(zip(iter_chunks(x, k), iter_chunks(y, k)))


def log_scalars(training_step: TrainingStep) -> None:
    """A training_step's other scalars of this step (its dict's, each its micro-batches' mean), as ``sw.log``'s."""
    for name, value in training_step.take().items():
        log_scalar(name, value)


def skipped(on_nonfinite: str, scaler: precision_mod.LossScaler | None, opt: torch.optim.Optimizer,
            loss: torch.Tensor | None, topo: Topology) -> bool:
    """Whether every rank skips this step's update: an fp16 overflow, or a non-finite loss with
    ``on_nonfinite="skip"``. Both checks agree across ranks, so every rank skips the same steps. In "error" mode
    the loss is checked after the step instead (:func:`checked_loss`): reading it here would stop the host until
    the backward ends, and the GPU would then idle while the optimizer's kernels are launched."""
    return (scaler is not None and overflow(scaler, opt, topo)) or \
        (on_nonfinite == "skip" and not finite(loss, topo))


def after_update(opt: torch.optim.Optimizer, topo: Topology, bn_buffers: list[torch.Tensor],
                 schedule: Schedule | None, done: int) -> dict[int, float]:
    """After optimizer step ``done``: rank 0's BatchNorm running statistics are every replica's (as torch DDP's),
    and the schedule, when due, sets the next step's lrs; on CUDA the host waits for the step's kernels (the
    step's time is theirs). Returns the lrs this step used."""
    for b in bn_buffers:
        topo.comm(DP).broadcast(b, src=0, name="batchnorm.buffers")
    lrs = learning_rates(opt)  # the step's own, before the schedule sets the next step's
    if schedule is not None:
        schedule.stepped(done)
    if topo.device.type == "cuda":
        torch.cuda.synchronize(topo.device)
    return lrs


def checked_loss(loss: torch.Tensor | None, on_nonfinite: str, step: int, topo: Topology) -> float | None:
    """This rank's loss of the step as a float (None where it owns none); with ``on_nonfinite="error"`` a NaN or
    inf stops the run (:func:`raise_if_nonfinite`)."""
    local = float(loss) if loss is not None else None
    if on_nonfinite == "error":
        raise_if_nonfinite(local, step, topo)
    return local


def restore_run_state(job: StepHost, opt: torch.optim.Optimizer, scaler: precision_mod.LossScaler | None,
                      restored: dict[str, torch.Tensor]) -> None:
    """A resumed run's optimizer groups and fp16 scaler as its checkpoint kept them."""
    if job.restored_groups:  # after the schedule's replay: an lr a callback changed too is the saved run's
        apply_hyper(opt, job.restored_groups)
    if scaler is not None and "scaler" in restored:
        scaler.load_tensor(restored["scaler"])  # the scale and clean-step count the checkpoint's run had


def forward_backward(job: StepHost, model: nn.Module, batch: tuple[Any, Any], k: int, loss_fn: LossFn,
                     topo: Topology, run: StepRun, first: bool) -> torch.Tensor | None:
    """The strategy's forward and backward of this rank's ``batch`` in ``k`` micro-batches; returns this rank's
    loss. On the ``first`` step of the run it also measures the peak bytes autograd holds for backward
    (activations; the parameters and the batch excluded): ``FitResult.stats["activation_bytes"]``."""
    strat, (x, y) = job.options.strategy, batch
    micro = micro_batches(x, y, k)
    if not first:
        return strat.train_step(model, micro, loss_fn, topo, run)
    with track_saved_activations(model.parameters(), leaves(x) + leaves(y)) as saved:
        loss = strat.train_step(model, micro, loss_fn, topo, run)
    job.activation_bytes = saved.peak
    return loss


def optimizer_step(job: StepHost, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology,
                   step: int, measure: bool = False) -> float | None:
    """The callbacks' look at the global gradients (with callbacks), the clip (by norm or by value), and the
    optimizer's step; returns the global gradient norm before clipping, measured when clipping by norm or when
    ``measure`` (a logged step), else None."""
    t, norm = job.options, None
    if t.callbacks:  # the gradients a callback reads are the global ones: reduce what is pending
        finish_gradients(opt)
        job.hook("on_before_optimizer_step", step, topo, optimizer=opt)
    by_norm = t.gradient_clip_val is not None and t.gradient_clip_algorithm == "norm"
    if by_norm or measure:
        # Without a clip by norm the bound is infinite: the gradients are scaled by exactly 1, the norm measured.
        norm = float(t.strategy.clip_grad_norm(model, t.gradient_clip_val if by_norm else math.inf, topo))  # type: ignore[arg-type]
    if t.gradient_clip_val is not None and not by_norm:
        t.strategy.clip_grad_value(model, opt, t.gradient_clip_val, topo)
    opt.step()
    after_optimizer_step(model)  # e.g. MoE routers' bias update, with the step's global loads
    return norm


def take_over_log(job: StepHost, topo: Topology, shapes: dict[str, list[int]], logs: contextlib.ExitStack,
                  step: int, row: tuple[Any, ...] | None) -> StepLog | None:
    """The loggers opened on this rank if it became the logging rank when the previous one's replica group died
    (fault tolerance): as a resumed run from its own last step row, written again (the dead rank may have died
    before it wrote that row). None where this rank does not log."""
    if not job.options.loggers or not job.options.strategy.logs_here(topo):
        return None
    log = logs.enter_context(opened_log(job, topo, shapes, row[0] if row is not None else step))
    if log is not None and row is not None:
        log.write(*row)
    return log


@contextlib.contextmanager
def opened_log(job: StepHost, topo: Topology, shapes: dict[str, list[int]], start: int) -> Iterator[StepLog | None]:
    """The logging rank's step log over the run's loggers (None elsewhere, or without loggers; see
    :meth:`Strategy.logs_here`), their runs opened (a resumed run's reopened) and finalized: ``"success"``, or
    ``"failed"`` when an exception ends the loop. Where the runs are goes to ``job.logger_refs``, for
    checkpoints and the result."""
    t = job.options
    if not t.strategy.logs_here(topo) or not t.loggers:
        yield None
        return
    log = StepLog(t.loggers, t.peak_flops, total_numel(shapes), topo.world_size,
                  start=start, refs=job.restored_loggers,
                  hyper={**hyperparameters(t, job.info, job.max_steps), **(job.hparams or {})},
                  samples=job.batch_size, device=topo.device)
    job.logger_refs, job.step_log = log.refs(), log
    try:
        yield log
    except BaseException:
        job.step_log = None
        log.close(FAILED)
        raise
    job.step_log = None
    log.close(SUCCESS)


def learning_rates(opt: torch.optim.Optimizer) -> dict[int, float]:
    """Each parameter group's lr, by group index (a group without one is left out)."""
    return {i: float(g["lr"]) for i, g in enumerate(opt.param_groups) if "lr" in g}


def step_scalars(lrs: dict[int, float], norm: float | None, max_norm: float | None, topo: Topology,
                 before: dict[str, int]) -> dict[str, Any]:
    """The step log's scalars beside the loss: each group's lr the step used (``lrs``), the global gradient norm
    before clipping, whether a clip by norm applied (``max_norm``), and the bytes this rank sent in the step by
    group."""
    row: dict[str, Any] = {f"lr/{i}": lr for i, lr in lrs.items()}
    if norm is not None:
        row["grad_norm"] = norm
    if norm is not None and max_norm is not None:
        row["clipped"] = norm > max_norm
    row.update({f"comm_bytes/{k}": v - before.get(k, 0) for k, v in topo.stats.by_group.items()})
    return row


def token_ids(x: Any, whole: bool) -> Any:
    """What tokens/s counts: the model's input, its ``input_ids`` for keyword inputs; a training_step's whole
    batch (``whole``): its first item, or its ``input_ids``."""
    if whole and isinstance(x, (tuple, list)) and x:
        return x[0]
    return x.get("input_ids") if isinstance(x, Kwargs) or (whole and isinstance(x, dict)) else x


def finish_gradients(opt: torch.optim.Optimizer) -> None:
    """Complete the gradient reduction a sharded optimizer would start at its step (ZeRO-1 reduces there);
    done again by the step, at no cost."""
    owner = getattr(opt, "owner", None)
    if owner is not None:
        owner.before_step()


def unsynced_batchnorm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The running statistics of BatchNorm layers that normalise with their own rank's batch."""
    return [b for m in model.modules() if isinstance(m, BatchNormBase) for b in m.buffers()]


def overflow(scaler: precision_mod.LossScaler, opt: torch.optim.Optimizer, topo: Topology) -> bool:
    """Unscale fp16 gradients; every rank learns whether any rank overflowed (one flag all-reduce)."""
    flag = scaler.unscale_flag(opt).to(topo.device)
    topo.comm("world").all_reduce(flag, name="metrics.overflow")
    found = float(flag) > 0
    scaler.update(found)
    return found


def raise_if_nonfinite(local: float | None, step: int, topo: Topology) -> None:
    """``on_nonfinite="error"``: stop on a NaN/inf local loss, naming the step and the rank. Called after the
    step, on the value the loop reads anyway; the run ends here, so the step it took is never seen (no
    checkpoint, callback or result follows it)."""
    if local is not None and not math.isfinite(local):
        raise FloatingPointError(f"non-finite loss {local:g} at step {step} on rank {topo.rank}; "
                                 "pass Trainer(on_nonfinite='skip') to skip such steps instead")


def finite(loss: torch.Tensor | None, topo: Topology) -> bool:
    """``on_nonfinite="skip"``: whether to take this step. Every rank must agree (a rank that steps alone
    would desynchronise the replicas), hence one all-reduce of a flag, before the optimizer step."""
    bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
    flag = torch.tensor([1.0 if bad else 0.0], device=topo.device)
    topo.comm("world").all_reduce(flag, name="metrics.nonfinite")
    return float(flag) == 0.0


def count_state(strat: Strategy, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    return {kind: unique_bytes(ts) for kind, ts in strat.state_tensors(model, opt).items()}


def global_losses(losses: list[float], strat: Strategy, topo: Topology) -> list[float]:
    """Mean over data-parallel replicas of each step's loss, known on every rank.

    One all-reduce over the world (at the end for the result; per step only where a progress line or step
    log shows the loss): ranks that do not own a loss (non-last pipeline stages, tp ranks > 0) contribute zero.
    """
    if not losses:
        return []
    t = torch.tensor(losses, dtype=torch.float64, device=topo.device)
    shards, _ = strat.data_parallel(topo)
    shards *= topo.size(CP)  # every cp rank owns the loss of its tokens (equal counts: the mean of means)
    t = t / shards if strat.owns_loss(topo) else torch.zeros_like(t)  # server ranks own no loss
    topo.comm("world").all_reduce(t, name="metrics.losses")
    return [float(v) for v in t.cpu()]
