"""Naive model parallelism as a strategy (``strategy="naive_mp"``): one process, the layers spread over devices.

The mechanism is :class:`~shardwise.parallel.pp.naive_mp.NaiveModelParallel`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.checkpoint.held import Held, held_state
from shardwise.comm.topology import Topology
from shardwise.layout import RunLayout
from shardwise.optim.param_groups import named_params
from shardwise.parallel.pp.naive_mp import NaiveModelParallel, _move
from shardwise.precision import widened
from shardwise.step import LossFn, OptimizerFactory, StepRun
from shardwise.strategies.base import OwnDevices, SplitsModel, Strategy


@dataclass
class NaiveMP(Strategy, SplitsModel, OwnDevices):
    """Naive model parallel as a strategy: one process, the model spread over ``devices``.

    ``devices=None`` takes every CUDA device (at least two), else two CPU
    "devices" (same code path, no speed-up: a way to test it anywhere).
    """

    devices: list[str] | None = None
    split_points: list[str] | None = None
    name: ClassVar[str] = "naive_mp"

    def _devices(self) -> list[str]:
        if self.devices:
            return list(self.devices)
        n = torch.cuda.device_count()
        return [f"cuda:{i}" for i in range(n)] if n >= 2 else ["cpu", "cpu"]

    def layout(self, devices: int) -> RunLayout:
        # One process drives every device of the split model: the process group is of size 1.
        if self.devices and devices not in (1, len(self.devices)):  # as sw.DP's device_ids: the list is the size
            raise ValueError(f"devices={devices} but NaiveMP(devices=...) names {len(self.devices)} devices; pass "
                             f"devices={len(self.devices)} (or 1) to the Trainer, or list {devices} devices")
        return RunLayout(self.name, devices_per_process=len(self.devices) if self.devices else devices)

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        nmp = NaiveModelParallel(model, self._devices(), self.split_points)
        return nmp, optimizer_fn(nmp.parameters())

    def train_step(self, model: nn.Module, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                   topo: Topology, run: StepRun = StepRun()) -> torch.Tensor | None:
        out_dev = model.output_device
        k = len(micro_batches)
        total: torch.Tensor | float = 0.0
        for x, y in micro_batches:
            # Autocast of the primary device's type covers every device of that type (all CUDA
            # devices, or the CPU list of the tests); the loss scale is the fp16 scaler's.
            with run.forward_context(topo.device):
                loss = loss_fn(model(x), _move(y, out_dev))  # type: ignore[arg-type]
            (widened(loss) * (run.loss_scale / k)).backward()
            total = total + widened(loss.detach())
        return (total / k).to(topo.device)  # type: ignore[union-attr]

    def full_state_dict(self, model: nn.Module, topo: Topology) -> dict[str, torch.Tensor]:
        return model.original_state_dict()  # type: ignore[operator,no-any-return]

    def param_names(self, model: nn.Module) -> dict[int, str]:
        return named_params(model.held())  # type: ignore[operator]

    def checkpoint_held(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology) -> list[Held]:
        """Every layer group's tensors under the original model's names, whole (one process holds them all)."""
        return held_state(model.held(), [], optimizer)  # type: ignore[operator]
