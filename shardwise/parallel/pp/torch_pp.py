"""PyTorch's own pipeline engine, ``torch.distributed.pipelining``, over the stages our pipeline cuts.

``engine="torch"`` (:class:`~shardwise.strategies.torch_engine.pipeline.TorchPP`) trains with it and
``shardwise bench`` races it against ours, so the construction is written once, here:

* :func:`torch_stage`: one ``PipelineStage`` over a stage module (the bench's whole-stage ``nn.Sequential``,
  or a chunk of our :class:`~shardwise.parallel.pp.build.PipelineModel`), on the pp group;
* :class:`TorchPipeline`: every chunk of a :class:`~shardwise.parallel.pp.build.PipelineModel` as a torch stage,
  run by torch's schedule for our schedule's name (:data:`TORCH_SCHEDULES`).
* :class:`StageDDP`: torch's DDP over dp for each stage (``sw.Parallel(pp=N, dp=M)``), its forwards under
  ``no_sync()`` as torch's stage expects (:func:`ddp_chunks`);
* :func:`fsdp_chunks`: FSDP2 over dp on each stage chunk instead (``sw.Parallel(pp=N, dp=M, zero=3)``), which
  torch's stage drives (gradients reduced once per step, after every backward);
* :func:`average_gradients`: under a zero-bubble schedule with ``zero=0``, the replicated chunks' gradients
  averaged over dp after the schedule (torch's stage would start DDP's reduction before the weight backwards).

The split (stage boundaries, tied weights, parameter names) stays ours: torch runs the forwards, backwards and
point-to-point sends of a step; the tied copies' gradients are then summed between their stages as under our
engine (:func:`~shardwise.parallel.pp.run.sync_ties`), since torch's pipelining has no notion of a weight
two stages share. The order around it (the split, tp on the stage's modules, then dp on each chunk) is
:mod:`shardwise.parallel.torch_parallelize`'s; what torch's schedules run stricter than ours is refused here
(:func:`refuse_schedule`), as is sequence parallelism in a pipeline (:data:`SP_IN_PIPELINE`).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.nn.parallel import DistributedDataParallel

from shardwise.comm.topology import Topology
from shardwise.dims import PP
from shardwise.parallel.dp.ddp import through_flat
from shardwise.parallel.dp.fsdp_units import unit_modules
from shardwise.parallel.dp.torch_dp import fully_shard_units, torch_ddp
from shardwise.parallel.pp.build import PipelineModel
from shardwise.parallel.pp.run import resplit, sync_ties
from shardwise.step import LossFn

# Our schedule's name -> torch's schedule on the same placement (gpipe, 1f1b, zb-h1: one stage per rank;
# interleaved: the loop c * p + r; zbv, dualpipev: the V, rank r holding stages r and 2p-1-r), with the same
# forwards and backwards in the same order (tests/bench/test_zb_pair.py, tests/parallel/pp/test_zero_bubble.py,
# tests/strategies/torch_engine/test_torch_engine_zb.py compare them). ScheduleInterleavedZeroBubble is the
# paper's ZB1P: given one stage per rank it runs ZB-H1's order. torch's DualPipeV and ZBV run DualPipe's and the
# paper's whole and split backwards where they have them; ours (zbv, dualpipev) run some more of them whole, the
# same actions.
TORCH_SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
# torch's looped schedules run the micro-batches in max(1, m // p) rounds of equal size and refuse an m the
# rounds do not divide (p = 2: m = 5, 7, 9, ...); our interleaved needs m % p == 0 anyway, our ZB-H1 has no rounds.
IN_ROUNDS = (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)
# Why torch's engines run no pipeline with sequence parallelism.
SP_IN_PIPELINE = ("torch's sequence-parallel styles for our plan hold the sequence region from the embedding to the "
                  "head within one module (shardwise.parallel.tp.torch_tp), and a pipeline stage holds only part of it")


def torch_schedule_refusal(schedule: str, stages: int, microbatches: int) -> str | None:
    """Why torch's schedule for ``schedule`` cannot run ``microbatches`` on ``stages`` ranks where ours can
    (None: it can)."""
    cls, rounds = TORCH_SCHEDULES[schedule], max(1, microbatches // stages)
    if cls not in IN_ROUNDS or microbatches % rounds == 0:
        return None
    return (f"torch's {cls.__name__} runs the micro-batches in max(1, m // p) = {rounds} rounds of equal size, "
            f"and microbatches={microbatches} does not split into {rounds}; use a multiple of the {stages} stages")


def refuse_schedule(name: str, schedule: str, stages: int, microbatches: int) -> None:
    """Refuse strategy ``name``'s ``schedule`` where torch's is stricter than ours (:func:`torch_schedule_refusal`)."""
    why = torch_schedule_refusal(schedule, stages, microbatches)
    if why is not None:
        raise ValueError(f"engine='torch' cannot run strategy {name!r} with schedule={schedule!r}: "
                         f"{why}; engine='shardwise' runs it")


def torch_stage(module: nn.Module, index: int, stages: int, topo: Topology,
                example: torch.Tensor | None = None) -> PipelineStage:
    """torch's ``PipelineStage`` for virtual stage ``index`` of ``stages`` over ``topo``'s pp group (``example``:
    a micro-batch input for its shapes; None: torch infers them on the first step)."""
    inputs = None if example is None else (example,)
    return PipelineStage(module, index, stages, topo.device, input_args=inputs, group=topo.group(PP))


def torch_schedule(schedule: str, stages: list[PipelineStage], microbatches: int,
                   loss_fn: Callable[[Any, Any], torch.Tensor]) -> _PipelineSchedule:
    """torch's schedule for our ``schedule`` name over this rank's ``stages`` (one: a single-stage schedule)."""
    cls = TORCH_SCHEDULES[schedule]
    return cls(stages[0] if len(stages) == 1 and cls in (ScheduleGPipe, Schedule1F1B) else stages,  # type: ignore[arg-type,misc]
               n_microbatches=microbatches, loss_fn=loss_fn)


class TorchPipeline:
    """This rank's chunks of a :class:`PipelineModel` as torch stages, run by torch's schedule for ``schedule``."""

    def __init__(self, pm: PipelineModel, topo: Topology, schedule: str,
                 data: Callable[[PipelineModel], list[nn.Module]] | None = None,
                 average_over: dist.ProcessGroup | None = None) -> None:
        """``data`` puts the chunks under a data-parallel engine over dp and returns the modules torch's stages
        run (:func:`ddp_chunks`: torch's DDP, whose reduction torch's stage starts in the last micro-batch's
        backward; :func:`fsdp_chunks`: FSDP2, reduced once all backwards ran); None: none. ``average_over``:
        the replicated chunks' gradients are averaged over that group after the schedule instead
        (:func:`average_gradients`: a zero-bubble schedule's weight backwards come after DDP's reduction)."""
        self.pm, self.schedule, self.average_over = pm, schedule, average_over
        total = pm.stages * len(pm.chunks)
        # The run's forward context (autocast) wraps each forward and the loss, not torch's backwards.
        self.context: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext
        for c in range(len(pm.chunks)):  # evaluation's forwards (ours, over pm.chunks) go through it too
            pm.chunks[c] = _InContext(pm.chunks[c], self)
        modules = list(pm.chunks) if data is None else data(pm)
        self.stages = [torch_stage(m, pm.placement.virtual(pm.rank, c), total, topo) for c, m in enumerate(modules)]
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        self.comm = topo.comm(PP)
        self.built: dict[int, tuple[_PipelineSchedule, list[LossFn]]] = {}

    def step(self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, microbatches: int | None,
             forward_context: Callable[[], contextlib.AbstractContextManager[object]],
             loss_scale: float = 1.0) -> torch.Tensor | None:
        """One optimizer step's forwards and backwards; the mean loss over the micro-batches on the last stage.

        torch splits the local batch again into equal micro-batches and divides the gradients by their count
        (``scale_grads``): the mean loss's gradient, as ours. ``loss_scale`` (fp16) multiplies each loss before
        its backward and is divided out of the losses returned."""
        mbs = resplit(micro_batches, microbatches)
        x, y = torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])
        sched, fn = self._schedule(len(mbs))
        fn[0] = functools.partial(self._loss, loss_fn, loss_scale)
        self.context = forward_context
        self.pm.sync_copies()
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kw: dict[str, Any] = {"target": y, "losses": losses} if self.last else {}
        sched.step(*args, **kw)
        if self.average_over is not None:
            average_gradients(self.pm.parameters(), self.average_over)
        sync_ties(self.pm, self.comm)
        return torch.stack([t.detach() for t in losses]).mean() / loss_scale if self.last else None

    def _loss(self, loss_fn: LossFn, scale: float, out: Any, target: Any) -> torch.Tensor:
        with self.context():
            return loss_fn(out, target) * scale

    def _schedule(self, microbatches: int) -> tuple[_PipelineSchedule, list[LossFn]]:
        """The schedule for ``microbatches`` (built once per count), and the cell holding the loss it calls (the
        Trainer's loss function and scale can change between steps, torch's schedule keeps the one it got)."""
        if microbatches not in self.built:
            fn: list[LossFn] = [lambda out, target: out]
            sched = torch_schedule(self.schedule, self.stages, microbatches,
                                   lambda out, target: fn[0](out, target))
            self.built[microbatches] = sched, fn
        return self.built[microbatches]


class StageDDP(DistributedDataParallel):
    """torch's DDP for a pipeline stage: every forward runs as under ``no_sync()``.

    torch's stage runs each micro-batch's forward under ``no_sync()`` itself and starts the reduction before
    the last backward (``prepare_for_backward``); but on the first step it infers the shapes sent between
    stages with one more forward, outside ``no_sync()``, which would leave DDP expecting a backward that never
    comes: the next micro-batch's backward then counts every parameter twice, and DDP's bucket rebuild fails
    (``rebuilt parameter indices size is not same as original model parameters size``)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.no_sync():
            return super().forward(*args, **kwargs)


def average_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average the gradients of replicated ``params`` over ``group``: one all-reduce per dtype, once all of a
    step's backwards ran (what torch's DDP does for a stage, but after a zero-bubble schedule's weight
    backwards, which come after the last micro-batch's input backward, where torch's stage starts DDP's)."""
    n = dist.get_world_size(group)

    def mean(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=group)
        flat /= n

    through_flat([p.grad for p in params if p.grad is not None], mean)


def ddp_chunks(pm: PipelineModel, topo: Topology, bucket_cap_mb: float | None = None) -> list[nn.Module]:
    """Each chunk under :class:`StageDDP` (for :class:`TorchPipeline`'s ``data``); the chunks stay pm's."""
    return [torch_ddp(c, topo, bucket_cap_mb, cls=StageDDP) for c in pm.chunks]


def fsdp_chunks(pm: PipelineModel, mesh: DeviceMesh, wrap: Any = "auto",
                reshard_after_forward: bool = True) -> list[nn.Module]:
    """FSDP2 on each chunk in place (for :class:`TorchPipeline`'s ``data``): ``fully_shard`` on our FSDP's units
    within it (``wrap``), then on the chunk, over ``mesh`` (torchtitan's order: after the split and tp).

    torch's stage drives FSDP2 itself: gradients accumulate unreduced over the micro-batches and are
    reduce-scattered once, after the last backward (weight backwards of a zero-bubble schedule included). FSDP2
    gives the chunks new parameters (DTensors): the pipeline's claims and ties follow them."""
    before = [(m, n, p) for c in pm.chunks for m in c.modules() for n, p in m.named_parameters(recurse=False)]
    for c in pm.chunks:
        fully_shard_units(unit_modules(c, wrap), mesh, reshard_after_forward)
    pm.renew({id(p): getattr(m, n) for m, n, p in before})
    return list(pm.chunks)


class _InContext(nn.Module):
    """A chunk whose forward runs in its pipeline's current forward context (what torch's stage calls)."""

    def __init__(self, chunk: nn.Module, pipe: TorchPipeline) -> None:
        super().__init__()
        self.chunk = chunk
        self.pipe = pipe

    def forward(self, *args: Any) -> Any:
        with self.pipe.context():
            return self.chunk(*args)


__all__ = ["SP_IN_PIPELINE", "TORCH_SCHEDULES", "TorchPipeline", "average_gradients", "ddp_chunks", "fsdp_chunks",
           "refuse_schedule", "torch_schedule", "torch_schedule_refusal", "torch_stage"]
