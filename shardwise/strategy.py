"""Strategy names and objects -> how a model is set up, stepped and gathered.

A strategy object carries its parameters (``sw.DDP(bucket_cap_mb=25)``); a
name (``"ddp"``) is looked up in :data:`REGISTRY`. Each strategy decides three
things the trainer does not: the parallel sizes for a device count, how to
wrap the model and optimizer on a :class:`~shardwise.topology.Topology`, and
how one optimizer step's forward/backward runs (pipelines schedule their own).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from shardwise.layout import RunLayout
from shardwise.precision import widened
from shardwise.topology import Topology

if TYPE_CHECKING:  # the checkpoint machinery (torch.distributed.checkpoint) loads only when a checkpoint is made
    from shardwise.pieces import Held

OptimizerFactory = Callable[..., torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


@dataclass(frozen=True)
class StepRun:
    """What the run, not the strategy, decides about one step: passed in, never stored in a strategy.

    ``precision``: autocast for forward and loss (backward runs outside it);
    ``loss_scale``: the fp16 loss scaler's current factor (1 otherwise).
    """

    precision: str = "32"
    loss_scale: float = 1.0

    def forward_context(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        from shardwise.precision import autocast

        return autocast(self.precision, device)


class Strategy:
    """Base class: a single replica on one device; subclasses override what they change.

    A strategy object holds only its own options: the run's state (precision,
    the loss scale) reaches :meth:`train_step` as a :class:`StepRun`.
    """

    name: ClassVar[str] = "single"

    def sizes(self, devices: int) -> dict[str, int]:
        """Parallel sizes (dp, tp, pp) for ``devices`` processes."""
        return {"dp": devices, "tp": 1, "pp": 1}

    def describe(self, devices: int) -> RunLayout:
        """The whole layout this strategy builds on ``devices`` (for the planner); subclasses add their options."""
        s = self.sizes(devices)
        return RunLayout(self.name, s["dp"], s["tp"], s["pp"])

    def processes(self, devices: int) -> int:
        """How many processes to start for ``devices`` (1 for single-process strategies)."""
        return devices

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = model.to(topo.device)
        return model, optimizer_fn(model.parameters())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Suppress gradient communication for a non-final micro-batch: the wrapper's own
        ``no_sync`` (DDP, ZeRO-1/2, FSDP); nothing for models that communicate no gradients."""
        from shardwise.parallel.ddp import GradSync

        return model.no_sync() if isinstance(model, GradSync) else contextlib.nullcontext()

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        """Forward and backward over the micro-batches of one step; returns this rank's mean loss.

        Each micro-batch's loss is divided by their count, so the accumulated
        gradient is that of the mean over the whole (local) batch.
        """
        k = len(micro_batches)
        total: torch.Tensor | float = 0.0
        for i, (x, y) in enumerate(micro_batches):
            ctx = self.no_sync(model) if i < k - 1 else contextlib.nullcontext()
            with ctx:
                with run.forward_context(topo.device):
                    loss = loss_fn(call_model(model, x), y)
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
        from shardwise.data import leaves, to_device

        with torch.no_grad(), run.forward_context(topo.device):
            out = call_model(model, x)
            where = next(iter(leaves(out)), None)  # the output's device (naive model parallelism: the last one)
            return fn(out, to_device(y, where.device) if where is not None else y)

    def owns_loss(self, topo: Topology) -> bool:
        """Whether this rank's loss counts in the global mean (one per data-parallel replica)."""
        return True

    def data_parallel(self, topo: Topology) -> tuple[int, int]:
        """(number of data shards, this rank's shard): which part of each global batch this rank reads."""
        return topo.size("dp"), topo.coord("dp")

    def batch_shards(self, devices: int) -> int:
        """How many parts each global batch is split into on ``devices`` (the ranks that read data)."""
        return self.sizes(devices)["dp"]

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Reject, before any process starts, an optimizer this strategy cannot drive."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(f"strategy {self.name!r} does not support torch.optim.LBFGS: it needs a closure that "
                             "re-evaluates the loss several times per step, which the Trainer's step does not provide")

    def check_model(self, model: nn.Module, devices: int, batch_size: int, accumulate_grad_batches: int) -> None:
        """Reject (or warn about), before any process starts, a model or batch this layout cannot use well."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        """The unsharded state dict on CPU (a collective for sharded strategies)."""
        return {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}

    def checkpoint_held(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology) -> list[Held]:
        """What this rank holds of every tensor of the layout-free checkpoint (see :mod:`shardwise.pieces`).

        Keys are ``model.<fqn>`` (parameters and persistent buffers, named as in
        the unsplit model) and ``optim.<fqn>.<state>`` (e.g.
        ``optim.net.0.weight.exp_avg``). Every tensor is a view of live storage,
        so a load (in place) restores the run; optimizer states must exist (see
        :func:`shardwise.checkpoint.materialize`). The default covers a model
        whose tensors are whole or tensor-parallel slices, wrapped (or not) by
        one data-parallel wrapper that reports its shards (``checkpoint_parts``).
        """
        return held_state(named_state(unwrap(model)), [model], optimizer)

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank holds for the model state, by kind, for exact byte accounting.

        A data-parallel wrapper reports its own (``model_state_tensors``: flat
        buckets, shard rows, host copies); the optimizer's states are added here.
        """
        return with_optimizer_states(model_state_tensors(model), optimizer)


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

    def rank_stats(self, model: nn.Module, topo: Topology) -> dict[str, Any]:
        """Extra per-rank entries for ``FitResult.stats`` (e.g. a parameter server's staleness record)."""
        return {}


@dataclass
class Single(Strategy):
    """One process, one device: the reference every other strategy must equal."""

    name: ClassVar[str] = "single"

    def sizes(self, devices: int) -> dict[str, int]:
        if devices != 1:
            raise ValueError(f"strategy 'single' runs on exactly one device, got devices={devices}")
        return {"dp": 1, "tp": 1, "pp": 1}


@dataclass
class DDP(Strategy):
    """Our distributed data parallel (see :mod:`shardwise.parallel.ddp`)."""

    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    allreduce: str = "native"
    reduce_dtype: str | None = None  # e.g. "bfloat16": gradients travel in this dtype
    name: ClassVar[str] = "ddp"

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        from shardwise.parallelize import DataParallelOptions, wrap_module

        model = model.to(topo.device)
        opts = DataParallelOptions(zero=0, bucket_cap_mb=self.bucket_cap_mb,
                                   find_unused_parameters=self.find_unused_parameters,
                                   allreduce=allreduce_fn(self.allreduce),
                                   reduce_dtype=getattr(torch, self.reduce_dtype) if self.reduce_dtype else None)
        return wrap_module(model, topo, opts), optimizer_fn(model.parameters())


def allreduce_fn(name: str) -> Callable[..., Any]:
    """DDP's all-reduce algorithm by name: ``"native"`` (the backend's), ``"naive"`` or ``"ring"``."""
    from shardwise.comm.algorithms import ALGORITHMS
    from shardwise.parallel.ddp import native_allreduce

    table = {"native": native_allreduce, **ALGORITHMS}
    if name not in table:
        raise ValueError(f"unknown all-reduce algorithm {name!r}; valid: {sorted(table)}")
    return table[name]


# Built-in strategies live with their paradigm in shardwise/parallel/ and are
# imported only when named, so that the core never imports every paradigm.
BUILTIN: dict[str, str] = {
    "single": "shardwise.strategy:Single",
    "ddp": "shardwise.strategy:DDP",
    "dp": "shardwise.parallel.dp:DP",
    "ps": "shardwise.parallel.ps:ParameterServer",
    "zero1": "shardwise.parallel.zero:ZeRO1",
    "zero2": "shardwise.parallel.zero:ZeRO2",
    "zero3": "shardwise.parallel.fsdp:ZeRO3",
    "fsdp": "shardwise.parallel.fsdp:FSDP",
    "hsdp": "shardwise.parallel.fsdp:HSDP",
    "tp": "shardwise.parallel.tp:TP",
    "pp": "shardwise.parallel.compose:PP",
    "parallel": "shardwise.parallel.compose:Parallel",
}
# Strategy classes reachable as ``sw.<Name>`` without a name of their own in BUILTIN.
CLASSES: dict[str, str] = {
    **{target.partition(":")[2]: target for target in BUILTIN.values()},
    "NaiveMP": "shardwise.parallel.naive_mp:NaiveMP",
    "NaiveModelParallel": "shardwise.parallel.naive_mp:NaiveModelParallel",
}
REGISTRY: dict[str, Callable[[], Strategy]] = {}


def register(name: str, factory: Callable[[], Strategy]) -> None:
    """Make ``name`` a valid ``strategy=`` string (for user-defined strategies)."""
    REGISTRY[name] = factory


def load(target: str) -> Any:
    """``"module:Attr"`` imported. An ImportError inside a strategy's module propagates with its traceback:
    it is a broken installation or a bug, not an unknown strategy."""
    import importlib

    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _load_builtin(name: str) -> Callable[[], Strategy]:
    return load(BUILTIN[name])  # type: ignore[no-any-return]


def available_strategies() -> list[str]:
    """Every name ``strategy=`` accepts, in the order of the table in DESIGN.md, then registered ones."""
    return list(BUILTIN) + [n for n in REGISTRY if n not in BUILTIN]


def resolve(strategy: str | Strategy) -> Strategy:
    """A strategy object for a name or an object; unknown names list the valid ones."""
    if isinstance(strategy, Strategy):
        return strategy
    factory = None
    if isinstance(strategy, str):
        factory = REGISTRY.get(strategy) or (_load_builtin(strategy) if strategy in BUILTIN else None)
    if factory is None:
        raise ValueError(f"unknown strategy {strategy!r}; valid strategies: {', '.join(available_strategies())}")
    return factory()


def model_state_tensors(module: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Parameter and gradient tensors ``module`` holds: its wrapper's account, or its parameters and ``.grad``."""
    if hasattr(module, "model_state_tensors"):
        return module.model_state_tensors()  # type: ignore[no-any-return,operator]
    params = list(module.parameters())
    return {"params": params, "grads": [p.grad for p in params if p.grad is not None]}


def with_optimizer_states(parts: dict[str, list[torch.Tensor]],
                          optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """``parts`` plus the optimizer's state tensors (host memory when the wrapper offloads)."""
    out: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "optimizer": []}
    for k, v in parts.items():
        out.setdefault(k, []).extend(v)
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out.setdefault("host_optimizer" if "host_params" in out else "optimizer", []).extend(states)
    return out


def first_named(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of ``named`` once, under the first name it comes with (a tied weight's saved name)."""
    seen: set[int] = set()
    out = []
    for k, v in named:
        if id(v) not in seen:
            seen.add(id(v))
            out.append((k, v))
    return out


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s state-dict tensors (parameters, persistent buffers) once each, under their first name
    (a tied weight is saved once; its other names are aliases, see :func:`shardwise.checkpoint.model_shapes`)."""
    return first_named(module.state_dict(keep_vars=True).items())


def held_state(named: Sequence[tuple[str, torch.Tensor]], wrappers: Sequence[nn.Module],
               optimizer: torch.optim.Optimizer) -> list[Held]:
    """:class:`~shardwise.pieces.Held` entries for the tensors ``named`` (names of the unsplit model).

    A data-parallel wrapper among ``wrappers`` that shards a parameter reports
    its parts (``checkpoint_parts(optimizer)``: per parameter, ``(what, start,
    1-D view)`` with ``what`` ``"param"`` or an optimizer state's name); every
    other tensor is whole on this rank, its optimizer states keyed by the
    parameter itself. Tensor-parallel slices carry their ``tp_spec``.
    """
    from shardwise.parallel.tp import tp_spec
    from shardwise.pieces import Held

    parts: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
    for w in wrappers:
        if hasattr(w, "checkpoint_parts"):
            parts.update({id(p): got for p, got in w.checkpoint_parts(optimizer).items()})
    out: list[Held] = []
    for name, t in named:
        spec = tp_spec(t)
        got = parts.get(id(t))
        states: list[tuple[str, int, torch.Tensor]] = got if got is not None else \
            [(k, 0, v) for k, v in optimizer.state.get(t, {}).items() if isinstance(v, torch.Tensor)]
        if not any(what == "param" for what, _, _ in states):
            out.append(Held(f"model.{name}", t.detach(), 0, spec))
        for what, start, v in states:
            key = f"model.{name}" if what == "param" else f"optim.{name}.{what}"
            out.append(Held(key, v, start, spec if v.dim() > 0 else None))
    return out


def call_model(model: nn.Module, x: Any) -> Any:
    """``model(x)``, or ``model(**x)`` for the keyword inputs of a dict batch (:class:`shardwise.data.Kwargs`)."""
    from shardwise.data import Kwargs

    return model(**x) if isinstance(x, Kwargs) else model(x)


def iter_chunks(x: Any, k: int) -> Iterator[Any]:
    """Split a batch (tensor or tuple/dict of tensors) into ``k`` equal micro-batches along dim 0."""
    if isinstance(x, torch.Tensor):
        yield from x.chunk(k)
    elif isinstance(x, (list, tuple)) and x and all(isinstance(v, (str, bytes, int, float)) for v in x):
        n = -(-len(x) // k)  # a collated list of plain values (the strings of a dict batch): split like a tensor
        yield from (x[i:i + n] for i in range(0, len(x), n))
    elif isinstance(x, (list, tuple)):
        for parts in zip(*(list(iter_chunks(v, k)) for v in x)):
            yield type(x)(parts) if isinstance(x, tuple) else list(parts)
    elif isinstance(x, dict):
        from shardwise.data import Kwargs

        keys = list(x)
        for parts in zip(*(list(iter_chunks(x[kk], k)) for kk in keys)):
            yield Kwargs(zip(keys, parts)) if isinstance(x, Kwargs) else dict(zip(keys, parts))
    else:
        raise TypeError(f"cannot split a batch of type {type(x).__name__} into micro-batches")
