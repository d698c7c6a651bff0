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
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` is routed there;
* ``sw.save`` / ``sw.load``: the Trainer's layout-free checkpoints;
* ``sw.prepare_dataloader``, ``sw.gather``, ``sw.all_reduce_mean``: data and metrics.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.utils as utils
import torch.nn.utils.clip_grad as clip_grad
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from shardwise import launch
from shardwise import precision as precision_mod
from shardwise.checkpoint import store as checkpoint
from shardwise.comm.topology import Topology, accelerator_name, backend_for, pick_device, uses_cuda
from shardwise.data import to_device
from shardwise.dims import DP, PP
from shardwise.init_from import InitFrom, after_setup, before_setup, read_into
from shardwise.optim.param_groups import (
    GroupedFactory,
    ParamGroupsFn,
    apply_hyper,
    check_whole,
    plan_groups,
    splits_parameters,
)
from shardwise.parallel.compiling import compile_blocks
from shardwise.precision import ScaledOptimizer
from shardwise.step import LossFn, OptimizerFactory, StepRun, iter_chunks
from shardwise.strategies.base import HasServers, Strategy, compile_backend
from shardwise.strategies.registry import resolve
from shardwise.strategies.torch_engine.choice import engine_for, synced_batchnorm


class Prepared(nn.Module):
    """What :func:`setup` returns: the strategy's model, with the strategy, topology and precision."""

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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The strategy's forward, the inputs (tensors nested in tuples, lists, dicts, a ``BatchEncoding``) moved to
        this rank's device first, under the run's autocast; under mixed precision the output's half-precision
        tensors come back in float32, so the loss is computed as the Trainer computes it."""
        if self.topo.size(PP) > 1:
            raise RuntimeError("under pipeline parallelism a rank holds one stage, so model(x) cannot give the "
                               "model's output; run a step with `loss = model.train_step(x, y, loss_fn)` (forward "
                               "and backward over the pipeline's schedule), then optimizer.step() as usual")
        device, cast = self.topo.device, functools.partial(precision_mod.cast_batch, self.precision)
        with StepRun(self.precision).forward_context(device):
            out = self.module(*cast(to_device(args, device)), **cast(to_device(kwargs, device)))
        return out if self.precision == "32" else precision_mod.widened_output(out)

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
        mine = precision_mod.widened(loss.detach()) / shards if loss is not None and self.strategy.owns_loss(self.topo) \
            else torch.zeros((), device=self.topo.device)
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

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> Any:
        raise TypeError("load_state_dict() of a model from sw.setup would have to split the full tensors the way "
                        "this strategy shards them: load them into the bare model before sw.setup, or resume a "
                        "run with sw.load(model, optimizer, directory) (any layout)")

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (every shard, every replica counted once) to ``max_norm`` (fp16: of the
        unscaled gradients; a step that overflowed is skipped by ``optimizer.step()`` anyway)."""
        if self.scaled is not None:
            self.scaled.unscale_()
        return self.strategy.clip_grad_norm(self.module, max_norm, self.topo)


_ROUTED: contextvars.ContextVar[bool] = contextvars.ContextVar("shardwise_clip_routed", default=False)
# Parameters of every live Prepared model, so torch.nn.utils.clip_grad_norm_ on them can be routed (see _guard).
_PREPARED: weakref.WeakSet[Prepared] = weakref.WeakSet()


def setup(model: nn.Module, optimizer_fn: OptimizerFactory, strategy: str | Strategy = "ddp",
          accelerator: str = "auto", precision: str = "32", sync_batchnorm: bool = False,
          param_groups: ParamGroupsFn | None = None, init_from: str | os.PathLike[str] | None = None,
          init_allow_missing: list[str] | tuple[str, ...] = (),
          compile: bool | str = False) -> tuple[Prepared, torch.optim.Optimizer]:
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
    """
    precision = precision_mod.check(precision)
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
    topo = Topology.create(device, layout.dims)
    shapes, aliases = checkpoint.model_shapes(model), checkpoint.tied_aliases(model)
    if sync_batchnorm:
        model = synced_batchnorm(model, strat, topo)
    precision_mod.cast_model(precision, model)  # "bf16-true": the weights themselves in bf16
    if backend is not None:
        compile_blocks(model, backend)  # before the strategy's wrappers, names unchanged
    grouped = GroupedFactory(optimizer_fn, groups)
    inner, opt = before_setup(weights, model, strat, topo).setup(model, grouped, topo)
    grouped.finish(strat.param_names(inner))
    after_setup(weights, inner, topo, model)
    if weights is not None:
        read_into(weights, strat, inner, opt, topo, shapes, aliases)
    prepared = Prepared(inner, strat, topo, precision, shapes, aliases)
    if precision == "16-mixed":
        world_sum = functools.partial(topo.comm("world").all_reduce, name="loop.overflow")
        opt = prepared.__dict__["scaled"] = ScaledOptimizer(opt, precision_mod.LossScaler(), world_sum)
    _PREPARED.add(prepared)
    _guard_torch_clip()
    return prepared, opt


def init(accelerator: str = "auto") -> torch.device:
    """Join the running group (``shardwise run``/torchrun), or, from a plain ``python script.py``, form a group
    of one on loopback, so that ``torch.distributed`` calls work there too; returns this rank's device."""
    if not dist.is_initialized() and not launch.under_torchrun():
        device = pick_device(accelerator, 0)
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
        dist.init_process_group(backend_for(device), store=store, rank=0, world_size=1)
        return device
    return launch.init(accelerator)


def _prepared(model: nn.Module) -> Prepared:
    if not isinstance(model, Prepared):
        raise TypeError(f"expected the model sw.setup returned, got {type(model).__name__}")
    return model


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of a model from :func:`setup` to ``max_norm`` under any strategy (every
    shard and tensor-parallel slice counted once); returns the norm before clipping, as torch's does."""
    return _prepared(model).clip_grad_norm_(max_norm)


def _guard_torch_clip() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on a model from :func:`setup`.

    Under ZeRO-2/3, FSDP and tensor parallelism a rank holds pieces of the gradients (or none, on the full
    parameters), so torch's function computes the norm of the wrong tensors and silently clips nothing
    right: 0.0 under zero2 and fsdp. Given exactly a prepared model's parameters, the global clip runs
    instead; given some of them, it raises with the fix.
    """
    if getattr(utils.clip_grad_norm_, "_shardwise_guard", False):
        return
    original = utils.clip_grad_norm_

    @functools.wraps(original)
    def guarded(parameters: Any, max_norm: float, norm_type: float = 2.0, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _ROUTED.get():  # the strategy's own clip, which may call torch's on the tensors it holds
            return original(params, max_norm, norm_type, *args, **kwargs)
        ids = {id(p) for p in params}
        for m in list(_PREPARED):
            owned = {id(p) for p in m.parameters()}
            if ids & owned:
                if ids != owned or float(norm_type) != 2.0:
                    raise RuntimeError("torch.nn.utils.clip_grad_norm_ on some parameters of a model from sw.setup "
                                       "(or with norm_type != 2): under a sharded strategy each rank holds pieces "
                                       "of the gradients, so the norm must be taken over all of them; use "
                                       "sw.clip_grad_norm_(model, max_norm)")
                token = _ROUTED.set(True)
                try:
                    return m.clip_grad_norm_(max_norm)
                finally:
                    _ROUTED.reset(token)
        return original(params, max_norm, norm_type, *args, **kwargs)

    guarded._shardwise_guard = True  # type: ignore[attr-defined]
    utils.clip_grad_norm_ = guarded
    clip_grad.clip_grad_norm_ = guarded


def _group(model: nn.Module | None) -> tuple[Any, int, int]:
    """(comm or None, size, rank) of the data-parallel group of ``model`` (the world without a model)."""
    if model is not None:
        topo = _prepared(model).topo
        return topo.comm(DP), topo.size(DP), topo.coord(DP)
    if dist.is_initialized():
        return None, dist.get_world_size(), dist.get_rank()
    return None, 1, 0


def prepare_dataloader(dataset: Any, batch_size: int, model: nn.Module | None = None, shuffle: bool = True,
                       seed: int = 0, drop_last: bool = True, device: torch.device | str | None = None,
                       **loader_kwargs: Any) -> DataLoader:
    """A DataLoader that gives this rank its part of every GLOBAL batch of ``batch_size`` samples, on its device.

    Each data-parallel replica (of ``model``'s layout; every rank without a model) reads ``batch_size /
    replicas`` samples per step through torch's DistributedSampler, so the replicas together read one
    global batch: the same as one device with ``batch_size`` (with ``shuffle``, one seeded permutation per
    epoch: call ``loader.sampler.set_epoch(epoch)``). Tensor- and pipeline-parallel ranks of one replica read
    the same samples. Batches come on ``device`` (default: ``model``'s, else the CPU); on CUDA from pinned
    memory (``pin_memory`` defaults to True there) with non-blocking copies. Other DataLoader options
    (num_workers, collate_fn, pin_memory) pass through.
    """
    _, size, rank = _group(model)
    if batch_size % size:
        raise ValueError(f"batch_size={batch_size} (global) does not split over {size} data-parallel replicas; "
                         f"use a multiple of {size}")
    where = torch.device(device) if device is not None else \
        (_prepared(model).topo.device if model is not None else torch.device("cpu"))
    loader_kwargs.setdefault("pin_memory", where.type == "cuda")
    sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DeviceLoader(dataset, batch_size=batch_size // size, sampler=sampler, drop_last=drop_last, device=where,
                        **loader_kwargs)


class DeviceLoader(DataLoader):
    """A DataLoader whose batches come on ``device`` (tensors nested in tuples, lists, dicts)."""

    def __init__(self, *args: Any, device: torch.device, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = device

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return (to_device(batch, self.device) for batch in super().__iter__())


def gather(tensor: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape everywhere) stacked along a new first dimension, on every rank:
    over ``model``'s data-parallel group, or the world."""
    comm, size, _ = _group(model)
    if size == 1:
        return tensor.detach().unsqueeze(0).clone()
    t = tensor.detach().contiguous()
    out = torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
    if comm is not None:
        comm.all_gather(out.view(-1), t.view(-1), name="loop.gather")
    else:
        dist.all_gather_into_tensor(out.view(-1), t.view(-1))
    return out


def all_reduce_mean(tensor: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
    """The mean of ``tensor`` over the ranks (``model``'s data-parallel group, or the world), on every rank."""
    return precision_mod.widened(gather(tensor, model)).mean(0).to(tensor.dtype)


def save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | os.PathLike[str], step: int,
         losses: list[float] | None = None, keep: int | None = None) -> str:
    """Write the layout-free checkpoint of step ``step`` under ``directory`` (``step_<N>``; a collective), the
    format the Trainer writes: any strategy and device count can :func:`load` it, and a Trainer can resume from
    it. ``losses``: the loss of each step so far, if the loop kept them (NaN otherwise). Returns its path."""
    m = _prepared(model)
    history = list(losses) if losses is not None else [float("nan")] * step
    if len(history) != step:
        raise ValueError(f"losses has {len(history)} entries for step={step}: one per step taken")
    extra = {"scaler": m.scaled.scaler.as_tensor()} if m.scaled is not None else None
    return checkpoint.save(os.fspath(directory), step, history, m.strategy, m.module, optimizer, m.topo,
                           m.shapes, keep=keep, aliases=m.aliases, extra=extra)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike[str]) -> int:
    """Restore model and optimizer in place from a checkpoint (a ``step_<N>`` directory, or the newest intact
    one under a checkpoint directory), written under any layout; returns its step (a collective)."""
    m = _prepared(model)
    p = os.fspath(path)
    if not os.path.exists(os.path.join(p, checkpoint.MANIFEST)):
        newest = checkpoint.latest_valid(p)
        if newest is None:
            raise FileNotFoundError(f"no intact checkpoint under {p}")
        p = newest
    restored = checkpoint.load(p, m.strategy, m.module, optimizer, m.topo, m.shapes)
    if restored.groups:  # each group's lr and settings as saved (torch's load_state_dict does the same)
        apply_hyper(optimizer, restored.groups)
    if m.scaled is not None and "scaler" in restored.extra:
        m.scaled.scaler.load_tensor(restored.extra["scaler"])
    return restored.step


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without communication (for all but the last micro-batch of a step)."""
    m = _prepared(model)
    with m.strategy.no_sync(m.module):
        yield


__all__ = ["Prepared", "all_reduce_mean", "clip_grad_norm_", "gather", "init", "load", "no_sync",
           "prepare_dataloader", "save", "setup"]
