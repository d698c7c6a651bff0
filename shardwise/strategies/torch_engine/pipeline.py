"""``engine="torch"`` for a pipeline: ``strategy="pp"`` and ``sw.Parallel(pp=N, ...)`` under
``torch.distributed.pipelining`` (:class:`TorchPP`), beside the whole-model wrappers of
:mod:`shardwise.strategies.torch_engine.wrappers`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.held import Held
from shardwise.comm.topology import Topology
from shardwise.dims import DP, PP
from shardwise.parallel.dtensor import full
from shardwise.parallel.pp.build import PipelineModel, exchange_stages
from shardwise.parallel.pp.torch_pp import TorchPipeline, refuse_schedule
from shardwise.parallel.torch_parallelize import torch_parallelize_pipeline
from shardwise.parallel.tp.plans import resolve_plan
from shardwise.parallel.tp.torch_tp import clip_grad_norm_, refuse_ddp_over_tp, refuse_plan
from shardwise.step import LossFn, OptimizerFactory, StepRun
from shardwise.strategies.base import SplitsModel
from shardwise.strategies.parallel import Parallel, unsplit_named
from shardwise.strategies.torch_engine.wrappers import TorchDTensors, held_named


@dataclass
class TorchPP(TorchDTensors[Parallel], SplitsModel):
    """``strategy="pp"`` and ``sw.Parallel(pp=N, ...)`` under ``torch.distributed.pipelining``
    (:mod:`shardwise.parallel.pp.torch_pp`), built in :mod:`shardwise.parallel.torch_parallelize`'s order: our
    pipeline's split (:func:`~shardwise.parallel.pp.build.build_pipeline`: the same stages, names and tied
    copies), each chunk a torch ``PipelineStage`` run by torch's schedule for ours; within a stage tp
    (``parallelize_module`` on the stage's modules), then over dp torch's DDP (``zero=0``; ``zero=1``:
    ``ZeroRedundancyOptimizer`` over each stage's dp ranks, built here) or FSDP2 (``zero=3``; ``zero=2`` without
    resharding after the forward). What reads the split model (parameter groups, evaluation's forward) is our PP's,
    on the same model; the full state, the checkpoint's keys and clipping by the global norm read its DTensors."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pipe: TorchPipeline | None = None  # built in the rank, by setup
        self.split_points = self.of.split_points  # what the checks read of a model cut into stages

    def check_model(self, model: nn.Module, devices: int, batch_size: int, accumulate_grad_batches: int,
                    backend: str = "gloo") -> None:
        super().check_model(model, devices, batch_size, accumulate_grad_batches, backend)
        of, layout = self.of, self.layout(devices)
        if layout.tp > 1:
            refuse_ddp_over_tp(self.name, layout.dp, layout.tp, of.zero)
            refuse_plan(self.name, resolve_plan(of.tensor_parallel_plan(), model), model, False)
        self._check_torch_schedule(devices, batch_size, accumulate_grad_batches)

    def _check_torch_schedule(self, devices: int, batch_size: int, accumulate_grad_batches: int) -> None:
        """torch's schedule's own rules on the micro-batch count, where they are stricter than ours."""
        of = self.of
        p = self.layout(devices).pp
        m = of.effective_microbatches(batch_size // of.batch_shards(devices), p, accumulate_grad_batches)
        refuse_schedule(self.name, of.schedule, p, m)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.check_setup(model)
        of = self.of
        self.pipe = torch_parallelize_pipeline(model, topo, of.tensor_parallel_plan(), of.split_points, of.n_chunks(),
                                               of.tied, of.schedule, of.data_options())
        pm = self.pipe.pm
        base = optimizer_fn(pm.parameters())
        if of.zero != 1 or topo.size(DP) == 1:
            return pm, base
        return pm, self.partitioned(pm, optimizer_fn, base, topo)  # each stage's parameters over its dp ranks

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        assert self.pipe is not None, "setup builds the pipeline"
        return self.pipe.step(micro_batches, loss_fn, self.of._micro(micro_batches, topo),
                              lambda: run.forward_context(topo.device), run.loss_scale)

    def compile_refusal(self) -> str | None:
        return self.of.compile_refusal()  # a zero-bubble schedule splits each backward, as torch's needs too

    def eval_step(self, model: nn.Module, x: Any, y: Any, fn: LossFn, topo: Topology,
                  run: StepRun = StepRun()) -> torch.Tensor | None:
        return self.of.eval_step(model, x, y, fn, topo, run)  # our forward-only pass over the same stages

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        # Each stage's squares (a DTensor's over its dp and tp mesh), summed over pp; a tied weight counted once.
        pm = _pipeline(model)
        return clip_grad_norm_(list(pm.parameters()), max_norm, pm.elsewhere(), topo.comm(PP))

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        pm = _pipeline(model)
        mine = {k: full(t.detach()).contiguous() for k, t in pm.claimed.items()}  # each stage's, whole
        return exchange_stages(pm, mine, topo)

    def checkpoint_held(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology) -> list[Held]:
        """Our PP's keys: the stage modules' tensors under the unsplit model's names (a tied weight under its
        first name), each as tp slice and FSDP2 shard, so the checkpoint crosses to any layout under either
        engine."""
        return held_named(unsplit_named(_pipeline(model)), optimizer)

    def param_names(self, model: nn.Module) -> dict[int, str]:
        return self.of.param_names(model)


def _pipeline(model: nn.Module) -> PipelineModel:
    """The model :meth:`TorchPP.setup` built (a pipeline's stages)."""
    if not isinstance(model, PipelineModel):
        raise TypeError(f"expected the pipeline TorchPP.setup built, got {type(model).__name__}")
    return model


__all__ = ["TorchPP"]
