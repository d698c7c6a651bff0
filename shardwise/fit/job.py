"""One fit on one rank: a :class:`Job` is what every rank needs to train, pickled into spawned ranks.

:meth:`Job.run` builds the topology, applies the strategy, resumes, runs the
step loop (:func:`shardwise.fit.steps.train_loop`) or a server's part, and
gathers the result and every rank's stats; after each step
:meth:`Job.after_step` runs callbacks, validation and checkpoints.
"""
from __future__ import annotations

import os
import pickle
import statistics
import sys
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise import launch
from shardwise import precision as precision_mod
from shardwise.checkpoint import store as checkpoint
from shardwise.checkpoint.background import Finished, Saver
from shardwise.comm.topology import Topology
from shardwise.fit import profiler
from shardwise.fit.callbacks import CallbackInfo, Control, agree_stop, call, call_on_exception, load_states
from shardwise.fit.callbacks import states as callback_states
from shardwise.fit.evaluate import (
    Validation,
    evaluate,
    history_from,
    history_tensors,
    save_best,
    top_steps,
)
from shardwise.fit.options import RESUME_MODES, FitOptions
from shardwise.fit.progress import StepLog, want_progress
from shardwise.fit.schedule import Schedule, SchedulerFactory
from shardwise.fit.steps import count_state, global_losses, train_loop
from shardwise.init_from import InitFrom, read_into
from shardwise.loggers.scalars import Reducer, Scalars, recording
from shardwise.optim.param_groups import GroupPlan
from shardwise.parallel.compiling import compile_report, recompile_warning
from shardwise.recipe import Built, Recipe, prepare_rank
from shardwise.seeding import deterministic, seed_everything
from shardwise.stats import (
    cuda_peak_bytes,
    peak_rss_bytes,
    release_free_heap,
    reset_cuda_peak,
    reset_peak_rss,
)
from shardwise.step import LossFn, OptimizerFactory, StepRun, TrainingStep
from shardwise.strategies.base import HasServers, compile_backend


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` returns (public: its fields are what users read)."""

    losses: list[float]
    state_dict: dict[str, torch.Tensor]
    stats: list[dict[str, Any]] = field(default_factory=list)
    # One entry per validation: {"step": optimizer steps done, "val_loss": ..., <each val_metrics name>: ...}.
    val_metrics: list[dict[str, float]] = field(default_factory=list)
    # Trainer(profiler=): each rank's figures (shardwise.fit.profiler), by rank; empty without a profiler.
    profile: list[dict[str, Any] | None] = field(default_factory=list)
    # Where each logger's run is, by logger key (shardwise.loggers.keys): {"mlflow": {"run_id": ..., ...},
    # "wandb": {"run_id": ..., "dir": ...}, "csv": {"path": ...}, ...}; rank 0's (the rank that writes).
    loggers: dict[str, dict[str, Any]] = field(default_factory=dict)


def spawned_fit(rank: int, device: torch.device, job: bytes, path: str) -> None:
    reset_peak_rss()  # peak_rss_bytes is this run's, also on a process that ran jobs before (WorkerPool)
    result = pickle.loads(job).run(device)
    if rank == 0:
        torch.save({f.name: getattr(result, f.name) for f in fields(result)}, path)


def pickled(job: Job) -> bytes:
    """The job for the rank processes (:func:`shardwise.launch.pickled_for_ranks`): what cannot be pickled is
    named, with the fix, instead of a bare PicklingError."""
    args = {"optimizer_fn": "optimizer"}
    return launch.pickled_for_ranks(job, lambda: {
        **{f"fit's {args.get(k, k)}": getattr(job, k)
           for k in ("loss_fn", "optimizer_fn", "lr_scheduler", "model", "dataset", "training_step")},
        **{f"logger {type(lg).__name__}": lg for lg in job.options.loggers}})


@dataclass
class Job:
    """Everything one rank needs to train; pickled into spawned workers."""

    options: FitOptions
    model: nn.Module
    dataset: Any
    loss_fn: LossFn | None
    optimizer_fn: OptimizerFactory
    batch_size: int
    max_steps: int
    info: dict[str, Any]  # what checkpoints record about the run (checkpoint.run_info)
    lr_scheduler: SchedulerFactory | None = None
    validation: Validation | None = None
    groups: GroupPlan | None = None  # the optimizer's parameter groups on the unsplit model
    training_step: TrainingStep | None = None  # fit(training_step=): the step's loss (loss_fn then validates)
    init: InitFrom | None = None  # fit(init_from=): pretrained weights read into the shards (unless resumed)
    return_state_dict: bool = True  # False: no full state dict is gathered at the end
    # The ranks were started for this fit and only rank 0's result goes back (spawned_fit): only it gathers the
    # full state dict. Where every rank called fit (shardwise run), each one's model ends trained: each gathers.
    result_from_rank0: bool = False
    # Under fault tolerance a rank's topology is its replica group's alone (shardwise.fit.replicas): its rank is
    # still its launch rank, for callbacks and so that rank 0 alone prints and logs.
    launch_rank: int | None = None
    hparams: dict[str, Any] | None = None  # fit(hparams=): the user's, logged beside the run's own

    def run(self, device: torch.device) -> FitResult:
        t = self.options
        hf_output_capture(self.model)
        topo = Topology.create(device, t.layout.dims, timeout=t.timeout, debug=t.debug)
        if self.launch_rank is not None:
            topo.rank = self.launch_rank
        self.steps_done = 0
        self.saver: Saver | None = None
        self.prepared: nn.Module | None = None  # the strategy's model, for the callbacks (info.model)
        self.history: list[dict[str, float]] = []  # (set again on resume; here for a failure before it)
        self.control = Control()
        try:
            return self._run(topo)
        except BaseException as e:
            if t.callbacks:
                call_on_exception(t.callbacks, self._info(self.steps_done, topo, exception=e))
            raise
        finally:
            if self.saver is not None:
                self.saver.close()  # SIGTERM's own handler back, also after a failure
            topo.close()

    def _run(self, topo: Topology) -> FitResult:
        t, strat = self.options, self.options.strategy
        seed_everything(t.seed)  # Python, numpy and torch: a dataset's augmentations repeat run to run
        if t.deterministic:
            deterministic()
        if t.benchmark is not None:  # (Lightning's benchmark=: cuDNN times its algorithms for each new shape)
            torch.backends.cudnn.benchmark = t.benchmark
        reset_cuda_peak(topo.device)  # cuda_peak_*_bytes are this run's (a no-op on CPU)
        built = self.build(topo)
        model, opt, shapes = built.model, built.optimizer, built.shapes
        self.prepared = model
        # Built on every rank at this point: a save in the background creates its own group here (a collective).
        self.saver = Saver(topo, t.checkpoint_async) if t.checkpoint_dir is not None else None
        prev, extra, path = self._resume(model, opt, topo, shapes)
        self._read_pretrained(path, model, opt, topo, shapes)
        self.history = history_from(extra)  # validations of the run so far (a resumed run's included)
        self.steps_done = len(prev)
        self.profile: dict[str, Any] | None = None  # set by the loop; a server's part is not profiled
        self.hook("on_fit_start", len(prev), topo, optimizer=opt)
        self.epoch_len = t.epoch_steps(self.dataset, self.batch_size)
        self.schedule = Schedule(self.lr_scheduler, opt, self.epoch_len) if self.lr_scheduler is not None else None
        if self.schedule is not None:
            self.schedule.restore(len(prev), self.history)
        self._epoch_edge(len(prev), topo, end=False)
        sent, received = topo.stats.sent, topo.stats.received  # after the setup: the steps' traffic follows
        with torch.autograd.set_detect_anomaly(t.detect_anomaly):
            losses, times, state_bytes = self._steps(model, opt, topo, prev, shapes, extra)
        self._saves_finished(topo)  # the end of the fit waits for a save in flight
        steps_run = max(1, len(losses))
        traffic = ((topo.stats.sent - sent) / steps_run, (topo.stats.received - received) / steps_run)
        all_losses = prev + global_losses(losses, strat, topo)
        state_dict = {} if not self.return_state_dict else strat.final_state_dict(model, topo) \
            if self.result_from_rank0 else strat.full_state_dict(model, topo)
        release_free_heap()  # what the steps (and a gather) freed goes back to the system: the rank holds its shards
        mine = self._rank_stats(model, topo, state_bytes, state_dict, times, traffic)
        if self.compiled and topo.rank == 0 and (storm := recompile_warning(mine)):
            print(storm, file=sys.stderr, flush=True)
        stats = topo.comm("world").all_gather_object(mine, name="stats")
        profile = [s.pop("profile") for s in stats]
        if topo.rank == 0 and t.profiler == "simple" and any(profile):
            print(profiler.table(profile), file=sys.stderr, flush=True)
        result = FitResult(losses=all_losses, state_dict=state_dict, stats=stats, val_metrics=list(self.history),
                           profile=profile if any(profile) else [], loggers=dict(self.logger_refs))
        call(t.callbacks, "on_fit_end", CallbackInfo(len(all_losses), self.max_steps, topo.rank, topo.world_size,
                                                     history=list(self.history), losses=list(all_losses),
                                                     stop_reason=self.stop_reason, control=self.control))
        return result

    def build(self, topo: Topology) -> Built:
        """This rank's model and optimizer, by the one recipe (:func:`shardwise.recipe.prepare_rank`) with the
        run's options; the model given is replaced by its unsplit root (sync BatchNorm may replace it)."""
        t = self.options
        backend = compile_backend(t.strategy, t.compile)
        self.compiled = backend is not None
        recipe = Recipe(precision=t.precision, sync_batchnorm=t.sync_batchnorm,
                        activation_checkpointing=t.activation_checkpointing, compile=backend, fresh_compile=True,
                        init=self.init)
        built = prepare_rank(self.model, t.strategy, topo, recipe, self.optimizer_fn, self.groups)
        self.model, self.aliases = built.bare, built.aliases
        return built

    def _resume(self, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology, shapes: dict[str, list[int]]
                ) -> tuple[list[float], dict[str, torch.Tensor], str | None]:
        """With ``checkpoint_dir`` and ``resume``: the newest intact checkpoint restored into ``model`` and
        ``opt`` (and the callbacks), and said on rank 0. Returns its losses, the run state it kept beside the
        model, and its path (None: nothing resumed)."""
        t = self.options
        self.restored_groups: list[dict[str, Any]] | None = None
        self.restored_loggers: dict[str, dict[str, Any]] = {}  # the checkpoint's logger runs, reopened on resume
        self.logger_refs: dict[str, dict[str, Any]] = {}  # this run's, set by the step log on rank 0
        self.step_log: StepLog | None = None  # rank 0's, while it is open: complete checkpoints go to it
        self.control, self.stop_reason = Control(), None
        prev: list[float] = []
        extra: dict[str, torch.Tensor] = {}
        if t.resume == "never" or (t.checkpoint_dir is None and t.resume in RESUME_MODES):
            return prev, extra, None
        # resume=<a checkpoint>: the one Trainer() chose, the same on every rank.
        path = checkpoint.resume_point(t.checkpoint_dir, topo) if t.resume in RESUME_MODES else t.resume  # type: ignore[arg-type]
        if path is not None:
            restored = checkpoint.load(path, t.strategy, model, opt, topo, shapes, self.info)
            prev, extra = restored.losses[:self.max_steps], restored.extra
            self.restored_groups, self.restored_loggers = restored.groups, restored.loggers
            load_states(t.callbacks, restored.callbacks)
        if "stopped" in extra:  # a run that stopped early is complete: rerunning it returns its result
            self.stop_reason = f"stopped early at step {len(prev)} (by a callback; the checkpoint's run)"
        if topo.rank == 0:  # resuming is the default: say what it does, also when there is nothing to do
            line = resume_line(path, len(prev), self.max_steps) if self.stop_reason is None else \
                f"shardwise: already complete: {path} {self.stop_reason.partition(' (')[0]}, 0 steps to run"
            print(line, file=sys.stderr, flush=True)
        return prev, extra, path

    def _steps(self, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology, prev: list[float],
               shapes: dict[str, list[int]], extra: dict[str, torch.Tensor]
               ) -> tuple[list[float], list[float], dict[str, int]]:
        """This rank's part of the steps: the step loop, or a parameter server's serving loop. Returns the
        losses of the steps run, their times and the bytes of the model state this rank holds."""
        strat = self.options.strategy
        if not (isinstance(strat, HasServers) and strat.is_server(topo)):
            return train_loop(self, model, opt, topo, prev, shapes, extra)  # type: ignore[arg-type]
        times = self._serve(strat, model, opt, topo, prev, shapes)
        losses = [0.0] * (self.max_steps - len(prev))  # a server owns no loss: zeros in the all-reduce
        return losses, times, count_state(strat, model, opt)

    def _rank_stats(self, model: nn.Module, topo: Topology, state_bytes: dict[str, int],
                    state_dict: dict[str, torch.Tensor], times: list[float],
                    traffic: tuple[float, float]) -> dict[str, Any]:
        """This rank's entry of ``FitResult.stats`` (``traffic``: bytes sent and received per step run)."""
        strat = self.options.strategy
        return {
            "rank": topo.rank,
            "peak_rss_bytes": peak_rss_bytes(),
            **cuda_peak_bytes(topo.device),  # cuda_peak_allocated_bytes, cuda_peak_reserved_bytes (CUDA only)
            "model_state_bytes": sum(state_bytes.values()),
            # The full state dict this rank holds for fit's result: the whole model on rank 0, nothing elsewhere.
            "state_dict_bytes": sum(v.numel() * v.element_size() for v in state_dict.values()),
            **{f"{k}_bytes": v for k, v in state_bytes.items()},
            "comm_bytes": topo.stats.sent,
            # False under engine="torch": the comm_* figures then count only the Trainer's own collectives.
            "comm_counted": strat.comm_counted,
            "comm_bytes_per_step": traffic[0],
            "comm_received_bytes_per_step": traffic[1],
            "comm_by_name": dict(topo.stats.by_name),
            "comm_by_group": dict(topo.stats.by_group),
            "counters": dict(topo.stats.counters),  # e.g. tokens an expert layer dispatched and dropped
            # The first step pays one-off costs (allocations, lazy initialisation): left out when there are more.
            "step_time_s": statistics.median(times[1:] if len(times) > 1 else times) if times else 0.0,
            "activation_bytes": getattr(self, "activation_bytes", 0),
            # The sum of every buffer this rank holds (running statistics...): equal on replicas.
            "buffers_sum": float(sum(float(b.double().sum()) for b in model.buffers()
                                     if b.is_floating_point() and b.device.type != "meta")),  # (ps servers: meta)
            **strat.rank_stats(model, topo),
            "profile": self.profile,  # (gathered with the stats, then kept apart in FitResult.profile)
            **(self.saver.stats() if self.saver is not None else {}),
            **(compile_report() if self.compiled else {}),
        }

    def _read_pretrained(self, resumed: str | None, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology,
                      shapes: dict[str, list[int]]) -> None:
        """``init_from``'s weights into this rank's shards, unless a checkpoint was resumed: it holds the run's
        own weights, which win (and the message says so)."""
        if self.init is None:
            return
        if resumed is None:
            read_into(self.init, self.options.strategy, model, opt, topo, shapes, self.aliases)
        elif topo.rank == 0:
            print(f"shardwise: init_from={self.init.path} is not read: the run resumes from {resumed}, whose "
                  "weights are this run's own", file=sys.stderr, flush=True)

    def _serve(self, strat: HasServers, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology,
               prev: list[float], shapes: dict[str, list[int]]) -> list[float]:
        """A server rank's part from step ``len(prev)`` (a resumed run starts at its checkpoint's step).

        It serves up to each step at which the workers save (every
        ``checkpoint_every`` steps and after the last), then saves with them:
        the same :func:`checkpoint.save` call and, before it, the same loss
        all-reduce, to which a server contributes zeros. Returns the per-step times.
        """
        t = self.options
        times: list[float] = []
        done = len(prev)
        while done < self.max_steps:
            stop = self.max_steps
            if t.checkpoint_dir is not None and t.checkpoint_every is not None:
                stop = min(stop, (done // t.checkpoint_every + 1) * t.checkpoint_every)
            times += strat.serve(model, opt, topo, stop - done)
            done = stop
            if t.checkpoint_dir is not None:
                self._periodic(done, prev, [0.0] * (done - len(prev)), model, opt, topo, shapes, None, "periodic")
        return times

    def _pending(self, done: int, prev: list[float], losses: list[float], model: nn.Module,
                 opt: torch.optim.Optimizer, topo: Topology, shapes: dict[str, list[int]],
                 extra: dict[str, torch.Tensor] | None, directory: str | None = None,
                 run: dict[str, Any] | None = None) -> checkpoint.Pending:
        """The checkpoint after ``done`` steps, on every rank: this run's ``losses`` made global (an all-reduce in
        which servers add zeros) follow the restored ``prev``. ``directory`` (the best checkpoint's) and ``run``
        replace the checkpoint directory and the run record."""
        t = self.options
        so_far = prev + global_losses(losses, t.strategy, topo)
        return checkpoint.prepare(
            directory or t.checkpoint_dir,  # type: ignore[arg-type]
            done,
            so_far,
            t.strategy,
            model,
            opt,
            topo,
            shapes,
            keep=t.checkpoint_keep if directory is None else None,
            aliases=self.aliases,
            run=run or self.info,
            extra=extra,
            callbacks=callback_states(t.callbacks),
            loggers=self.logger_refs,
        )

    def _periodic(self, done: int, prev: list[float], losses: list[float], model: nn.Module,
                  opt: torch.optim.Optimizer, topo: Topology, shapes: dict[str, list[int]],
                  extra: dict[str, torch.Tensor] | None, kind: str) -> None:
        """A periodic or final checkpoint through the run's :class:`Saver` (in the background with
        ``checkpoint_async``); ``on_checkpoint_saved`` follows each save once it is complete."""
        assert self.saver is not None
        self._report(self.saver.save(self._pending(done, prev, losses, model, opt, topo, shapes, extra), kind), topo)

    def _saves_finished(self, topo: Topology) -> None:
        """Wait for a save in flight (its ``on_checkpoint_saved`` follows) and give SIGTERM its handler back."""
        if self.saver is not None:
            self._report(self.saver.finish(), topo)
            self.saver.close()

    def _report(self, finished: list[Finished], topo: Topology) -> None:
        for f in finished:
            if self.step_log is not None:
                self.step_log.checkpoint(f.path, f.step)
            self.hook("on_checkpoint_saved", f.step, topo, path=f.path, kind=f.kind)

    def after_step(self, done: int, model: nn.Module, opt: torch.optim.Optimizer,
                   topo: Topology, prev: list[float], losses: list[float], shapes: dict[str, list[int]],
                   scaler: precision_mod.LossScaler | None, log: StepLog | None) -> bool:
        """After ``done`` optimizer steps (the loop already called ``on_step_end`` and wrote the step's row, so
        that what a callback logs there joins it), on every training rank: validation when due, the agreement on
        a stop any callback asked for (with callbacks only: one flag all-reduce), then the periodic checkpoint,
        or the final one of a run that stops here. Returns whether the run stops."""
        t = self.options
        self.steps_done = done
        if self.saver is not None:
            self.saver.step_ended()
        validated = self.validation is not None and self.validation.due(done, self.max_steps)
        if validated:
            self._validate_now(done, model, opt, topo, prev, losses, shapes, scaler, log)
        stop = agree_stop(self.control, t.strategy, topo) if t.callbacks and done < self.max_steps else None
        if stop is not None and self.validation is not None and not validated:
            self._validate_now(done, model, opt, topo, prev, losses, shapes, scaler, log)  # the run's last step
        if t.checkpoint_dir is not None and (done == self.max_steps or stop is not None or (
                t.checkpoint_every is not None and done % t.checkpoint_every == 0)):
            self._periodic(done, prev, losses, model, opt, topo, shapes, self._extra(scaler, done, stop),
                           "final" if stop is not None else "periodic")
        if stop is not None:
            self.stop_reason = stop
            if topo.rank == 0 and want_progress(t.progress):
                print(f"shardwise: stopping after step {done}/{self.max_steps}: {stop}", file=sys.stderr, flush=True)
        if self.saver is not None:
            self.saver.step_starts()
        self._epoch_edge(done, topo, end=True)
        if stop is None and done < self.max_steps:
            self._epoch_edge(done, topo, end=False)
        return stop is not None

    def _epoch_edge(self, done: int, topo: Topology, end: bool) -> None:
        """``on_train_epoch_end`` (``end``) or ``on_train_epoch_start`` when ``done`` steps is an epoch's edge."""
        if self.epoch_len and done % self.epoch_len == 0:
            epoch = done // self.epoch_len
            self.hook("on_train_epoch_end" if end else "on_train_epoch_start", done, topo,
                      epoch=epoch - 1 if end else epoch)

    def hook(self, name: str, done: int, topo: Topology, **kw: Any) -> None:
        """Call ``name`` on every callback that has it, after ``done`` steps (``kw``: the info's other fields)."""
        if self.options.callbacks:
            call(self.options.callbacks, name, self._info(done, topo, **kw))

    def _info(self, done: int, topo: Topology, **kw: Any) -> CallbackInfo:
        return CallbackInfo(done, self.max_steps, topo.rank, topo.world_size, history=list(self.history),
                            control=self.control, model=self.prepared, **kw)

    def _validate_now(self, done: int, model: nn.Module, opt: torch.optim.Optimizer, topo: Topology,
                      prev: list[float], losses: list[float], shapes: dict[str, list[int]],
                      scaler: precision_mod.LossScaler | None, log: StepLog | None) -> None:
        """Evaluate (:func:`shardwise.fit.evaluate.evaluate`), record and show the metrics, tell the callbacks, and
        save ``<checkpoint_dir>/best`` when this validation is the best so far."""
        t, val = self.options, self.validation
        assert val is not None
        with recording(Scalars()) as logged:  # sw.log during validation: the row's val/<name>
            metrics = evaluate(model, t.strategy, val, self.loss_fn, topo, StepRun(t.precision), seed=t.seed)  # type: ignore[arg-type]
        mine = Reducer(topo).reduce(logged) if t.step_rows else {}
        if self.schedule is not None and self.schedule.monitor is not None:  # ReduceLROnPlateau: before any save
            metrics[self.schedule.monitor] = agreed(metrics[self.schedule.monitor], topo)
            self.schedule.validated(metrics[self.schedule.monitor])
        self.history.append({"step": done, **metrics})
        if log is not None:  # the row of the step whose weights were evaluated
            log.write_validation(done - 1, {**metrics, **{f"val/{k}": v for k, v in mine.items()}})
        if topo.rank == 0 and want_progress(t.progress):
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            print(f"shardwise: validation after step {done}/{self.max_steps}: {shown}", file=sys.stderr, flush=True)
        self.hook("on_validation_end", done, topo, metrics=dict(metrics))
        self.hook("on_validation_epoch_end", done, topo, metrics=dict(metrics))  # (Lightning's name)
        keep = top_steps(self.history, val.best, val.best_k) if val.best is not None else []
        if done in keep:
            name, mode = val.best  # type: ignore[misc]
            run = {**self.info, "best": {"metric": name, "mode": mode, "value": metrics[name]}}
            path = save_best(
                t.checkpoint_dir,  # type: ignore[arg-type]
                lambda d: checkpoint.write(
                    self._pending(
                        done,
                        prev,
                        losses,
                        model,
                        opt,
                        topo,
                        shapes,
                        self._extra(scaler, done, None),
                        directory=d,
                        run=run,
                    ),
                    topo.comm("world"),
                ),
                topo,
                keep,
            )
            self.hook("on_checkpoint_saved", done, topo, path=path, kind="best")

    def _extra(self, scaler: precision_mod.LossScaler | None, done: int,
               stop: str | None) -> dict[str, torch.Tensor] | None:
        """Run state a checkpoint keeps beside the model: the fp16 scaler, the validation history, whether the
        run stopped early (then a resume finds it complete)."""
        extra = {"scaler": scaler.as_tensor()} if scaler is not None else {}
        extra.update(history_tensors(self.history))
        if stop is not None:
            extra["stopped"] = torch.tensor([done], dtype=torch.int64)
        return extra or None


def hf_output_capture(model: nn.Module) -> None:
    """Let a Hugging Face model unpickled in a rank process record its outputs again (``router_logits``,
    ``hidden_states``): transformers 5 fills a registry of the classes that record them in the model's
    ``__init__``, which an unpickled model never ran, so those outputs came back None in spawned ranks."""
    theirs = [m for m in model.modules() if type(m).__module__.startswith("transformers.")
              and getattr(m, "_can_record_outputs", None)]
    if not theirs:
        return
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # an older transformers: no registry, nothing lost in pickling
        return
    for m in theirs:
        _CAN_RECORD_REGISTRY[m] = m._can_record_outputs  # type: ignore[assignment,index]


def agreed(value: float, topo: Topology) -> float:
    """Rank 0's ``value`` on every rank (one float64 broadcast): a decision taken on it, such as
    ReduceLROnPlateau's, is the same on every rank even where a reduction's last bits could differ."""
    t = torch.tensor([value], dtype=torch.float64, device=topo.device)
    topo.comm("world").broadcast(t, src=0, name="metrics.monitor")
    return float(t)


def resume_line(path: str | None, done: int, max_steps: int) -> str:
    if path is None:
        return f"shardwise: no checkpoint to resume from: training steps 0 to {max_steps}"
    if done >= max_steps:
        return f"shardwise: already complete: {path} is at step {done} of max_steps={max_steps}, 0 steps to run"
    return f"shardwise: resuming from step {done} of {path}: {max_steps - done} steps to run"


def leave_after_error(e: BaseException) -> None:
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
