"""Hand-written training loops: ``sw.setup`` and what such a loop needs around it.

``model, optimizer = sw.setup(model, optimizer_fn, strategy="zero3")`` applies
a strategy and returns a :class:`Prepared` model: the strategy's model
(sharded, wrapped, split) with its strategy and topology beside it, so that
what a loop does with a plain model keeps its meaning:

* ``model(x)``, ``loss.backward()``, ``optimizer.step()``: as usual (under
  pipeline parallelism ``model.train_step(x, y, loss_fn)`` runs the schedule);
* ``model.state_dict()``: the full state dict of the bare model, loadable with
  a strict ``load_state_dict`` (a collective: every rank calls it);
* ``sw.clip_grad_norm_(model, max_norm)``: the global norm over every shard;
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` is routed there (:mod:`shardwise.loop.torch_clip`);
* ``sw.save`` / ``sw.load`` (:mod:`shardwise.loop.calls`): the Trainer's layout-free checkpoints, with what a
  resume needs beside the model and optimizer (the registered schedulers and objects, each prepared loader's
  position, every RNG: :mod:`shardwise.loop.state`);
* ``sw.setup(..., logger=)`` and ``sw.log``: rows through the loggers (:mod:`shardwise.loop.output`);
* ``sw.prepare_dataloader``, ``sw.gather_for_metrics``, ``sw.all_reduce_mean``: data and metrics
  (:mod:`shardwise.loop.data`).
"""
from __future__ import annotations

import datetime as _dt
import functools
import os
import sys
import types
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from shardwise import launch
from shardwise import loggers as loggers_mod
from shardwise import precision as precision_mod
from shardwise.checkpoint import store as checkpoint
from shardwise.comm.diagnostics import CollectiveTimeout
from shardwise.comm.topology import Topology, accelerator_name, backend_for, pick_device, uses_cuda
from shardwise.data import to_device
from shardwise.dims import PP, TP
from shardwise.init_from import InitFrom, read_into
from shardwise.layout import RunLayout
from shardwise.loop.names import translate
from shardwise.loop.output import LoopLog
from shardwise.loop.state import Kept
from shardwise.loop.torch_clip import guard_torch_clip
from shardwise.optim.param_groups import (
    ParamGroupsFn,
    check_whole,
    json_hyper,
    plan_groups,
    splits_parameters,
)
from shardwise.parallel.dp.ddp import GradSync
from shardwise.precision import ScaledOptimizer
from shardwise.recipe import Recipe, prepare_rank
from shardwise.step import LossFn, OptimizerFactory, StepRun, iter_chunks, unwrap
from shardwise.strategies.base import HasServers, Strategy, compile_backend
from shardwise.strategies.registry import resolve
from shardwise.strategies.torch_engine.choice import engine_for

# The messages of what a hand-written loop may not do with a model from setup, each with its reason and fix.
COMPILE_AFTER_SETUP = (
    "torch.compile(model) on the model sw.setup returned (strategy {strategy!r}): its wrappers communicate from "
    "hooks and swap parameters in and out around each block, which dynamo would trace into the graph; compile the "
    "blocks before the strategy wraps them with sw.setup(..., compile=True) (or compile='aot_eager', any backend)")
FORWARD_IS_COLLECTIVE = (
    "under {strategy!r} a forward of the model from sw.setup is a collective (the ranks holding its shards or "
    "slices take part in it): call the model on every rank of its group, e.g. generate samples on every rank and "
    "print them on rank 0 only")
BARE_STATE_DICT = (
    "state_dict() of the model passed to sw.setup: under {strategy!r} this rank holds {holds}, so its state dict "
    "is not the model's; call state_dict() on the model sw.setup returned (a collective: every rank calls it; "
    "each gets the full state dict), or save with sw.save(model, optimizer, directory)")


class IncompatibleKeys(NamedTuple):
    """What :meth:`Prepared.load_state_dict` returns, as torch's ``load_state_dict`` does: the model's keys the
    state dict lacked, and its keys that name nothing of the model (both empty after a strict load)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _under_torch_compile() -> bool:
    """Whether this call came through a ``torch.compile`` wrapper (an ``OptimizedModule``, a compiled function):
    dynamo's frame evaluation is on the stack. Dynamo cannot trace this check, so it runs it eagerly; that is how a
    refusal from inside a compiled call reaches the caller instead of becoming a graph break."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch._dynamo.eval_frame":
            return True
        frame = frame.f_back
    return False


def _full_tensors(state_dict: Mapping[str, Any], shapes: dict[str, list[int]], aliases: dict[str, str]
                  ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """``state_dict``'s tensors under the model's canonical names (a tied weight under any of its names), the
    canonical names it lacks, and its keys that name nothing of the model; a shape that differs is an error."""
    full: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        name = aliases.get(key, key)
        if name in shapes:
            if list(value.shape) != list(shapes[name]):
                raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                                   f"the state dict, the shape in the model is {tuple(shapes[name])}")
            full.setdefault(name, value)
    unexpected = [k for k in state_dict if aliases.get(k, k) not in shapes]
    return full, [k for k in shapes if k not in full], unexpected


def _load_errors(model: str, missing: list[str], unexpected: list[str]) -> str:
    """torch's own wording of a strict load's failure."""
    errors = ([f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing)}."] if missing else []) + \
        ([f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in unexpected)}."] if unexpected else [])
    return f"Error(s) in loading state_dict for {model}:\n\t" + "\n\t".join(errors)


class Prepared(nn.Module):
    """What :func:`setup` returns: the strategy's model, with the strategy, topology and precision."""

    # Declared for type checkers: __init__ puts them in the instance __dict__, past nn.Module.__setattr__.
    strategy: Strategy
    topo: Topology
    precision: str
    shapes: dict[str, list[int]]
    aliases: dict[str, str]
    scaled: ScaledOptimizer | None
    optimizer: torch.optim.Optimizer | None
    kept: Kept
    log: LoopLog | None

    def __init__(self, inner: nn.Module, strategy: Strategy, topo: Topology, precision: str,
                 shapes: dict[str, list[int]], aliases: dict[str, str]) -> None:
        super().__init__()
        self.module = inner
        # Plain attributes (not modules or buffers): the run's context, not part of the model's state.
        self.__dict__["strategy"] = strategy
        self.__dict__["topo"] = topo
        self.__dict__["precision"] = precision
        self.__dict__["shapes"] = shapes
        self.__dict__["aliases"] = aliases
        self.__dict__["scaled"] = None  # the fp16 optimizer (precision="16-mixed"), set by setup
        self.__dict__["optimizer"] = None  # the optimizer setup returned beside this model, set by setup
        self.__dict__["kept"] = Kept()  # what sw.save keeps beside model and optimizer (shardwise.loop.state)
        self.__dict__["log"] = None  # its LoopLog, under sw.setup(logger=)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The strategy's forward, the inputs (tensors nested in tuples, lists, dicts, a ``BatchEncoding``) moved to
        this rank's device first, under the run's autocast; under mixed precision the output's half-precision
        tensors come back in float32, so the loss is computed as the Trainer computes it."""
        if self.strategy.forward_communicates(self.topo) and _under_torch_compile():
            raise RuntimeError(COMPILE_AFTER_SETUP.format(strategy=self.strategy.name))
        if self.topo.size(PP) > 1:
            return self._pipeline_forward(*args, **kwargs)
        device, cast = self.topo.device, functools.partial(precision_mod.cast_batch, self.precision)
        try:
            with StepRun(self.precision).forward_context(device):
                out = self.module(*cast(to_device(args, device)), **cast(to_device(kwargs, device)))
        except CollectiveTimeout as e:
            if not self.strategy.forward_communicates(self.topo):
                raise
            raise CollectiveTimeout(f"{e}\n{FORWARD_IS_COLLECTIVE.format(strategy=self.strategy.name)}") from e
        return out if self.precision == "32" else precision_mod.widened_output(out)

    def _pipeline_forward(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp, a forward without gradients runs the forward-only schedule and gives every rank the output
        (sent from the last stage); a forward that would need a backward has to run the schedule's step."""
        if torch.is_grad_enabled() or kwargs or len(args) != 1:
            raise RuntimeError("under pipeline parallelism a rank holds one stage, so model(x) cannot give the "
                               "model's output; run a step with `loss = model.train_step(x, y, loss_fn)` (forward "
                               "and backward over the pipeline's schedule), then optimizer.step() as usual "
                               "(under torch.no_grad(), model(x) of one input runs the forward-only schedule)")
        x = precision_mod.cast_batch(self.precision, to_device(args[0], self.topo.device))
        out = self.strategy.eval_step(self.module, x, None, lambda o, _y: o, self.topo, StepRun(self.precision))
        if out is not None and not isinstance(out, torch.Tensor):
            raise TypeError("under pipeline parallelism model(x) under torch.no_grad() gives every rank the last "
                            f"stage's output, which must be one tensor (got {type(out).__name__})")
        comm = self.topo.comm(PP)
        # Which pp rank holds the output, and its shape and dtype (JSON), then the tensor itself from there.
        shapes = comm.all_gather_object(None if out is None else [list(out.shape), str(out.dtype)[len("torch."):]],
                                        name="loop.pipeline_output_shape")
        src = next(r for r, s in enumerate(shapes) if s is not None)
        shape, dtype = shapes[src]
        t = out.contiguous() if out is not None else torch.empty(shape, dtype=getattr(torch, dtype),
                                                                 device=self.topo.device)
        comm.broadcast(t, src, name="loop.pipeline_output")
        return t

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled first under ``precision="16-mixed"`` (Accelerate's and Fabric's
        ``backward``): the one call a loop needs for every precision."""
        opt: ScaledOptimizer | None = self.scaled
        if opt is None:
            loss.backward()
            return
        (precision_mod.widened(loss) * opt.scaler.scale).backward()
        opt.scaled = True

    def train_step(self, x: Any, y: Any, loss_fn: LossFn, accumulate: int = 1) -> torch.Tensor:
        """Forward and backward of one batch under the strategy's own step (the pipeline's schedule under pp,
        ``accumulate`` micro-batches with the gradient reduced once); returns the mean loss over the data-parallel
        replicas, the same tensor on every rank. Call ``optimizer.step()`` after it."""
        device, opt = self.topo.device, self.scaled
        x, y = precision_mod.cast_batch(self.precision, to_device((x, y), device))
        micro = list(zip(iter_chunks(x, accumulate), iter_chunks(y, accumulate)))
        run = StepRun(self.precision, opt.scaler.scale if opt is not None else 1.0)
        loss = self.strategy.train_step(self.module, micro, loss_fn, self.topo, run)
        if opt is not None:
            opt.scaled = True
        shards, _ = self.strategy.data_parallel(self.topo)
        mine = precision_mod.widened(loss.detach()) / shards \
            if loss is not None and self.strategy.owns_loss(self.topo) else torch.zeros((), device=self.topo.device)
        t = mine.reshape(1).clone()
        self.topo.comm("world").all_reduce(t, name="loop.loss")
        return t[0]

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The full, unsharded state dict of the bare model on CPU, under the bare model's names (tied weights
        under each of their names). A collective: every rank must call it; every rank gets it."""
        if args or kwargs.get("destination") is not None or kwargs.get("prefix"):
            raise TypeError("state_dict() of a model from sw.setup takes no destination or prefix: it returns the "
                            "full state dict of the bare model (a collective)")
        full = self.strategy.full_state_dict(self.module, self.topo)
        for alias, name in self.aliases.items():
            full.setdefault(alias, full[name])
        return full

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Copy a full state dict of the bare model (``model.state_dict()``'s, or the bare model's own before
        ``sw.setup``) into what this rank holds of every tensor, under any strategy; the optimizer is untouched.
        Every rank calls it with the same tensors (no communication)."""
        if assign:
            raise TypeError("load_state_dict(assign=True) of a model from sw.setup: its tensors are this rank's "
                            "shards or slices, so they cannot be replaced by full ones; call it without assign")
        full, missing, unexpected = _full_tensors(state_dict, self.shapes, self.aliases)
        if strict and (missing or unexpected):
            raise RuntimeError(_load_errors(type(unwrap(self.module)).__name__, missing, unexpected))
        _, pieces = checkpoint._dcp()
        held = [h for h in self.strategy.checkpoint_held(self.module, self.optimizer, self.topo)  # type: ignore[arg-type]
                if h.key.startswith("model.") and h.key[len("model."):] in full]
        state = pieces.build_state(held, self.shapes, self.topo.coord(TP), self.topo.size(TP))
        with torch.no_grad():
            for key, got in state.items():
                src = full[key[len("model."):]]
                for offsets, view in got.parts:
                    box = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
                    view.copy_(src[box])
        return IncompatibleKeys(missing, unexpected)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every gradient of the model, and the reduced pieces a sharded optimizer steps (ZeRO-2/3, FSDP), cleared:
        the same as ``optimizer.zero_grad(set_to_none)``."""
        super().zero_grad(set_to_none)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]``: each rank clamps the (reduced) pieces its
        optimizer steps, which is torch's element-wise clamp of the averaged gradients (fp16: unscaled first)."""
        if self.scaled is not None:
            self.scaled.unscale_()
        self.strategy.clip_grad_value(self.module, self.optimizer, clip_value, self.topo)  # type: ignore[arg-type]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (every shard, every replica counted once) to ``max_norm`` (fp16: of the
        unscaled gradients; a step that overflowed is skipped by ``optimizer.step()`` anyway)."""
        if self.scaled is not None:
            self.scaled.unscale_()
        return self.strategy.clip_grad_norm(self.module, max_norm, self.topo)


# Parameters of every live Prepared model, so torch.nn.utils.clip_grad_norm_ on them can be routed
# (:mod:`shardwise.loop.torch_clip`).
_PREPARED: weakref.WeakSet[Prepared] = weakref.WeakSet()
# The model this process set up last: where a loader prepared without model= and a registered object belong.
_NEWEST: list[weakref.ref[Prepared]] = []


def setup(model: nn.Module, optimizer_fn: OptimizerFactory, strategy: str | Strategy = "ddp",
          accelerator: str = "auto", precision: str = "32", sync_batchnorm: bool = False,
          param_groups: ParamGroupsFn | None = None, init_from: str | os.PathLike[str] | None = None,
          init_allow_missing: list[str] | tuple[str, ...] = (),
          compile: bool | str = False, timeout_s: float | None = None, logger: Any = None,
          **accelerate: Any) -> tuple[Prepared, torch.optim.Optimizer]:
    """Apply ``strategy`` to ``model`` inside the running group (``sw.init()``); returns the prepared model and
    the optimizer ``optimizer_fn`` builds over the parameters this rank holds.

    The optimizer's parameter groups (those ``optimizer_fn`` makes, or ``param_groups(model)``'s) are decided
    on the unsplit model and carried onto what this rank holds, as in the Trainer
    (:mod:`shardwise.optim.param_groups`): ``optimizer.param_groups`` has the same groups on every rank, a group this
    rank holds nothing of empty, so a loop that sets ``g["lr"]`` on each works under every strategy.

    ``precision``: ``"32"``, ``"bf16-mixed"`` (autocast in the model's forward; fp32 master weights),
    ``"bf16-true"`` (weights, gradients and optimizer states in bf16, floating inputs cast to bf16) or
    ``"16-mixed"``: autocast with fp16 and a dynamic loss scaler; the loop then calls ``model.backward(loss)``
    (which scales the loss) instead of ``loss.backward()``, and ``optimizer.step()`` unscales, skips a step
    whose gradients overflowed on any rank, and adjusts the scale.
    ``sync_batchnorm``: BatchNorm normalises with the whole global batch's statistics (see the Trainer).
    ``init_from``, ``init_allow_missing``: pretrained weights read straight into what each rank holds, the model
    possibly on the meta device (see ``Trainer.fit`` and :mod:`shardwise.init_from`).
    ``compile``: compile each block in place before the strategy wraps the model (see the Trainer's
    ``compile``; ``True`` is inductor, a string another ``torch.compile`` backend).
    A strategy object's ``engine="torch"`` runs PyTorch's engine for it, as in the Trainer
    (:mod:`shardwise.strategies.torch_engine.choice`); what torch has no engine for is refused with the reason.
    ``timeout_s``: how long a collective of the model may wait for the other ranks before it fails, naming the
    collective and the ranks that never joined it (default: ``sw.init``'s).
    ``logger``: where ``sw.log``'s values go, a row per ``optimizer.step()`` (the Trainer's ``logger=``:
    ``"csv"``, ``"mlflow"``, a logger object, a list; :mod:`shardwise.loop.output`).
    Accelerate's ``Accelerator`` options (``mixed_precision=``, ``log_with=``, ``cpu=``, ``split_batches=``,
    ...) are taken with their meaning or refused with what to write instead (:mod:`shardwise.loop.names`).
    """
    precision, accelerator, logger = translate(accelerate, precision, accelerator, logger)
    precision = precision_mod.check(precision)
    loggers = loggers_mod.resolve(logger)
    if isinstance(optimizer_fn, torch.optim.Optimizer):
        raise TypeError("optimizer_fn must be a factory that builds the optimizer from parameters (each rank builds "
                        "its own, over the parameters it holds), e.g. functools.partial(torch.optim.AdamW, lr=1e-3)")
    # A strategy's own engine="torch": PyTorch's engine for it, or refused with the reason before anything runs.
    strat = engine_for(resolve(strategy), None, sync_batchnorm=sync_batchnorm,
                       cuda=uses_cuda(accelerator_name(accelerator)))
    backend = compile_backend(strat, compile)
    weights = InitFrom.of(init_from, init_allow_missing)
    if weights is not None:
        weights.check(model)
    if isinstance(strat, HasServers):
        raise ValueError(f"strategy {strat.name!r} cannot run in a hand-written loop: its server ranks hold no "
                         "model replica and run a serving loop of their own while the workers train; use "
                         f"sw.Trainer({strat.name!r}, devices=N).fit(...)")
    device = init(accelerator)
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = strat.layout(world)
    groups, probe = plan_groups(model, optimizer_fn, param_groups)
    strat.check_optimizer(probe)
    check_whole(probe, strat.name, splits_parameters(layout))
    wait = _dt.timedelta(seconds=timeout_s if timeout_s is not None else _SETTINGS["timeout_s"])
    topo = Topology.create(device, layout.dims, timeout=wait)
    # A user's process keeps the code it compiled elsewhere (no fresh_compile).
    recipe = Recipe(precision=precision, sync_batchnorm=sync_batchnorm, compile=backend, init=weights)
    built = prepare_rank(model, strat, topo, recipe, optimizer_fn, groups)
    inner, opt, model = built.model, built.optimizer, built.bare
    if weights is not None:
        read_into(weights, strat, inner, opt, topo, built.shapes, built.aliases)
    prepared = Prepared(inner, strat, topo, precision, built.shapes, built.aliases)
    return prepared, _attach(prepared, model, opt, layout, loggers, type(probe).__name__)


def _attach(prepared: Prepared, bare: nn.Module, opt: torch.optim.Optimizer, layout: RunLayout, loggers: list[Any],
            optimizer_class: str) -> torch.optim.Optimizer:
    """What a loop's model and optimizer carry beside the strategy's: the fp16 loss scaler, the rows of
    ``sw.log``, the wrappers told of a loop's ``p.grad = None``, the bare model's ``state_dict()`` refused where
    it holds a part of the model, torch's clip functions routed. Returns the optimizer the loop steps."""
    strat, topo, precision = prepared.strategy, prepared.topo, prepared.precision
    if precision == "16-mixed":
        world_sum = functools.partial(topo.comm("world").all_reduce, name="loop.overflow")
        opt = prepared.__dict__["scaled"] = ScaledOptimizer(opt, precision_mod.LossScaler(), world_sum)  # type: ignore[arg-type]
    prepared.__dict__["optimizer"] = opt
    _log_rows(prepared, opt, LoopLog(loggers, topo, {
        "strategy": strat.name, "world_size": topo.world_size, "precision": precision,
        "optimizer": {"class": optimizer_class, "groups": [json_hyper(g) for g in opt.param_groups]}}))
    _NEWEST[:] = [weakref.ref(prepared)]
    for m in prepared.module.modules():
        if isinstance(m, GradSync):
            m.watch_user_clears()  # a loop's `p.grad = None` reaches the pieces the optimizer steps
    holds = "flat 1-D shards of the parameters (ZeRO-3/FSDP)" if layout.zero >= 3 else \
        "tensor-parallel slices of the parameters" if layout.tp > 1 else \
        "one pipeline stage of it" if layout.pp > 1 else None  # ZeRO-1/2 gather every update into the bare model
    if holds is not None:
        bare.register_state_dict_pre_hook(functools.partial(_refuse_bare_state_dict, strat.name, holds))
    _PREPARED.add(prepared)
    guard_torch_clip(_PREPARED)
    return opt


def _log_rows(model: Prepared, opt: torch.optim.Optimizer, log: LoopLog) -> None:
    """Each ``opt.step()`` ends a row of ``log``. The step is replaced on the instance by a bound method, as
    torch's learning-rate schedulers patch it, so a scheduler built on ``opt`` later wraps this one in turn."""
    stepped = opt.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        out = stepped(*args, **kwargs)
        log.row()
        return out

    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
    model.__dict__["log"] = log
    weakref.finalize(model, log.close)  # a loop that never calls sw.end_training still closes its runs


def _newest() -> Prepared | None:
    return _NEWEST[0]() if _NEWEST else None


def kept_by(model: nn.Module | None) -> Kept | None:
    """What a checkpoint of ``model`` keeps (of the model this process set up last, without one; None before
    any setup)."""
    owner = as_prepared(model) if model is not None else _newest()
    return owner.kept if owner is not None else None


def register_for_checkpointing(*objects: Any, model: nn.Module | None = None) -> None:
    """Keep each object's state in every :func:`save` of ``model`` (default: the model this process set up
    last) and give it back on :func:`load`: a learning-rate scheduler, or any object with ``state_dict()`` and
    ``load_state_dict(state)`` (its state as tensors and JSON, rank 0's; never pickled). A resumed loop registers
    the same objects in the same order before ``sw.load``."""
    kept = kept_by(model)
    if kept is None:
        raise RuntimeError("sw.register_for_checkpointing() before sw.setup: the objects are kept in the "
                           "checkpoints of a model; set the model up first")
    for obj in objects:
        kept.register(obj)


def end_training(model: nn.Module | None = None) -> None:
    """Write what ``sw.log`` recorded since the last optimizer step (a collective, with loggers) and finish the
    runs of the loggers of ``model`` (default: the model this process set up last), as Accelerate's
    ``end_training``."""
    owner = as_prepared(model) if model is not None else _newest()
    if owner is not None and owner.log is not None:
        owner.log.row()
        owner.log.close()


def _refuse_bare_state_dict(strategy: str, holds: str, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """The bare model's ``state_dict()`` called from a user's code (a callback, a closure) after ``sw.setup``
    sharded or split it: refused with the fix. Its own calls from shardwise (the full state dict, checkpoints)
    gather what they need and pass."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch."):
        frame = frame.f_back  # nn.Module.state_dict's own frames (it recurses into submodules)
    if prefix or (frame is not None and frame.f_globals.get("__name__", "").startswith("shardwise.")):
        return
    raise RuntimeError(BARE_STATE_DICT.format(strategy=strategy, holds=holds))


# What sw.init sets for the setups that follow it in this process (sw.setup's timeout_s overrides it).
_SETTINGS: dict[str, float] = {"timeout_s": 300.0}


def init(accelerator: str = "auto", timeout_s: float | None = None) -> torch.device:
    """Join the running group (``shardwise run``/torchrun), or, from a plain ``python script.py``, form a group
    of one on loopback, so that ``torch.distributed`` calls work there too; returns this rank's device.

    ``timeout_s`` (default 300): how long a collective of a model from :func:`setup` waits for the other ranks.
    Past it the collective fails on the waiting rank with where every rank is: which collective, and which
    ranks never joined it (a forward on one rank only, under a strategy whose forward communicates)."""
    if timeout_s is not None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        _SETTINGS["timeout_s"] = float(timeout_s)
    if not dist.is_initialized() and not launch.under_torchrun():
        device = pick_device(accelerator, 0)
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
        dist.init_process_group(backend_for(device), store=store, rank=0, world_size=1)
        return device
    return launch.init(accelerator, _dt.timedelta(seconds=_SETTINGS["timeout_s"]))


def as_prepared(model: nn.Module) -> Prepared:
    if not isinstance(model, Prepared):
        raise TypeError(f"expected the model sw.setup returned, got {type(model).__name__}")
    return model


__all__ = ["Prepared", "as_prepared", "end_training", "init", "kept_by", "register_for_checkpointing", "setup"]
