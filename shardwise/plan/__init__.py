"""The planner: will a training run fit, how fast will it go, and which parallel layout is best.

>>> from shardwise.plan import KNOWN_MODELS, ClusterSpec, TrainingSpec, plan, recommend
>>> ests = plan(KNOWN_MODELS["llama2-7b"], ClusterSpec.with_devices(8), TrainingSpec(activation_checkpointing=True))
>>> best = recommend(ests)

Memory follows the ZeRO paper (model states) and Korthikanti et al. 2022
(activations); communication the ring algorithms' bus-bandwidth factors in an
alpha-beta model; time 6 (or 8 with recomputation) x parameters x tokens FLOPs
plus the pipeline bubble plus the communication nothing hides. The command
line is ``shardwise plan`` (see :mod:`shardwise.plan.cli`). For a real module
under the layout of one run (:class:`shardwise.layout.RunLayout`),
:func:`plan_run` lays out the model states exactly, rank by rank
(:mod:`shardwise.plan.states`): the Trainer's memory check.
"""
from __future__ import annotations

from shardwise.plan.comm import Collective, bytes_sent, collective_time, group_link
from shardwise.plan.estimate import Estimate, check_layout, enumerate_layouts, estimate, plan, recommend
from shardwise.plan.fit import check_fit
from shardwise.plan.memory import (BytesPerParam, bytes_per_param, layer_activation_bytes, model_state_bytes,
                                   shard_numel, sharded_numel)
from shardwise.plan.model import KNOWN_MODELS, ModelSpec, Trace, known_model
from shardwise.plan.run import RunPlan, plan_run
from shardwise.plan.specs import GPU_PRESETS, ClusterSpec, Layout, TrainingSpec
from shardwise.plan.states import NotModelled, RankStates, rank_states
from shardwise.plan.timing import training_time_s
from shardwise.plan.trace import trace_factory, trace_module

__all__ = [
    "BytesPerParam", "ClusterSpec", "Collective", "Estimate", "GPU_PRESETS", "KNOWN_MODELS", "Layout", "ModelSpec",
    "NotModelled", "RankStates", "RunPlan", "Trace", "TrainingSpec", "bytes_per_param", "bytes_sent", "check_fit",
    "check_layout", "collective_time", "enumerate_layouts", "estimate", "group_link", "known_model",
    "layer_activation_bytes", "model_state_bytes", "plan", "plan_run", "rank_states", "recommend", "shard_numel",
    "sharded_numel", "trace_factory", "trace_module", "training_time_s",
]
