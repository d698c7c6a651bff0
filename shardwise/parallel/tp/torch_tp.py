"""PyTorch's tensor parallelism (DTensor ``parallelize_module``) driven by our tensor-parallel plans.

``engine="torch"`` runs ``strategy="tp"`` (and ``sw.Parallel(tp=..., sequence_parallel=...)``) with torch's
styles, derived from the same :class:`~shardwise.parallel.tp.plans.Plan` our layers use, so one plan says
what is split for both engines:

=====================  ==================================================  ===============================
our style              torch's style                                       with ``sequence_parallel``
=====================  ==================================================  ===============================
``colwise``            ``ColwiseParallel()``                               the same (its input is gathered
                                                                           at the attention / MLP)
``rowwise``            ``RowwiseParallel()``                               ``output_layouts=Shard(1)``
``vocab`` (embedding)  ``RowwiseParallel(input_layouts=Replicate())``      ``output_layouts=Shard(1)``
``colwise_gather``     ``ColwiseParallel(output_layouts=Replicate())``     ``input_layouts=Shard(1)``
=====================  ==================================================  ===============================

Under ``sequence_parallel`` the plan's :class:`~shardwise.parallel.tp.plans.SequenceLayout` places the rest:
its norms run ``SequenceParallel()``, its attention and MLP modules all-gather their input along the sequence
(``PrepareModuleInput``), and its position embeddings' output is cut to this rank's rows (``PrepareModuleOutput``).

Sliced parameters become DTensors on the tp mesh (``Shard(0)`` or ``Shard(1)``, in ``torch.chunk`` pieces,
which equal our slices since the plans' checks make every split even); the others stay plain tensors.
:func:`torch_plan_refusal` says which plans torch's styles cannot express (:func:`refuse_plan` refuses them before
any process starts), and :func:`refuse_ddp_over_tp` why tp's DTensors go under FSDP2 over dp, never torch's DDP.
"""
from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardwise.comm import Comm
from shardwise.comm.topology import Topology
from shardwise.dims import TP
from shardwise.parallel.clip import clip_coefficient
from shardwise.parallel.dtensor import full, local
from shardwise.parallel.tp.plans import Plan, as_style, module_pattern


def tp_mesh(topo: Topology) -> DeviceMesh:
    """The 1-D mesh over ``topo``'s tensor-parallel ranks (a mesh of one in a process group of one)."""
    if topo.mesh is None:
        return init_device_mesh(topo.device.type, (1,), mesh_dim_names=(TP,))
    return topo.mesh[TP]


def torch_plan_refusal(plan: Plan, sequence_parallel: bool) -> str | None:
    """Why torch's styles cannot run ``plan`` (None: they can)."""
    if plan.fixup is not None or plan.local_attrs:
        return (f"the '{plan.name}' plan adjusts module attributes to the local widths (fixup, local_attrs), "
                "which torch's styles do not")
    if any(as_style(s).parts > 1 for s in plan.styles.values()):
        return (f"the '{plan.name}' plan splits a fused projection piece by piece (parts > 1), which torch's "
                "styles do not")
    seq = plan.sequence
    if sequence_parallel and seq is not None and (seq.scatter_inputs or not seq.exit_to_head):
        return (f"the '{plan.name}' plan's sequence-parallel region starts at a block's input or ends without a "
                "head; engine='torch' runs it only from the embeddings to the head (shardwise's GPT)")
    return None


def refuse_plan(name: str, plan: Plan, model: nn.Module, sequence_parallel: bool) -> None:
    """Refuse strategy ``name``'s ``plan`` on ``model`` where torch's styles cannot run it
    (:func:`torch_plan_refusal`)."""
    why = torch_plan_refusal(plan, sequence_parallel)
    if why is not None:
        raise ValueError(f"engine='torch' cannot run strategy {name!r} on {type(model).__name__}: {why}; "
                         "engine='shardwise' runs it")


def refuse_ddp_over_tp(name: str, dp: int, tp: int, zero: int) -> None:
    """Refuse dp > 1 over tp > 1 with torch's DDP (zero=0) or ZeroRedundancyOptimizer under it (zero=1): the
    data-parallel engine over tp's DTensors is FSDP2 alone. Given the run's sizes, since Parallel's dp=-1 can
    leave ranks over for dp, which only the devices tell."""
    if dp > 1 and tp > 1 and zero in (0, 1):
        raise ValueError(f"engine='torch' runs strategy {name!r} with dp > 1 over tp > 1 only with zero=2 or 3 (tp, "
                         f"then FSDP2 over dp), not zero={zero}: torch's DDP refuses tp's DTensor parameters over a "
                         "process group (c10d.broadcast_ has no DTensor sharding strategy), and over a device mesh "
                         "turns them into plain local tensors (torch's interim DDP + tp transform), which hides "
                         "their tp layout from the checkpoint and the clip; engine='shardwise' runs it")


def torch_plan(plan: Plan, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """``plan`` as ``parallelize_module``'s plan (its ``*`` matches one name segment, as ours does)."""
    out = {pattern: _style(as_style(s).kind, as_style(s).gather_output, sequence_parallel)
           for pattern, s in plan.styles.items()}
    if sequence_parallel and plan.sequence is not None:
        seq = plan.sequence
        out.update({n: SequenceParallel() for n in (*seq.norms, seq.exit)})
        out.update({n: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                    for n in seq.gather})
        # A position table's output (T, H) keeps this rank's rows, the tokens it holds.
        out.update({n: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
                    for n in seq.scatter_outputs})
    return out


def _style(kind: str, gather_output: bool, sequence_parallel: bool) -> ParallelStyle:
    seq = Shard(1) if sequence_parallel else Replicate()  # the layout of the activations between the pairs
    if kind == "rowwise":
        return RowwiseParallel(output_layouts=seq)
    if kind == "vocab":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if gather_output:
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    return ColwiseParallel()


def apply_torch_tp(model: nn.Module, plan: Plan, mesh: DeviceMesh, sequence_parallel: bool,
                   keep: Callable[[str], bool] | None = None) -> nn.Module:
    """``parallelize_module`` with ``plan``'s styles, in place; weights tied in ``model`` stay tied. ``keep(name)``
    limits it to some modules (a pipeline stage's own, :func:`~shardwise.parallel.pp.build.build_pipeline`'s
    transform); a tie stays only between two kept modules (another stage's copy is that stage's)."""
    styles = torch_plan(plan, sequence_parallel)
    if keep is not None:  # the patterns spelled out as this stage's module names
        styles = {n: style for pattern, style in styles.items() for n, _ in model.named_modules()
                  if module_pattern(pattern).match(n) and keep(n)}
    ties = [(a, f) for a, f in _ties(model)
            if keep is None or (keep(a.rpartition(".")[0]) and keep(f.rpartition(".")[0]))]
    parallelize_module(model, mesh, styles)
    for alias, first in ties:
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    return model


def _ties(model: nn.Module) -> list[tuple[str, str]]:
    """(alias, first name) of every parameter reachable under two names."""
    first: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        first.setdefault(id(p), name)
    return out


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, elsewhere: Collection[int] = (),
                    across: Comm | None = None) -> torch.Tensor:
    """Clip by the global norm of gradients that are partly DTensors (tp slices, FSDP2 shards: each counted
    whole over its mesh) and partly plain, replicated tensors (torch's clip cannot stack the two kinds); torch's
    formula, so the same numbers. A pipeline stage's rank holds some of the model: ``across`` (pp) sums the
    squares of the stages, and a tied copy whose norm another copy counts (``id`` in ``elsewhere``) is left
    out of the sum, though clipped."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = [full(torch.linalg.vector_norm(p.grad)) ** 2 for p in params
               if p.grad is not None and id(p) not in elsewhere]
    sq = torch.stack(squares).sum() if squares else torch.zeros((), device=grads[0].device if grads else None)
    if across is not None and across.size > 1:
        across.all_reduce(sq, name="pp.clip")
    total = sq.sqrt()
    coef = clip_coefficient(total, max_norm)
    with torch.no_grad():
        for g in grads:
            local(g).mul_(coef)
    return total


def on_tp_mesh(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor on the tp mesh: a tp slice, or a norm's weight replicated over tp."""
    return isinstance(t, DTensor) and t.device_mesh.mesh_dim_names == (TP,)


def tp_slice(t: torch.Tensor) -> tuple[int, int] | None:
    """``(dim, 1)``, the :func:`~shardwise.parallel.tp.apply.tp_spec` form, of a DTensor sliced on ``dim`` over a tp
    mesh dimension (FSDP2's 2-D DTensors included); None for any other tensor."""
    names = (t.device_mesh.mesh_dim_names or ()) if isinstance(t, DTensor) else ()
    p = t.placements[names.index(TP)] if TP in names else None  # type: ignore[attr-defined]
    return (p.dim, 1) if isinstance(p, Shard) else None

__all__ = ["apply_torch_tp", "clip_grad_norm_", "on_tp_mesh", "refuse_ddp_over_tp", "refuse_plan", "torch_plan",
           "torch_plan_refusal", "tp_mesh", "tp_slice"]
