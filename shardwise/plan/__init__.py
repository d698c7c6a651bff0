"""The planner: will a training run fit, how fast will it go, and which parallel layout is best.

>>> from shardwise.plan import KNOWN_MODELS, ClusterSpec, TrainingSpec, plan, recommend
>>> ests = plan(KNOWN_MODELS["llama2-7b"], ClusterSpec.with_devices(8), TrainingSpec(activation_checkpointing=True))
>>> best = recommend(ests)

Memory follows the ZeRO paper (model states) and Korthikanti et al. 2022
(activations); communication the ring algorithms' bus-bandwidth factors in an
alpha-beta model; time 6 (or 8 with recomputation) x parameters x tokens FLOPs
plus the pipeline bubble plus the communication nothing hides. Layouts
split the sequence too: context parallelism (ring attention, Liu et al. 2023;
DeepSpeed-Ulysses, Jacobs et al. 2023) and Megatron sequence parallelism
(Korthikanti et al. 2022). The command
line is ``shardwise plan`` (see :mod:`shardwise.plan.command.cli`). For a real module
under the layout of one run (:class:`shardwise.layout.RunLayout`),
:func:`plan_run` lays out the model states exactly, rank by rank
(:mod:`shardwise.plan.states`): the Trainer's memory check.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# Public name -> module, imported on first use: ``shardwise plan --help`` and the command line's argument
# definitions (:mod:`shardwise.plan.command.args`) must not pay for importing torch.
_PUBLIC: dict[str, str] = {
    "BytesPerParam": "shardwise.plan.memory",
    "ClusterSpec": "shardwise.plan.specs",
    "Collective": "shardwise.plan.comm",
    "Estimate": "shardwise.plan.estimate",
    "GPU_PRESETS": "shardwise.plan.specs",
    "KNOWN_MODELS": "shardwise.plan.model",
    "Layout": "shardwise.plan.specs",
    "ModelSpec": "shardwise.plan.model",
    "NotModelled": "shardwise.plan.states",
    "RankStates": "shardwise.plan.states",
    "RunPlan": "shardwise.plan.run",
    "Trace": "shardwise.plan.model",
    "TrainingSpec": "shardwise.plan.specs",
    "bytes_per_param": "shardwise.plan.memory",
    "bytes_sent": "shardwise.plan.comm",
    "check_fit": "shardwise.plan.fit",
    "check_layout": "shardwise.plan.estimate",
    "collective_time": "shardwise.plan.comm",
    "enumerate_layouts": "shardwise.plan.estimate",
    "estimate": "shardwise.plan.estimate",
    "group_link": "shardwise.plan.comm",
    "known_model": "shardwise.plan.model",
    "layer_activation_bytes": "shardwise.plan.memory",
    "model_state_bytes": "shardwise.plan.memory",
    "plan": "shardwise.plan.estimate",
    "plan_run": "shardwise.plan.run",
    "rank_states": "shardwise.plan.states",
    "recommend": "shardwise.plan.estimate",
    "shard_numel": "shardwise.plan.memory",
    "sharded_numel": "shardwise.plan.memory",
    "staging_bytes": "shardwise.plan.staging",
    "trace_factory": "shardwise.plan.trace",
    "trace_module": "shardwise.plan.trace",
    "training_time_s": "shardwise.plan.timing",
}


class _Package(types.ModuleType):
    """The package, whose public ``estimate`` is the function: importing the submodule of the same name
    (``shardwise.plan.estimate``) would otherwise bind the module over it, and ``from shardwise.plan import
    estimate`` would then give the module or the function depending on what ran before."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _PUBLIC and value.__name__ == _PUBLIC[name]:
            return  # the submodule stays reachable through sys.modules; the name stays the function's
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'shardwise.plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "BytesPerParam", "ClusterSpec", "Collective", "Estimate", "GPU_PRESETS", "KNOWN_MODELS", "Layout", "ModelSpec",
    "NotModelled", "RankStates", "RunPlan", "Trace", "TrainingSpec", "bytes_per_param", "bytes_sent", "check_fit",
    "check_layout", "collective_time", "enumerate_layouts", "estimate", "group_link", "known_model",
    "layer_activation_bytes", "model_state_bytes", "plan", "plan_run", "rank_states", "recommend", "shard_numel",
    "sharded_numel", "staging_bytes", "trace_factory", "trace_module", "training_time_s",
]
