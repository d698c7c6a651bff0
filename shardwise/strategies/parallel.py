"""Composition: data x context x tensor x pipeline parallelism on one device mesh.

``sw.Parallel(dp=2, cp=2, tp=2, pp=2, zero=3, schedule="1f1b", microbatches=8)``
lays the world out as the mesh of :class:`~shardwise.comm.topology.Topology`
(``pp, dp_replicate, dp_shard, cp, tp``, tp innermost: a tensor-parallel group is
made of neighbouring ranks, the ones that talk most). The model is built by
:func:`shardwise.parallel.parallelize.parallelize`, the one place that fixes the order
(pipeline split, tensor parallel, context parallel, then the data-parallel family
over dp x cp). ``cp`` splits every sequence over ranks (``cp_mode`` ring or
Ulysses; docs/long_context.md); ``sequence_parallel`` shards tp's norm and
residual regions along the sequence (Megatron sequence parallelism).

``zero`` picks the data-parallel form over dp: 0 DDP, 1/2 ZeRO stage 1/2,
3 FSDP (parameters, gradients and optimizer states sharded in units, gathered
just in time inside each stage's schedule); ``replicate=R`` with ``zero=3`` is
HSDP (R replicas of ``dp/R`` shards). :class:`PP` is the preset of this
strategy with every device a pipeline stage.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.checkpoint.held import Held, held_state
from shardwise.comm.topology import Topology
from shardwise.dims import CP, EP, PP, TP, ParallelDims
from shardwise.layout import RunLayout
from shardwise.optim.param_groups import named_params
from shardwise.parallel.accounting import model_state_tensors, with_optimizer_states
from shardwise.parallel.clip import clip_global_norm
from shardwise.parallel.cp.apply import shard_batch
from shardwise.parallel.cp.attention import MODES
from shardwise.parallel.dp.zero import check_offload
from shardwise.parallel.ep import check_experts, experts_squares, is_expert
from shardwise.parallel.parallelize import DataParallelOptions, Owners, parallelize
from shardwise.parallel.pp.build import PipelineModel, find_ties, gather_full_state, stage_starts
from shardwise.parallel.pp.layers import stage_layers
from shardwise.parallel.pp.placement import V
from shardwise.parallel.pp.run import pipeline_eval, pipeline_step
from shardwise.parallel.pp.schedules import (
    Recorder,
    check_message_order,
    default_chunks,
    get_schedule,
    placement,
    schedule_facts,
    shape_of,
)
from shardwise.parallel.tp.apply import Plan, Style, counts_in_norm
from shardwise.step import LossFn, OptimizerFactory, StepRun, first_named
from shardwise.strategies.base import HasTPPlan, SplitsModel, Strategy


@dataclass
class Parallel(Strategy, SplitsModel, HasTPPlan):
    """dp x tp x pp with the data-parallel family over dp; see the module docstring.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (with ``chunks`` > 1).
        microbatches: micro-batches per step (the local batch is re-split); None
            uses the trainer's ``accumulate_grad_batches`` chunks, or one micro-batch
            per stage when the trainer gives a single chunk.
        split_points: names of the layers where stages 1.. begin (see
            :func:`~shardwise.parallel.pp.build.pipeline_layers`); None balances parameter counts.
        chunks: model chunks per rank (interleaved schedule; 2 when ``schedule="interleaved"`` and unset).
        tied: ``"sync"`` keeps weights tied across stages in sync; ``"error"`` rejects them.
        recorder: collects an :class:`~shardwise.parallel.pp.schedules.Event` per action.
        dp, tp, pp: mesh sizes (``dp=-1``: the devices left over).
        zero: 0 = DDP over dp, 1 = ZeRO-1, 2 = ZeRO-2, 3 = FSDP (ZeRO-3 in units).
        replicate: with ``zero=3``, HSDP: ``replicate`` replicas of ``dp/replicate`` shards.
        cp: context-parallel size: each rank holds S/cp tokens of every sequence.
        cp_mode: ``"ring"`` (key/value blocks passed around the cp ranks, any cp) or
            ``"ulysses"`` (all-to-alls between sequence and head shards; heads divide by cp).
        sequence_parallel: with tp > 1, Megatron sequence parallelism.
        ep: expert-parallel size: the experts of every MoE layer are split over ``ep`` of the dp x cp ranks,
            tokens reach them by all-to-all (docs/experts.md); must divide dp x cp and the expert count.
        capacity_factor: None routes every token (dropless); a number caps what each expert takes from a
            rank at ``ceil(capacity_factor * tokens * top_k / experts)`` slots, dropping the rest (counted).
        tp_plan: tensor-parallel plan (None: the built-in plan for the model type).
        bucket_cap_mb: DDP/ZeRO bucket size (None: each one's default).
        collectives, offload, offload_device, wrap, reshard_after_forward: as in
            :class:`~shardwise.strategies.dp.fsdp.FSDP` (offload and collectives for ZeRO-1/2 too).
    """

    schedule: str = "1f1b"
    microbatches: int | None = None
    split_points: list[str] | None = None
    chunks: int = 1
    tied: str = "sync"
    recorder: Recorder | None = None
    dp: int = -1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    replicate: int = 1
    tp_plan: Plan | dict[str, str | Style] | str | None = None
    bucket_cap_mb: float | None = None
    collectives: str = "auto"
    offload: str = "none"
    offload_device: str = "cpu"
    wrap: Any = "auto"
    reshard_after_forward: bool = True
    cp: int = 1
    cp_mode: str = "ring"
    sequence_parallel: bool = False
    ep: int = 1
    capacity_factor: float | None = None
    name: ClassVar[str] = "parallel"

    def __post_init__(self) -> None:
        facts = schedule_facts(self.schedule)
        if facts.shape == V and self.n_chunks() != facts.chunks:
            raise ValueError(f"schedule={self.schedule!r} places exactly {facts.chunks} model chunks per rank in a V "
                             f"(rank r holds virtual stages r and 2p-1-r), got chunks={self.chunks}; leave chunks "
                             f"unset or use {facts.chunks}")
        if self.cp_mode not in MODES:
            raise ValueError(f"cp_mode={self.cp_mode!r}: valid are {', '.join(map(repr, MODES))}")
        self.data_options()  # zero / replicate checked here, before any process starts
        check_offload(self.offload, self.name, 3 if self.zero == 0 else self.zero)
        if self.offload != "none" and self.zero == 0:
            raise ValueError(f"offload={self.offload!r} needs zero >= 1 (sharded optimizer states); "
                             "DDP keeps the optimizer on every rank")

    def splits_meta(self, topo: Topology) -> bool:
        return self.zero != 3 and super().splits_meta(topo)  # FSDP over each chunk wraps real tensors, even dp = 1

    def compile_refusal(self) -> str | None:
        if not schedule_facts(self.schedule).split_backward:
            return None
        return (f"schedule={self.schedule!r} splits each backward into the input's gradient and the weights' "
                "(shardwise.parallel.pp.split_backward walks a block's autograd graph), and a compiled block has one "
                "fused backward with no such split (torch's zero-bubble schedules refuse compiled stages too); use "
                "schedule='1f1b' or 'interleaved' with compile, or compile=False")

    # ---- layout ---------------------------------------------------------------
    def n_chunks(self) -> int:
        """Model chunks per pipeline rank (the interleaved schedule needs at least 2)."""
        return default_chunks(self.schedule, self.chunks)  # interleaved: at least 2; zbv, dualpipev: 2

    def data_options(self) -> DataParallelOptions:
        return DataParallelOptions(zero=self.zero, replicate=self.replicate, bucket_cap_mb=self.bucket_cap_mb,
                                   collectives=self.collectives, offload=self.offload,
                                   offload_device=self.offload_device, wrap=self.wrap,
                                   reshard_after_forward=self.reshard_after_forward)

    def tensor_parallel_plan(self) -> Plan | dict[str, str | Style] | str | None:
        return self.tp_plan

    def layout(self, devices: int) -> RunLayout:
        return self._layout(ParallelDims.for_world(devices, self.dp, self.tp, self.pp, cp=self.cp, ep=self.ep,
                                                   replicate=self.replicate if self.zero == 3 else 1))

    def _layout(self, dims: ParallelDims) -> RunLayout:
        return RunLayout.of(self.name, dims, zero=self.zero, replicate=self.replicate, offload=self.offload,
                            wrap=self.wrap if self.zero == 3 else None, schedule=self.schedule,
                            microbatches=self.microbatches, chunks=self.n_chunks(),
                            cp_mode=self.cp_mode if dims.cp > 1 else None,
                            sequence_parallel=self.sequence_parallel)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        return parallelize(model, optimizer_fn, topo, tp_plan=self.tp_plan, split_points=self.split_points,
                           chunks=self.n_chunks(), tied=self.tied, data=self.data_options(),
                           sequence_parallel=self.sequence_parallel, cp_mode=self.cp_mode,
                           capacity_factor=self.capacity_factor, shape=shape_of(self.schedule))

    def check_model(self, model: nn.Module, devices: int, batch_size: int, accumulate_grad_batches: int,
                    backend: str = "gloo") -> None:
        """Before any process starts: every stage gets a layer, the batch splits, the stages can all fill.

        The same checks run again inside each rank, but there a mistake would surface
        once per process, after the process group was formed; here it costs nothing.
        """
        p, v = self.layout(devices).pp, self.n_chunks()
        check_experts(model, self.ep, self.capacity_factor)
        layers = stage_layers(model, p * v)
        starts = stage_starts(layers, p * v, self.split_points) + [len(layers)]  # too few layers: ValueError
        parts = [layers[starts[i]:starts[i + 1]] for i in range(p * v)]
        if self.zero == 2 and p > 1:
            if find_ties(model, parts, p, v, "sync"):
                raise ValueError("zero=2 with weights tied across pipeline stages is not supported: ZeRO-2 frees "
                                 "the full gradients in backward, and its pieces of a tied weight do not line up "
                                 "across stages; use zero=1 or zero=3")
        local = batch_size // self.batch_shards(devices)
        m = self.effective_microbatches(local, p, accumulate_grad_batches)
        if self.microbatches is not None and (m < 1 or local % m):
            raise ValueError(f"pipeline: the local batch of {local} samples does not split into microbatches={m} "
                             f"equal micro-batches (the mean loss needs equal sizes); choose a divisor of {local}")
        get_schedule(self.schedule)(p, m, 0, v)  # the schedule's own rules (interleaved: m % p == 0)
        if p > 1:
            # NCCL matches a pair's messages in one channel: a V's order needs gloo's two (checked in ranks too).
            check_message_order(self.schedule, p, m, v, tagged=backend != "nccl")
        if 1 < p and m < p:
            # GPipe, section 2.2: the idle share is (p-1)/(m+p-1); with m < p some stage never overlaps another.
            warnings.warn(f"pipeline: {m} micro-batch(es) per step for {p} stages: fewer micro-batches than stages "
                          f"leaves stages idle (bubble (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.0%} of the step); "
                          f"use microbatches >= {p}", stacklevel=4)

    # ---- a step ----------------------------------------------------------------
    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        micro_batches = [self._tokens(x, y, topo) for x, y in micro_batches]
        return pipeline_step(
            model,  # type: ignore[arg-type]
            micro_batches,
            loss_fn,
            topo,
            self.schedule,
            self._micro(micro_batches, topo),
            self.recorder,
            lambda: run.forward_context(topo.device),
            run.loss_scale,
        )

    def eval_step(self, model: nn.Module, x: Any, y: Any, fn: LossFn, topo: Topology,
                  run: StepRun = StepRun()) -> torch.Tensor | None:
        x, y = self._tokens(x, y, topo)
        return pipeline_eval(model, x, y, fn, topo, lambda: run.forward_context(topo.device))  # type: ignore[arg-type]

    @staticmethod
    def _tokens(x: Any, y: Any, topo: Topology) -> tuple[Any, Any]:
        """This cp rank's tokens of inputs and targets, cut at the same places (everything, without cp)."""
        cp, r = topo.size(CP), topo.coord(CP)
        return shard_batch(x, cp, r), shard_batch(y, cp, r)

    def _micro(self, micro_batches: Sequence[tuple[Any, Any]], topo: Topology) -> int | None:
        if self.microbatches is not None or len(micro_batches) > 1:
            return self.microbatches
        # One chunk from the trainer would leave every stage but one idle: by default
        # feed as many micro-batches as there are stages, when the batch divides evenly.
        x = micro_batches[0][0]
        n, p = (x.shape[0] if isinstance(x, torch.Tensor) else 0), topo.size(PP)
        return p if p > 1 and n % p == 0 else None

    def effective_microbatches(self, local_batch: int, stages: int, accumulate_grad_batches: int = 1) -> int:
        """How many micro-batches a step feeds the pipeline (what :meth:`_micro` will choose)."""
        if self.microbatches is not None:
            return self.microbatches
        if accumulate_grad_batches > 1:
            return accumulate_grad_batches
        return stages if stages > 1 and local_batch % stages == 0 else 1

    def owns_loss(self, topo: Topology) -> bool:
        where = placement(self.schedule, topo.size(PP), self.n_chunks())  # the last virtual stage: rank 0 in a V
        return topo.coord(PP) == where.rank_of(where.last) and topo.coord(TP) == 0

    # ---- gradients and state ----------------------------------------------------
    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        pm: PipelineModel = model  # type: ignore[assignment]
        owner: Owners | None = pm.data
        tp = topo.comm(TP) if topo.size(TP) > 1 else None
        elsewhere = pm.elsewhere()
        groups: list[tuple[Any, str]] = [(tp, "tp.clip"), (topo.comm(PP), "pp.clip")]
        if owner is None:
            # DDP has averaged the gradients: they are equal over dp, so dp takes no part in the norm.
            pieces = [(p.grad, p) for p in pm.parameters() if p.grad is not None]
            every = [g for g, _ in pieces]
        else:
            owner.before_step()  # reduce now: the norm needs the averaged gradient
            pieces = owner.grad_pieces()
            every = owner.shard_grads()
            # The pieces are disjoint over the shard group (HSDP replicas hold equal ones).
            groups.insert(0, (owner.shard_comm, "zero_clip"))
        counted = [(g, p) for g, p in pieces if counts_in_norm(p, tp, elsewhere)]
        reduced: list[torch.Tensor] = []
        if owner is None and topo.size(EP) > 1:
            # DDP: dense gradients are equal over dp x cp, but each ep rank holds other experts: their squares
            # are summed over ep first (ZeRO/FSDP pieces are disjoint over dp x cp already, experts included).
            reduced.append(experts_squares([g for g, p in counted if is_expert(p)], topo.comm(EP), topo.device))
            counted = [(g, p) for g, p in counted if not is_expert(p)]
        return clip_global_norm([g for g, _ in counted], every, max_norm, groups, topo.device, reduced)

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        pm: PipelineModel = model  # type: ignore[assignment]
        units = [u for c in pm.chunks for u in getattr(c, "units", [])]
        with torch.no_grad():
            for u in units:  # FSDP: every parameter whole again for the gather (a collective over its shard group)
                u.unshard()
            try:
                return gather_full_state(pm, topo)
            finally:
                for u in units:
                    u.reshard()

    def checkpoint_held(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology) -> list[Held]:
        """This rank's stage(s) under the unsplit model's names, as tp slices and dp shards.

        A weight tied across stages is written by every stage holding a copy
        (the copies are equal, and DCP keeps one of identical chunks).
        """
        pm: PipelineModel = model  # type: ignore[assignment]
        return held_state(unsplit_named(pm), pm.data.wrappers if pm.data is not None else [], optimizer)

    def param_names(self, model: nn.Module) -> dict[int, str]:
        """This rank's stage(s) under the unsplit model's names: a weight tied across stages under its first
        name, a further copy in this rank under the first copy's, and the shards of the chunks' wrappers."""
        pm: PipelineModel = model  # type: ignore[assignment]
        named = unsplit_named(pm)
        first = {id(t): n for n, t in named}
        named += [(first[id(f)], c) for f, c in pm.copies]
        return named_params(named, pm.data.wrappers if pm.data is not None else [])

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        pm: PipelineModel = model  # type: ignore[assignment]
        # Each chunk's wrapper accounts for itself; ZeRO-1 has one wrapper over every chunk instead.
        holders = pm.data.wrappers if pm.data is not None and pm.data.wrappers[0] not in pm.chunks else pm.chunks
        parts: dict[str, list[torch.Tensor]] = {}
        for h in holders:
            for k, v in model_state_tensors(h).items():
                parts.setdefault(k, []).extend(v)
        return with_optimizer_states(parts, optimizer)


def unsplit_named(pm: PipelineModel) -> list[tuple[str, torch.Tensor]]:
    """This rank's stage tensors under the unsplit model's names, in its order: each once, a weight tied across
    stages under its first name (a stage's copy of it included)."""
    tied = {id(t.param): t.name for t in pm.ties}
    mine = first_named((k, pm.claimed[k]) for k in pm.keys if k in pm.claimed)
    return [(tied.get(id(t), k), t) for k, t in mine]


__all__ = ["PP", "Parallel"]
