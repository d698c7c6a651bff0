"""Parameter groups that mean the same under every strategy.

An optimizer factory receives the parameters a rank holds. Under ZeRO and FSDP
those are flat 1-D shards, under tensor parallelism slices, so a factory that
groups by ``p.dim()`` or ``p.shape`` (nanoGPT's ``configure_optimizers``,
"no weight decay on biases and norms") would see other tensors than on one
device and build other groups. The groups are therefore decided once, on the
unsplit model:

* :func:`plan_groups` calls the factory (or ``param_groups(model)`` first) on
  *twins* of the model's parameters: tensors of the same shape, dtype and
  ``requires_grad`` that hold no memory and that the factory cannot reach by any
  other way, and reads which parameter went to which group and each group's
  hyperparameters (a :class:`GroupPlan`). A factory that built its optimizer
  over other tensors (``functools.partial(configure, model)`` building over
  ``model.parameters()``) is refused there, before any process starts.
* On each rank, :class:`GroupedFactory` stands in for the factory: the strategy
  calls it with what the rank holds, as before; once the strategy is set up it
  names each of those tensors as in the unsplit model
  (:meth:`shardwise.strategies.base.Strategy.param_names`) and puts it in its
  parameter's group with that group's hyperparameters. A group this rank holds
  nothing of stays, empty, so that schedulers and loops that set one value per
  group see the same groups on every rank.

Optimizers whose update depends on a parameter's shape (Adafactor's factored
second moment, Muon's orthogonalised matrix, LAMB/LARS trust ratios, Shampoo's
preconditioners) would run other maths on shards or slices: :func:`needs_whole`
knows them, and :func:`check_whole` refuses them where a strategy splits
parameters.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from shardwise.layout import RunLayout

ParamGroupsFn = Callable[[nn.Module], Sequence[dict[str, Any]]]
"""``fit(param_groups=fn)``: ``fn(model)`` returns torch's list of group dicts over the bare model's parameters
(or their names), e.g. no weight decay for biases and norms, a lower lr for the embeddings."""

# Class names (anywhere in the optimizer's MRO) of optimizers whose update of a parameter depends on its whole
# shape. An optimizer of one's own declares either way with the class attribute ``needs_whole_parameters``.
SHAPE_DEPENDENT = frozenset({"Adafactor", "Muon", "LAMB", "Lamb", "FusedLAMB", "LARS", "Lars", "Shampoo",
                             "DistributedShampoo", "SOAP"})

# Keys of a group dict that are not hyperparameters: the tensors, and torch's optional names of them.
_NOT_HYPER = ("params", "param_names")


def ignored_params_message(optimizer: torch.optim.Optimizer) -> str:
    return (f"the optimizer factory built {type(optimizer).__name__} over parameters it was not given: each rank "
            "calls the factory with the parameters (or shards) it holds, and an optimizer over other tensors (e.g. "
            "model.parameters() of a model captured by functools.partial) would step tensors that never receive "
            "this run's gradients. Build the optimizer from the parameters the factory receives, e.g. "
            "def configure(params): return torch.optim.AdamW(params, lr=1e-3); for per-parameter settings pass "
            "param_groups=fn to fit or sw.setup")


def needs_whole(optimizer: torch.optim.Optimizer | type) -> bool:
    """Whether ``optimizer`` (or its class) computes a parameter's update from the parameter's whole shape."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    declared = getattr(cls, "needs_whole_parameters", None)
    if declared is not None:
        return bool(declared)
    return any(c.__name__ in SHAPE_DEPENDENT for c in cls.__mro__)


def check_whole(optimizer: torch.optim.Optimizer, strategy: str, splits: str | None) -> None:
    """Refuse a shape-dependent optimizer under a strategy that gives it ``splits`` (None: whole parameters)."""
    if splits is None or not needs_whole(optimizer):
        return
    raise ValueError(f"{type(optimizer).__name__} computes each parameter's update from its whole shape, but "
                     f"strategy {strategy!r} gives the optimizer {splits}, so it would run other maths than one "
                     "device; use a strategy that keeps parameters whole ('ddp', 'dp', 'pp', or sw.Parallel without "
                     "zero and tp), or an element-wise optimizer such as AdamW (an optimizer of your own that is "
                     "element-wise says so with the class attribute needs_whole_parameters = False)")


def splits_parameters(layout: RunLayout) -> str | None:
    """What the optimizer of a rank steps instead of whole parameters under ``layout`` (None: whole ones)."""
    if layout.servers:
        return "one flat range of every parameter per server"
    if layout.zero:
        return "flat 1-D shards of the parameters (ZeRO/FSDP)"
    if layout.tp > 1:
        return "tensor-parallel slices of the parameters"
    return None


@dataclass(frozen=True)
class GroupPlan:
    """Which parameter (by its name in the unsplit model) is in which group, and every group's hyperparameters,
    as the optimizer factory built them on one device."""

    names: tuple[tuple[str, ...], ...]
    hyper: tuple[dict[str, Any], ...]
    index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", {n: i for i, names in enumerate(self.names) for n in names})

    def record(self) -> list[dict[str, Any]]:
        """The plan as JSON values, for a checkpoint's run record: each group's parameter names and settings."""
        return [{"params": list(n), "hyper": json_hyper(h)} for n, h in zip(self.names, self.hyper)]

    def distinct(self) -> int:
        """How many different settings the non-empty groups have."""
        shown = {repr(sorted(json_hyper(h).items())) for n, h in zip(self.names, self.hyper) if n}
        return len(shown)


def json_hyper(hyper: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters that JSON holds exactly (numbers, strings, flags, tuples of numbers), tensors as floats."""
    out: dict[str, Any] = {}
    for k, v in hyper.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (tuple, list)):
            if k not in _NOT_HYPER and all(isinstance(x, (int, float)) for x in v):
                out[k] = list(v)
        elif v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
            out[k] = v
    return out


def _twin(p: torch.Tensor) -> nn.Parameter:
    """A parameter of ``p``'s shape and dtype on the CPU that holds one element (a zero-stride view)."""
    floating = p.is_floating_point() or p.is_complex()
    return nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=p.requires_grad and floating)


def _as_twin_groups(groups: Sequence[dict[str, Any]], twin_of: dict[int, nn.Parameter],
                    by_name: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    out = []
    if isinstance(groups, dict) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise TypeError("param_groups(model) must return a list of dicts, each with a 'params' list of the model's "
                        "parameters (or their names) and the group's settings, e.g. [{'params': decay, "
                        "'weight_decay': 0.1}, {'params': no_decay, 'weight_decay': 0.0}]")
    for g in groups:
        items = [g["params"]] if isinstance(g["params"], (torch.Tensor, str)) else list(g["params"])
        params = []
        for p in items:
            t = by_name.get(p) if isinstance(p, str) else p
            if t is None or id(t) not in twin_of:
                raise ValueError(f"param_groups(model) returned {p if isinstance(p, str) else 'a tensor'!r}, which "
                                 "is not a parameter of the model; build the groups from model.named_parameters()")
            params.append(twin_of[id(t)])
        out.append({**{k: v for k, v in g.items() if k not in _NOT_HYPER}, "params": params})
    return out


def plan_groups(model: nn.Module, factory: Callable[..., Any], param_groups: ParamGroupsFn | None = None
                ) -> tuple[GroupPlan, torch.optim.Optimizer]:
    """The groups ``factory`` builds over ``model``'s parameters (after ``param_groups(model)`` when given), and
    the optimizer it built over their twins (a probe for the other checks: its class, its defaults).

    Raises when the factory's optimizer holds tensors it was not given, or leaves out trainable ones.
    """
    named = list(model.named_parameters())
    twin_of = {id(p): _twin(p) for _, p in named}
    name_of = {id(twin_of[id(p)]): n for n, p in named}
    given: Any = [twin_of[id(p)] for _, p in named]
    if param_groups is not None:
        given = _as_twin_groups(param_groups(model), twin_of, dict(named))
    probe = factory(given)
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError("optimizer must be a factory that returns a torch.optim.Optimizer when called with "
                        "parameters, e.g. functools.partial(torch.optim.AdamW, lr=1e-3); got "
                        f"{type(probe).__name__}")
    hyper = tuple({k: copy.deepcopy(v) for k, v in g.items() if k not in _NOT_HYPER} for g in probe.param_groups)
    names = tuple(tuple(name_of[id(p)] for p in g["params"] if id(p) in name_of) for g in probe.param_groups)
    offered = given if param_groups is None else [p for g in given for p in g["params"]]
    check_exact(probe, offered)
    return GroupPlan(names, hyper), probe


def check_exact(optimizer: torch.optim.Optimizer, given: Iterable[torch.Tensor]) -> None:
    """The optimizer holds only tensors it was given, and every trainable one of them."""
    offered = {id(p): p for p in given}
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if held - set(offered):
        raise ValueError(ignored_params_message(optimizer))
    left = [p for i, p in offered.items() if i not in held and p.requires_grad]
    if left:
        raise ValueError(f"the optimizer factory left out {len(left)} trainable parameter(s) of the "
                         f"{len(offered)} it was given: they would never be updated; give the optimizer every "
                         "parameter it receives (set requires_grad=False on those to freeze, or use "
                         "param_groups=fn to choose the groups)")


def named_params(named: Iterable[tuple[str, torch.Tensor]], wrappers: Iterable[nn.Module] = ()) -> dict[int, str]:
    """``id(tensor) -> name`` in the unsplit model: ``named``'s tensors (the first name of a tied one) and the
    shards that data-parallel wrappers among ``wrappers`` hand the optimizer (``shard_sources``)."""
    names: dict[int, str] = {}
    for n, t in named:
        names.setdefault(id(t), n)
    for w in wrappers:
        sources = getattr(w, "shard_sources", None)
        for shard, p in (sources() if sources is not None else {}).items():
            if id(p) in names:
                names[id(shard)] = names[id(p)]
    return names


class GroupedFactory:
    """The factory a rank's strategy calls: the user's factory, then its optimizer regrouped by the plan.

    The strategy calls it with the tensors the rank holds (the user's factory sees exactly those);
    :meth:`finish`, once the strategy named them, puts each in its parameter's group of the plan.
    """

    def __init__(self, factory: Callable[..., torch.optim.Optimizer], plan: GroupPlan | None) -> None:
        self.factory = factory
        self.plan = plan
        self.built: list[tuple[list[torch.Tensor], torch.optim.Optimizer]] = []

    def __call__(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        given = list(params)
        optimizer = self.factory(given)
        check_exact(optimizer, given)
        self.built.append((given, optimizer))
        return optimizer

    def finish(self, names: dict[int, str]) -> None:
        """Regroup every optimizer built here by the plan (``names``: this rank's tensors named as unsplit)."""
        if self.plan is None:
            return
        for given, optimizer in self.built:
            regroup(optimizer, given, names, self.plan)


def regroup(optimizer: torch.optim.Optimizer, given: Sequence[torch.Tensor], names: dict[int, str],
            plan: GroupPlan) -> None:
    """Replace ``optimizer``'s groups by the plan's, each holding the ``given`` tensors of its parameters."""
    groups: list[dict[str, Any]] = [{**copy.deepcopy(h), "params": []} for h in plan.hyper]
    for p in given:
        name = names.get(id(p))
        if name is None:
            raise RuntimeError("internal: a tensor the strategy gave the optimizer has no name in the unsplit model, "
                               "so its parameter group is unknown")
        if name in plan.index:  # else the factory left it out on one device too (a frozen parameter)
            groups[plan.index[name]]["params"].append(p)
    optimizer.param_groups.clear()
    for g in groups:
        optimizer.add_param_group(g)


def apply_hyper(optimizer: torch.optim.Optimizer, saved: Sequence[dict[str, Any]]) -> None:
    """Set each group's saved hyperparameters (a resumed run's learning rates...)."""
    for g, values in zip(optimizer.param_groups, saved):
        for k, v in values.items():
            if k in g and k != "initial_lr":  # initial_lr: the scheduler's own, set when it is built
                g[k] = type(g[k])(v) if isinstance(g[k], tuple) else _like(g[k], v)


def _like(current: Any, value: Any) -> Any:
    if isinstance(current, torch.Tensor):
        return torch.as_tensor(value, dtype=current.dtype, device=current.device)
    return value


__all__ = ["GroupPlan", "GroupedFactory", "ParamGroupsFn", "SHAPE_DEPENDENT", "apply_hyper", "check_exact",
           "check_whole", "ignored_params_message", "json_hyper", "named_params", "needs_whole", "plan_groups",
           "regroup", "splits_parameters"]
