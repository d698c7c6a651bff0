"""The strategy base class and the capabilities the fit asks a strategy for.

A strategy object carries its own options (``sw.DDP(bucket_cap_mb=50)``) and
decides what the Trainer does not: its layout on a device count (one method,
:meth:`Strategy.layout`), how to wrap the model and optimizer on a
:class:`~shardwise.comm.topology.Topology`, and how one optimizer step's
forward and backward run (pipelines schedule their own). This module knows no
concrete strategy: names are looked up in :mod:`shardwise.strategies.registry`,
and what only some strategies can do is a capability class below
(:class:`SplitsModel`, :class:`OwnDevices`, :class:`HasTPPlan`,
:class:`HasServers`), asked with isinstance, never by name.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from shardwise.checkpoint.held import Held, held_state, named_state
from shardwise.comm.topology import Topology
from shardwise.data import leaves, to_device
from shardwise.dims import CP, DP, DP_CP, EP, PP, TP
from shardwise.layout import RunLayout
from shardwise.optim.param_groups import named_params
from shardwise.parallel.accounting import model_state_tensors, with_optimizer_states
from shardwise.parallel.compiling import backend_of
from shardwise.parallel.dp.ddp import GradSync
from shardwise.precision import widened
from shardwise.step import (
    LossFn,
    OptimizerFactory,
    StepRun,
    call_model,
    forward_loss,
    on_device,
    set_aux_grad_scale,
    unwrap,
)

AnyStrategy = TypeVar("AnyStrategy", bound="Strategy")  # a method that returns its own strategy's class


@dataclass
class Strategy:
    """Base class: a single replica on one device; subclasses override what they change.

    A strategy object holds only its own options: the run's state (precision,
    the loss scale) reaches :meth:`train_step` as a :class:`StepRun`.

    ``engine``: whose mechanism runs it, ``"shardwise"`` or ``"torch"`` (PyTorch's own: DDP, FSDP2; see
    ``shardwise.strategies.torch_engine.wrappers``); None takes the Trainer's ``engine=``, and a strategy's own
    engine that differs from the Trainer's is refused. Keyword-only, so every strategy's positional
    arguments stay as they were.
    """

    engine: str | None = field(default=None, kw_only=True)
    name: ClassVar[str] = "single"
    # Whether the strategy's own collectives pass through shardwise's communication layer, so that the stats'
    # comm_bytes count them; PyTorch's engines call torch.distributed themselves (their traffic is not seen).
    comm_counted: ClassVar[bool] = True

    def layout(self, devices: int) -> RunLayout:
        """What this strategy builds on ``devices``: its parallel dims, data-parallel form and options.

        The one method a strategy overrides to describe its run; the Trainer,
        ``sw.setup``, the planner and the checks all read this value. Raises
        ValueError when the strategy cannot run on ``devices``.
        """
        return RunLayout(self.name, dp=devices)

    # Derived from layout() (the public names of earlier versions); not meant to be overridden.
    def sizes(self, devices: int) -> dict[str, int]:
        """``{"pp", "dp", "tp"}`` for ``devices`` (see :meth:`shardwise.dims.ParallelDims.sizes`)."""
        return self.layout(devices).dims.sizes()

    def describe(self, devices: int) -> RunLayout:
        """The planner's name for :meth:`layout`."""
        return self.layout(devices)

    def processes(self, devices: int) -> int:
        """How many processes to start for ``devices`` (1 for single-process strategies)."""
        return self.layout(devices).processes

    def batch_shards(self, devices: int) -> int:
        """How many parts each global batch is split into on ``devices`` (the ranks that read data)."""
        return self.layout(devices).batch_shards

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = on_device(model, topo.device)
        return model, optimizer_fn(model.parameters())

    def param_names(self, model: nn.Module) -> dict[int, str]:
        """``id(tensor) -> name`` in the unsplit model for every tensor :meth:`setup` gave the optimizer factory
        (parameters, tensor-parallel slices, ZeRO/FSDP shards), so that parameter groups follow them."""
        return named_params(unwrap(model).named_parameters(remove_duplicate=False), [model])

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Suppress gradient communication for a non-final micro-batch: the wrapper's own
        ``no_sync`` (DDP, ZeRO-1/2, FSDP); nothing for models that communicate no gradients."""
        return model.no_sync() if isinstance(model, GradSync) else contextlib.nullcontext()

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        """Forward and backward over the micro-batches of one step; returns this rank's mean loss.

        Each micro-batch's loss is divided by their count, so the accumulated
        gradient is that of the mean over the whole (local) batch.
        """
        k = len(micro_batches)
        set_aux_grad_scale(model, run.loss_scale / k)
        total: torch.Tensor | float = 0.0
        for i, (x, y) in enumerate(micro_batches):
            ctx = self.no_sync(model) if i < k - 1 else contextlib.nullcontext()
            with ctx:
                with run.forward_context(topo.device):
                    loss = forward_loss(model, x, y, loss_fn)
                (widened(loss) * (run.loss_scale / k)).backward()
            total = total + widened(loss.detach())
        return total / k  # type: ignore[return-value]

    def eval_step(self, model: nn.Module, x: Any, y: Any, fn: Callable[[Any, Any], torch.Tensor], topo: Topology,
                  run: StepRun = StepRun()) -> torch.Tensor | None:
        """The forward of one evaluation batch, no backward: ``fn(output, y)`` (a 1-D tensor of per-batch values)
        where this rank computes the model's output, None on ranks that do not (pipeline stages but the last).

        The caller puts the model in eval mode; this runs under ``torch.no_grad`` and the run's autocast, so
        data-parallel wrappers gather what they shard (ZeRO-3, FSDP) and free it again without preparing a
        backward. Only :meth:`owns_loss` ranks' values count (tensor-parallel ranks compute the same ones).
        """
        with torch.no_grad(), run.forward_context(topo.device):
            out = call_model(model, x)
            where = next(iter(leaves(out)), None)  # the output's device (naive model parallelism: the last one)
            return fn(out, to_device(y, where.device) if where is not None else y)

    def forward_communicates(self, topo: Topology) -> bool:
        """Whether a forward of the set-up model runs collectives: it gathers sharded parameters (ZeRO-3, FSDP) or
        exchanges activations (tensor, pipeline, context or expert parallelism). Every rank of the group must then
        run each forward, and no compiler may trace it from outside the strategy's wrappers."""
        return self.layout(topo.world_size).zero >= 3 or any(topo.size(d) > 1 for d in (TP, PP, CP, EP))

    def owns_loss(self, topo: Topology) -> bool:
        """Whether this rank's loss counts in the global mean (one per data-parallel replica)."""
        return True

    def data_parallel(self, topo: Topology) -> tuple[int, int]:
        """(number of data shards, this rank's shard): which part of each global batch this rank reads."""
        return topo.size(DP), topo.coord(DP)

    def logs_here(self, topo: Topology) -> bool:
        """Whether this rank writes the step rows to the loggers: rank 0 (under fault tolerance, the first rank of
        the first live replica group, which takes over when rank 0's group dies)."""
        return topo.rank == 0

    def train_shards(self, topo: Topology) -> tuple[int, int]:
        """(number of data shards, this rank's shard) of each global batch the training loop reads for the step:
        :meth:`data_parallel`'s, unless the step reads further shards itself (a fault-tolerant replica group
        reads its own shard here, and those of dead groups in its step)."""
        return self.data_parallel(topo)


    # ---- a model built on the meta device (init_from) ----
    def materialises_meta(self) -> bool:
        """Whether :meth:`setup` gives a meta-device model memory itself, module by module into this rank's shards
        (FSDP), so that no rank ever holds the whole model."""
        return False

    def with_param_init(self: AnyStrategy, init: Callable[[nn.Module], None]) -> AnyStrategy:
        """This strategy, initialising with ``init`` each module of a meta-device model it materialises (where
        :meth:`materialises_meta`), unless it was given an initialiser of its own."""
        return self

    def splits_meta(self, topo: Topology) -> bool:
        """Whether :meth:`setup` takes a meta-device model as it is and splits it (tensor and pipeline parallelism
        with no data-parallel wrapper), so that only what this rank keeps gets memory afterwards; otherwise a
        wrapper needs real tensors, and the whole model gets memory first."""
        return topo.size(DP_CP) == 1

    def compile_refusal(self) -> str | None:
        """Why this strategy's steps cannot run compiled blocks (``compile=True``), or None where they can."""
        return None

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Reject, before any process starts, an optimizer this strategy cannot drive."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(f"strategy {self.name!r} does not support torch.optim.LBFGS: it needs a closure that "
                             "re-evaluates the loss several times per step, which the Trainer's step does not provide")

    def check_model(self, model: nn.Module, devices: int, batch_size: int, accumulate_grad_batches: int,
                    backend: str = "gloo") -> None:
        """Reject (or warn about), before any process starts, a model or batch this layout cannot use well
        (``backend``: the process group's, "gloo" or "nccl")."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def clip_grad_value(self, model: nn.Module, optimizer: torch.optim.Optimizer, clip_value: float,
                        topo: Topology) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]``. Element-wise, so each rank clamps the
        gradients its ``optimizer`` steps (whole, slices or reduced pieces), once a sharded optimizer's owner has
        finished reducing them: the same elements one device would clamp."""
        inner: Any = optimizer
        while inner is not None and not hasattr(inner, "owner"):
            inner = getattr(inner, "optimizer", None)  # through the fp16 and other optimizer wrappers
        if inner is not None:
            inner.owner.before_step()  # reduce now: the clamp needs the averaged gradient
        torch.nn.utils.clip_grad_value_([p for g in optimizer.param_groups for p in g["params"]], clip_value)

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        """The unsharded state dict on CPU (a collective for sharded strategies)."""
        return {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}

    def final_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        """The unsharded state dict on rank 0 (an empty dict on the others), for a ``fit`` that started its ranks
        and returns rank 0's result: the whole model is copied once, not once per rank.

        A strategy whose :meth:`full_state_dict` is this class's copies a replica that every rank holds: only
        rank 0 copies it. One that overrides it gathers over a group, a collective every rank joins; the others
        drop their copy at once. A strategy that can gather to one rank only overrides this (FSDP)."""
        if type(self).full_state_dict is Strategy.full_state_dict:
            return self.full_state_dict(model, topo) if topo.rank == 0 else {}
        full = self.full_state_dict(model, topo)
        return full if topo.rank == 0 else {}

    def checkpoint_held(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology) -> list[Held]:
        """What this rank holds of every tensor of the layout-free checkpoint (see :mod:`shardwise.checkpoint.pieces`).

        Keys are ``model.<fqn>`` (parameters and persistent buffers, named as in
        the unsplit model) and ``optim.<fqn>.<state>`` (e.g.
        ``optim.net.0.weight.exp_avg``). Every tensor is a view of live storage,
        so a load (in place) restores the run; optimizer states must exist (see
        :func:`shardwise.checkpoint.materialize`). The default covers a model
        whose tensors are whole or tensor-parallel slices, wrapped (or not) by
        one data-parallel wrapper that reports its shards (``checkpoint_parts``).
        """
        return held_state(named_state(unwrap(model)), [model], optimizer)

    def rank_stats(self, model: nn.Module, topo: Topology) -> dict[str, Any]:
        """Extra per-rank entries for ``FitResult.stats`` (a parameter server's staleness record, a replica's
        failures under fault tolerance)."""
        return {}

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank holds for the model state, by kind, for exact byte accounting.

        A data-parallel wrapper reports its own (``model_state_tensors``: flat
        buckets, shard rows, host copies); the optimizer's states are added here.
        """
        return with_optimizer_states(model_state_tensors(model), optimizer)


# ---- capabilities: what the Trainer and the checks ask a strategy with isinstance, never by its name ----
class SplitsModel:
    """The model is cut into parts that run one after another (pipeline stages, naive model parallelism):
    the input reaches the first part only, as one positional tensor, so keyword (dict) inputs do not fit."""

    split_points: list[str] | None = None  # names of the layers where parts 1.. begin (None: balanced)


class OwnDevices:
    """One process drives several devices that the strategy lists itself (naive model parallelism):
    ``devices=1`` is not "nothing split" for it."""


class HasTPPlan:
    """Splits layers over a tensor-parallel group by a plan: ``tp_plan`` is a module-pattern -> style dict,
    a :class:`~shardwise.parallel.tp.plans.Plan`, a built-in name, or None (the plan for the model type)."""

    def tensor_parallel_plan(self) -> Any:
        raise NotImplementedError


class HasServers(Strategy):
    """A strategy some of whose ranks serve instead of training (the parameter server).

    Only such strategies carry a server loop; the trainer asks
    ``isinstance(strategy, HasServers)`` before calling it.
    """

    def is_server(self, topo: Topology) -> bool:
        """True on ranks that read no data and run :meth:`serve` instead of the step loop."""
        return False

    def serve(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology, steps: int) -> list[float]:
        """The loop of a server rank for ``steps`` optimizer steps; returns per-step times (seconds)."""
        raise NotImplementedError



def compile_backend(strategy: Strategy, compile: bool | str) -> str | None:
    """The ``torch.compile`` backend of the option ``compile`` (None: eager), refused with the strategy's reason
    where its steps cannot run compiled blocks (the Trainer's and ``sw.setup``'s check, before anything runs)."""
    backend = backend_of(compile)
    why = strategy.compile_refusal() if backend is not None else None
    if why is not None:
        raise ValueError(f"compile={compile!r} cannot run with strategy {strategy.name!r}: {why}")
    return backend
