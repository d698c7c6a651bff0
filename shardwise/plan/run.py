"""The plan of exactly the run that was asked for: a real module under a :class:`~shardwise.layout.RunLayout`.

This is the planner's entry point for the Trainer's memory check. The model
states come from :mod:`shardwise.plan.states` (the construction repeated on a
meta copy of the model: exact to the byte, rank by rank); activations and
temporary buffers from the formulas of :mod:`shardwise.plan.memory` for the
same layout, precision, activation checkpointing and micro-batches. Nothing is
allocated and no process is started.

>>> plan = plan_run(model, sw.Parallel(dp=2, tp=2, zero=3).describe(4), 16 * 10**9, batch_size=32)
>>> plan.fits, plan.message()
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from shardwise.dims import CP, EP, PP
from shardwise.layout import RunLayout
from shardwise.parallel.pp.schedules import SCHEDULES
from shardwise.plan.estimate import check_layout, estimate
from shardwise.plan.fit import fmt_bytes
from shardwise.plan.model import ModelSpec
from shardwise.plan.specs import ClusterSpec, Layout, TrainingSpec
from shardwise.plan.staging import STAGING, staging_bytes
from shardwise.plan.states import (
    NotModelled,
    Param,
    RankStates,
    busiest,
    check_modelled,
    full_grad_bytes,
    local_chunks,
    optimizer_states,
    params_of,
    states_of,
    zero_stage,
)
from shardwise.precision import TRUE_DTYPES

_OPTIMIZER_NAMES = {2: "adamw", 1: "sgd-momentum", 0: "sgd"}  # for the time model only; bytes use the real count


@dataclass(frozen=True)
class RunPlan:
    """Per-device memory of one run: exact model states of every rank, activations and buffers of the busiest."""

    layout: RunLayout
    ranks: tuple[RankStates, ...]
    activation_bytes: int
    buffers: dict[str, int]
    device_memory_bytes: int
    notes: tuple[str, ...] = field(default=())
    suggestion: str = ""  # what would fit instead (filled when this does not)
    # Host memory per rank, by purpose (:data:`~shardwise.plan.staging.STAGING`: a save in the background's copy
    # of the rank's checkpoint share, in rank order); on a CPU run the host is the device (``host_is_device``).
    host: dict[str, tuple[int, ...]] = field(default_factory=dict)
    host_is_device: bool = False
    params: tuple[int, ...] = ()  # the parameter elements each rank holds, in rank order

    @property
    def states(self) -> RankStates:
        """The busiest rank's model states."""
        return busiest(self.ranks)

    @property
    def buffer_bytes(self) -> int:
        return sum(self.buffers.values())

    @property
    def host_bytes(self) -> dict[str, int]:
        """Each host line's bytes on the rank that needs the most of it."""
        return {what: max(per_rank, default=0) for what, per_rank in self.host.items()}

    @property
    def total_bytes(self) -> int:
        """Device bytes at the peak: the busiest rank's states plus activations and buffers (an upper bound:
        the rank with the most states need not be the one with the most activations), and the host lines when
        the host is the device."""
        host = sum(self.host_bytes.values()) if self.host_is_device else 0
        return self.states.device + self.activation_bytes + self.buffer_bytes + host

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_memory_bytes

    def summary(self) -> str:
        """``<strategy> on dp= tp= pp=[, options]: <total> of <memory> per device (<breakdown>)``."""
        lay, s = self.layout, self.states
        opts = [f"zero={lay.zero}"] if lay.strategy in ("parallel", PP) and lay.zero else []
        opts += [f"replicate={lay.replicate}"] * (lay.replicate > 1) + [f"offload={lay.offload}"] * (
            lay.offload != "none") + [f"precision {lay.precision}"] * (lay.precision != "32") + [
            "activation checkpointing"] * lay.activation_checkpointing
        parts = [("parameters", s.params), ("gradients", s.grads), ("optimizer", s.optimizer),
                 ("activations", self.activation_bytes), ("buffers", self.buffer_bytes)]
        if lay.cp > 1:
            opts = [f"{CP}={lay.cp} ({lay.cp_mode or 'ring'})"] + opts
        if lay.ep > 1:
            opts = [f"{EP}={lay.ep}"] + opts
        if lay.sequence_parallel and lay.tp > 1:
            opts.append("sequence parallel")
        text = (f"{lay.strategy} on dp={lay.dp} tp={lay.tp} pp={lay.pp}{''.join(', ' + o for o in opts)}: "
                f"{fmt_bytes(self.total_bytes)} of {fmt_bytes(self.device_memory_bytes)} per device ("
                + ", ".join(f"{n} {fmt_bytes(v)}" for n, v in parts) + ")")
        if s.host:
            text += f"; {fmt_bytes(s.host)} offloaded to host memory"
        for what, n in self.host_bytes.items():
            text += f"; {what} {fmt_bytes(n)} of host memory per rank" + " (counted above)" * self.host_is_device
        return text + "".join(f"; {n}" for n in self.notes)

    def message(self) -> str:
        if self.fits:
            return "fits: " + self.summary()
        return "does not fit: " + self.summary() + (f"; {self.suggestion}" if self.suggestion else "")


def plan_run(model: nn.Module, layout: RunLayout, device_memory_bytes: int, batch_size: int,
             optimizer: torch.optim.Optimizer | str = "adamw", *, accumulate_grad_batches: int = 1,
             batch_shards: int | None = None, tp_plan: Any = None,
             split_points: Sequence[str] | None = None, suggest: bool = True, checkpoint_async: bool = False,
             steps: int = 0, host_is_device: bool = False) -> RunPlan:
    """The memory plan of ``model`` trained under ``layout`` with a global batch of ``batch_size``.

    ``optimizer`` is the optimizer (its states are counted by stepping a
    one-element copy) or a name; ``batch_shards`` the ranks that read data
    (default dp; a parameter server's workers); ``tp_plan`` and
    ``split_points`` as the strategy will split the model; ``suggest``: when
    the run does not fit, plan the least change that would (a higher zero
    stage, then offloading the optimizer). ``checkpoint_async``: saves in the
    background stage each rank's checkpoint share in host memory, planned for
    a save after ``steps`` steps (:mod:`shardwise.plan.staging`), counted with
    the device's bytes when ``host_is_device`` (a CPU run). Raises
    :class:`~shardwise.plan.states.NotModelled` for a run the planner cannot lay out.
    """
    check_modelled(layout)
    k = optimizer_states(optimizer)
    chunks = local_chunks(model, layout, tp_plan, split_points)
    ranks = states_of(chunks, layout, k)
    shards = batch_shards or layout.dp
    local = max(1, batch_size // shards)
    m = microbatches(layout, local, accumulate_grad_batches)
    act, buffers, notes = _activations_and_buffers(model, layout, local, m, k, device_memory_bytes)
    if zero_stage(layout) >= 2 and m > 1:
        # Micro-batches accumulate unreduced (no_sync, and a pipeline's chunks until the last micro-batch):
        # ZeRO-2/3 hold whole gradients until the step's single reduce-scatter.
        buffers["unsharded gradients (accumulation)"] = full_grad_bytes(chunks)
    if layout.engine == "torch":
        _torch_engine_buffers(layout, chunks, buffers, notes)
    host = _staging(model, layout, optimizer, steps, tp_plan, split_points, notes) if checkpoint_async else {}
    plan = RunPlan(layout, tuple(ranks), act, buffers, device_memory_bytes, tuple(notes), host=host,
                   host_is_device=host_is_device, params=tuple(params_of(chunks, layout)))
    if plan.fits or not suggest:
        return plan
    for what, alt in alternatives(layout):
        other = plan_run(model, alt, device_memory_bytes, batch_size, optimizer, suggest=False,
                         accumulate_grad_batches=accumulate_grad_batches, batch_shards=batch_shards,
                         tp_plan=tp_plan, split_points=split_points, checkpoint_async=checkpoint_async, steps=steps,
                         host_is_device=host_is_device)
        if other.fits:
            return replace(plan, suggestion=f"{what} would need {fmt_bytes(other.total_bytes)}")
    if act > plan.states.device and not layout.activation_checkpointing:
        return replace(plan, suggestion="activations dominate: try activation checkpointing or a smaller batch "
                                        "per device")
    return replace(plan, suggestion="try more devices, a larger tp/pp, or a smaller model")


def _staging(model: nn.Module, layout: RunLayout, optimizer: torch.optim.Optimizer | str, steps: int,
             tp_plan: Any, split_points: Sequence[str] | None, notes: list[str]) -> dict[str, tuple[int, ...]]:
    """The host memory each rank stages an asynchronous checkpoint save in, or a note saying it is not planned."""
    try:
        return {STAGING: tuple(staging_bytes(model, layout, optimizer, steps, tp_plan=tp_plan,
                                             split_points=split_points))}
    except NotModelled as e:  # the rest of the plan stands: say what it leaves out
        notes.append(f"{STAGING} not planned: {e}")
        return {}


def _torch_engine_buffers(layout: RunLayout, chunks: list[list[list[Param]]], buffers: dict[str, int],
                          notes: list[str]) -> None:
    """What torch's engines hold besides the model states (laid out as torch partitions them), where it is known
    to differ from ours, and a note naming what is estimated as our engines hold it."""
    if zero_stage(layout) <= 1 and layout.dp > 1:
        # torch's DDP (gradient_as_bucket_view=False, its default) copies every gradient into a bucket of its own;
        # ours reduces in the gradients' own storage.
        buffers["DDP gradient buckets (torch)"] = full_grad_bytes(chunks)
    notes.append("engine='torch': model states as torch's engines partition them; activations and the other "
                 "buffers as shardwise's engines hold them (FSDP2's all-gather and reduce-scatter buffers, DTensor's "
                 "redistributions and torch's pipeline buffers are not modelled on their own)")


def alternatives(layout: RunLayout) -> list[tuple[str, RunLayout]]:
    """Layouts on the same devices that keep less per rank, least change first: each higher zero stage
    over dp, then the optimizer offloaded to host memory (ZeRO-Offload)."""
    stage = zero_stage(layout)
    out: list[tuple[str, RunLayout]] = []
    if layout.dp > 1 and layout.strategy in ("ddp", "zero1", "zero2"):
        names = {1: "zero1", 2: "zero2", 3: "fsdp"}
        out += [(names[z], replace(layout, strategy=names[z], zero=z, wrap="auto" if z == 3 else None))
                for z in range(stage + 1, 4)]
    elif layout.dp > 1 and layout.strategy == "parallel":
        out += [(f"zero={z}", replace(layout, zero=z, wrap="auto" if z == 3 else None)) for z in range(stage + 1, 4)]
    if layout.offload == "none" and layout.dp > 1 and stage >= 1:
        out.append(("offload='optimizer'", replace(layout, offload="optimizer")))
    elif layout.offload == "none" and out:
        what, top = out[-1]
        out.append((f"{what} with offload='optimizer'", replace(top, offload="optimizer")))
    return out


def microbatches(layout: RunLayout, local_batch: int, accumulate_grad_batches: int = 1) -> int:
    """Micro-batches per step: the pipeline's (``sw.Parallel.effective_microbatches``), else the accumulation's."""
    if layout.strategy in ("parallel", PP):
        if layout.microbatches is not None:
            return layout.microbatches
        if accumulate_grad_batches > 1:
            return accumulate_grad_batches
        return layout.pp if layout.pp > 1 and local_batch % layout.pp == 0 else 1
    return accumulate_grad_batches


def planner_layout(layout: RunLayout) -> Layout:
    """The formula planner's :class:`~shardwise.plan.specs.Layout` for a run's layout (cp, its mode, sequence
    parallelism and ep included; sequence parallelism only where there is a tp group to split over)."""
    stage = zero_stage(layout)
    if layout.strategy == "ps":
        return Layout("ddp", max(1, layout.dp - layout.servers))
    split: dict[str, Any] = dict(cp=layout.cp, cp_mode=layout.cp_mode,
                                 sequence_parallel=layout.sequence_parallel and layout.tp > 1, ep=layout.ep)
    if stage < 3:
        return Layout(("ddp", "zero1", "zero2")[stage], layout.dp, layout.tp, layout.pp, **split)
    if layout.replicate > 1:
        return Layout("hsdp", layout.dp, layout.tp, layout.pp, shard_group=layout.shard_size, **split)
    # Units per pipeline layer or block prefetch the next (FSDP); the zero3 preset's size-based units do too,
    # but the formula planner's "zero3" counts one live unit, as DeepSpeed's estimator does.
    return Layout("zero3" if layout.strategy == "zero3" else "fsdp", layout.dp, layout.tp, layout.pp, **split)


def training_spec(layout: RunLayout, local_batch: int, m: int, k: int) -> TrainingSpec:
    """The formula planner's recipe for this run: autocast precision, the run's options, its micro-batches."""
    lay = planner_layout(layout)
    return TrainingSpec(global_batch=lay.dp * max(1, local_batch // m) * m, micro_batch=max(1, local_batch // m),
                        precision="fp32" if layout.precision == "32" else "bf16-mixed",
                        optimizer=_OPTIMIZER_NAMES.get(k, "adamw"),
                        activation_checkpointing=layout.activation_checkpointing,
                        schedule=layout.schedule if layout.schedule in SCHEDULES else "1f1b", chunks=layout.chunks,
                        offload=layout.offload if zero_stage(layout) else "none", no_sync=True,
                        autocast=layout.precision not in TRUE_DTYPES)  # "bf16-true": 16-bit activations throughout


def _activations_and_buffers(model: nn.Module, layout: RunLayout, local: int, m: int, k: int,
                             memory: int) -> tuple[int, dict[str, int], list[str]]:
    spec = ModelSpec.from_module(model)
    lay = planner_layout(layout)
    notes: list[str] = []
    if not spec.is_transformer:
        notes.append("activations not counted (no transformer config on the model)")
        if lay.tp > 1 or lay.pp > 1 or lay.cp > 1:
            lay = replace(lay, tp=1, pp=1, cp=1, cp_mode=None, sequence_parallel=False)
    training = training_spec(layout, local, m, k)
    cluster = ClusterSpec.with_devices(lay.devices, devices_per_node=lay.devices, device_memory_bytes=max(1, memory))
    problem = check_layout(spec, cluster, training, lay)
    if problem:
        notes.append(f"activations and buffers not estimated: {problem}")
        return 0, {}, notes
    est = estimate(spec, cluster, training, lay)  # interleaved as itself: its memory is the schedule table's
    return est.activation_bytes, dict(est.buffers), notes


__all__ = ["NotModelled", "RunPlan", "alternatives", "microbatches", "plan_run", "planner_layout", "training_spec"]
