"""The one place that fixes the order torch's engine (``engine="torch"``) parallelizes a model in.

:mod:`shardwise.parallel.parallelize` is our engine's door; this is torch's, beside it. The order is
torchtitan's (``pipeline_llama``, then ``parallelize_llama`` on each model part), and ours, step for step:

1. **pipeline split** (pp > 1): our cut (:func:`~shardwise.parallel.pp.build.build_pipeline`: the same
   stages, names and tied copies as our engine's), each of this rank's chunks then a torch ``PipelineStage``
   run by torch's schedule for ours (:class:`~shardwise.parallel.pp.torch_pp.TorchPipeline`). First, because
   everything after it should only touch this rank's layers.
2. **tensor parallel** (tp > 1): ``parallelize_module`` with torch's styles for our plan
   (:func:`split_tp`), on the whole model or on the modules of this rank's stage only. Before data
   parallelism, because FSDP2 shards the parameters as they are after the split: tp's DTensors become 2-D
   DTensors on the same root mesh (:func:`~shardwise.parallel.dp.torch_dp.composed_mesh`); torch's DDP takes
   no DTensor parameters at all (:func:`~shardwise.parallel.tp.torch_tp.refuse_ddp_over_tp` refuses it).
3. **the data-parallel family** over dp (:func:`stage_data`): FSDP2 ``fully_shard`` on our FSDP's units,
   then the root (``zero=3``; ``zero=2``: without resharding after the forward; HSDP with ``replicate``); on
   pipeline chunks also torch's DDP (``zero`` 0 or 1), or the gradients averaged over dp after the schedule
   (:func:`averages_after`: a zero-bubble schedule's weight backwards come after DDP's reduction). Last,
   because it must see the final parameters; torch's stage drives it inside the schedule.

Context parallelism under torch's engine (``context_parallel``, :mod:`shardwise.parallel.cp.torch_cp`) splits
no parameter and composes with dp alone: its hooks go on the model's own modules before the one data-parallel
wrapper, which the strategy picks. A whole-model data-parallel strategy is one builder of
:mod:`shardwise.parallel.dp.torch_dp`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from shardwise.comm.topology import Topology
from shardwise.dims import DP, TP
from shardwise.parallel.dp.fsdp_units import unit_modules
from shardwise.parallel.dp.torch_dp import composed_mesh, fully_shard_units
from shardwise.parallel.parallelize import DataParallelOptions
from shardwise.parallel.pp.build import PipelineModel, build_pipeline
from shardwise.parallel.pp.schedules import schedule_facts, shape_of
from shardwise.parallel.pp.torch_pp import TorchPipeline, ddp_chunks, fsdp_chunks
from shardwise.parallel.tp.plans import resolve_plan
from shardwise.parallel.tp.torch_tp import apply_torch_tp, tp_mesh


def split_tp(model: nn.Module, keep: Callable[[str], bool] | None, plan: Any, topo: Topology,
             sequence_parallel: bool = False) -> nn.Module:
    """torch's tp with our ``plan`` (checked on the model first) over ``topo``'s tp mesh: on the whole model
    (``keep`` None), or on the modules of this rank's stage(s) (:func:`build_pipeline`'s transform, before the
    cut)."""
    resolved = resolve_plan(plan, model)
    if resolved.check is not None:
        resolved.check(model, topo.size(TP))
    return apply_torch_tp(model, resolved, tp_mesh(topo), sequence_parallel, keep)


def torch_parallelize_tp(model: nn.Module, topo: Topology, plan: Any, sequence_parallel: bool = False,
                         data: DataParallelOptions | None = None) -> nn.Module:
    """``model`` (on the device) split by torch's tp, then, with ``data`` and dp > 1, FSDP2 on our units over dp
    on the same root mesh (``zero=3``; ``zero=2`` without resharding after the forward, as ``zero2``'s engine);
    in place. ``data`` None: nothing over dp (a tp-only strategy)."""
    split_tp(model, None, plan, topo, sequence_parallel)
    if data is not None and topo.size(DP) > 1:
        fully_shard_units(unit_modules(model, data.wrap), composed_mesh(topo, data.replicate),
                          data.reshard_after_forward and data.zero == 3)
    return model


def torch_parallelize_pipeline(model: nn.Module, topo: Topology, plan: Any, split_points: Sequence[str] | None,
                               chunks: int, tied: str, schedule: str,
                               data: DataParallelOptions) -> TorchPipeline:
    """``model`` cut into this rank's stage chunks, tp on their modules (tp > 1), then each chunk under dp
    (:func:`stage_data`), as torch stages run by torch's ``schedule``; the pipeline's model is its ``pm``."""
    tp_split = functools.partial(split_tp, plan=plan, topo=topo)
    pm = build_pipeline(model.to(topo.device), topo, split_points, chunks, tied,
                        tp_split if topo.size(TP) > 1 else None, shape=shape_of(schedule))
    return TorchPipeline(pm, topo, schedule, stage_data(topo, schedule, data),
                         topo.group(DP) if averages_after(topo, schedule, data.zero) else None)


def averages_after(topo: Topology, schedule: str, zero: int) -> bool:
    """Whether the gradients are averaged over dp after the schedule rather than by torch's DDP: a zero-bubble
    schedule's weight backwards come after the last micro-batch's input backward, where torch's stage
    starts DDP's reduction, whose buckets they would miss (FSDP2, ``zero=3``, reduces after all of them)."""
    return topo.size(DP) > 1 and zero <= 1 and schedule_facts(schedule).split_backward


def stage_data(topo: Topology, schedule: str,
               data: DataParallelOptions) -> Callable[[PipelineModel], list[nn.Module]] | None:
    """How :class:`TorchPipeline` puts the chunks under dp: FSDP2 (``zero`` 2 or 3, on the mesh of
    :func:`torch_parallelize_tp`'s, HSDP's with replicas), torch's DDP (``zero`` 0 or 1), or nothing (dp = 1,
    or averaged after the schedule)."""
    if topo.size(DP) == 1 or averages_after(topo, schedule, data.zero):
        return None
    if data.zero >= 2:  # zero=2: FSDP2 without resharding after the forward, as zero2's engine
        # A split backward's weight half needs the unsharded parameters its input half saw: resharded after
        # the forward, zbv's gradients came out wrong (2 steps of our GPT: the second loss 3e-3 off one
        # device's). torchtitan's default keeps them unsharded under any pipeline (reshard_after_forward =
        # not pp_enabled), to spare an all-gather per micro-batch; here the Parallel's option decides elsewhere.
        keep = schedule_facts(schedule).split_backward or data.zero == 2
        return functools.partial(fsdp_chunks, mesh=composed_mesh(topo, data.replicate), wrap=data.wrap,
                                 reshard_after_forward=data.reshard_after_forward and not keep)
    return functools.partial(ddp_chunks, topo=topo, bucket_cap_mb=data.bucket_cap_mb)


__all__ = ["averages_after", "split_tp", "stage_data", "torch_parallelize_pipeline", "torch_parallelize_tp"]
