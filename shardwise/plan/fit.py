"""``check_fit``: the planner's answer for a real module, before the trainer starts the workers."""
from __future__ import annotations

import math

import torch
from torch import nn

from shardwise.dims import DP, PP, TP
from shardwise.plan.estimate import Estimate, check_layout, estimate
from shardwise.plan.model import ModelSpec
from shardwise.plan.specs import ClusterSpec, Layout, TrainingSpec
from shardwise.plan.trace import trace_module

# The trainer's strategy names -> how model states sit on the data-parallel dimension.
_STATES = {"single": "ddp", DP: "ddp", "ddp": "ddp", TP: "ddp", PP: "ddp", "ps": "ddp",
           "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp": "fsdp", "hsdp": "hsdp"}


def check_fit(model: nn.Module, strategy: str, dp: int, tp: int, pp: int, device_memory_bytes: int,
              batch_per_device: int, precision: str, optimizer: str, *, sample_input: torch.Tensor | None = None,
              seq_len: int | None = None, activation_checkpointing: bool = False,
              shard_group: int | None = None) -> tuple[bool, str]:
    """Will ``model`` trained under ``strategy`` on a dp x tp x pp mesh fit in ``device_memory_bytes`` per device?

    Returns ``(fits, message)``; the message gives the per-device breakdown
    and, when it does not fit, the cheapest data-parallel strategy that would.
    Activations come from the model's transformer config when it has one
    (``model.cfg``/``model.config``), else from tracing a meta copy of the
    model on ``sample_input``'s shape (one micro-batch; nothing is
    allocated); without either, only model states and buffers are counted.
    """
    if strategy not in _STATES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(sorted(_STATES))}")
    spec = ModelSpec.from_module(model, seq_len=seq_len)
    if sample_input is not None:
        tr = trace_module(model, tuple(sample_input.shape), sample_input.dtype)
        spec = ModelSpec(name=spec.name, params=spec.params, largest_layer_params=spec.largest_layer_params,
                         param_numels=spec.param_numels, trace=tr) if not spec.is_transformer else spec
    states = _STATES[strategy]
    note = ""
    if (tp > 1 or pp > 1) and not spec.is_transformer:
        # No shape to split by: assume an even split of parameters (and of activations over tp).
        spec = _even_split(spec, tp, pp)
        tp = pp = 1
        note = " (tp/pp split assumed even: the model has no transformer config)"
    cluster = ClusterSpec.with_devices(dp * tp * pp, devices_per_node=dp * tp * pp,
                                       device_memory_bytes=device_memory_bytes)
    training = TrainingSpec(global_batch=dp * batch_per_device, micro_batch=batch_per_device, seq_len=seq_len,
                            precision=precision, optimizer=optimizer,
                            activation_checkpointing=activation_checkpointing)
    layout = Layout(states, dp, tp, pp, shard_group=shard_group if states == "hsdp" else None)
    problem = check_layout(spec, cluster, training, layout)
    if problem:
        return True, f"not checked: {problem}"
    est = estimate(spec, cluster, training, layout)
    total = est.total_bytes
    if strategy == "ps":
        # Workers keep parameters and gradients; the optimizer lives on the server ranks.
        total -= est.optimizer_bytes
        note += " (parameter-server worker: optimizer states live on the servers)"
    fits = total <= device_memory_bytes
    msg = (f"{strategy} on dp={dp} tp={layout.tp} pp={layout.pp}: {fmt_bytes(total)} of "
           f"{fmt_bytes(device_memory_bytes)} per device ({breakdown(est, strategy == 'ps')}){note}")
    if est.activation_bytes == 0 and not spec.is_transformer and spec.trace is None:
        msg += "; activations not counted (pass sample_input)"
    if fits:
        return True, "fits: " + msg
    return False, "does not fit: " + msg + _suggestion(spec, cluster, training, layout, device_memory_bytes)


def breakdown(est: Estimate, without_optimizer: bool = False) -> str:
    parts = [("parameters", est.params_bytes), ("gradients", est.grads_bytes),
             ("optimizer", 0 if without_optimizer else est.optimizer_bytes),
             ("activations", est.activation_bytes), ("buffers", est.buffer_bytes)]
    return ", ".join(f"{name} {fmt_bytes(v)}" for name, v in parts)


def fmt_bytes(n: float) -> str:
    """Decimal units (1 GB = 10^9 bytes, as the ZeRO paper counts)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _even_split(spec: ModelSpec, tp: int, pp: int) -> ModelSpec:
    tr = spec.trace
    if tr is not None:
        tr = type(tr)(tr.input_shape, tr.input_dtype, tr.batch, math.ceil(tr.saved_bytes / tp),
                      math.ceil(tr.saved_float_bytes / tp), tr.layer_outputs, tr.flops / (tp * pp))
    return ModelSpec(name=spec.name, params=math.ceil(spec.params / (tp * pp)),
                     largest_layer_params=math.ceil(spec.unit_params / tp), trace=tr)


def _suggestion(spec: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                memory: int) -> str:
    """The least sharding that fits at the same mesh, else what would help."""
    for name in ("zero1", "zero2", "zero3"):
        if Layout(name, layout.dp).zero_stage <= layout.zero_stage:
            continue
        alt = Layout(name, layout.dp, layout.tp, layout.pp)
        if check_layout(spec, cluster, training, alt) is None:
            e = estimate(spec, cluster, training, alt)
            if e.total_bytes <= memory:
                return f"; {name} would need {fmt_bytes(e.total_bytes)}"
    est = estimate(spec, cluster, training, layout)
    if est.activation_bytes > est.model_states_bytes and not training.activation_checkpointing:
        return "; activations dominate: try activation checkpointing or a smaller batch per device"
    return "; try more devices, a larger tp/pp, or a smaller model"
