"""Tensor parallelism over all devices (``strategy="tp"``, ``tp = devices``).

The mechanism is :mod:`shardwise.parallel.tp.apply` (a plan applied with the
layers of :mod:`shardwise.parallel.tp.layers`); this strategy picks the plan,
counts the loss once per tp group, clips by the norm of the unsplit model and
gathers the slices for a full state dict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from shardwise import dims
from shardwise.comm.topology import Topology
from shardwise.layout import RunLayout
from shardwise.parallel.tp.apply import apply_tp, clip_grad_norm_, gather_state
from shardwise.parallel.tp.plans import Plan, Style
from shardwise.step import OptimizerFactory, on_device, unwrap
from shardwise.strategies.base import HasTPPlan, Strategy


@dataclass
class TP(Strategy, HasTPPlan):
    """Tensor parallelism over all devices (``tp = devices``); see the module docstring.

    Args:
        plan: module-pattern -> style dict, a :class:`Plan`, a built-in name
            (``"gpt"``, ``"gpt2"``, ``"llama"``) or None to pick by model type.
    """

    plan: Plan | dict[str, str | Style] | str | None = None
    name: ClassVar[str] = "tp"

    def tensor_parallel_plan(self) -> Plan | dict[str, str | Style] | str | None:
        return self.plan

    def layout(self, devices: int) -> RunLayout:
        return RunLayout(self.name, tp=devices)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = apply_tp(on_device(model, topo.device), self.plan, topo.comm(dims.TP))
        return model, optimizer_fn(model.parameters())

    def owns_loss(self, topo: Topology) -> bool:
        return topo.coord(dims.TP) == 0

    def clip_grad_norm(self, model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
        return clip_grad_norm_(unwrap(model).parameters(), max_norm, tp=topo.comm(dims.TP))

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        return gather_state(unwrap(model), topo.comm(dims.TP))
