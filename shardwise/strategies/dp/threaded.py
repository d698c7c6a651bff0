"""Single-process data parallel (``strategy="dp"``): one process drives every device, in threads.

The mechanism (scatter, replicate, parallel_apply, gather) is :mod:`shardwise.parallel.dp.threaded`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.layout import RunLayout
from shardwise.parallel.dp.threaded import DataParallelModule, DeviceLike
from shardwise.step import OptimizerFactory
from shardwise.strategies.base import Strategy


@dataclass
class DP(Strategy):
    """Single-process data parallel (``strategy="dp"``): one process, every device in threads.

    Args:
        device_ids: the devices to use, primary first (ints are indices of the
            run's accelerator type). Default: ``devices`` CUDA devices
            ``cuda:0..devices-1``, or on CPU ``devices`` replicas of the CPU.
    """

    device_ids: Sequence[DeviceLike] | None = None
    name: ClassVar[str] = "dp"

    def __post_init__(self) -> None:
        self._count = len(self.device_ids) if self.device_ids is not None else 1

    def layout(self, devices: int) -> RunLayout:
        # One process: every device is driven from it, so the process group is of size 1.
        if self.device_ids is not None and devices not in (1, len(self.device_ids)):
            raise ValueError(f"devices={devices} but device_ids names {len(self.device_ids)} devices")
        count = len(self.device_ids) if self.device_ids is not None else devices
        # The one place a strategy remembers a layout: device_list() without a count lists the devices of the
        # last layout asked for (the Trainer asks once, at construction), as it always has.
        self._count = count
        return RunLayout(self.name, devices_per_process=count)

    def device_list(self, primary: torch.device) -> list[torch.device]:
        """The devices replicas run on, ``primary``'s type unless ``device_ids`` says otherwise."""
        if self.device_ids is not None:
            return [torch.device(primary.type, d) if isinstance(d, int) else torch.device(d)
                    for d in self.device_ids]
        if primary.type == "cuda":
            have = torch.cuda.device_count()
            if self._count > have:
                raise ValueError(f"DP on {self._count} devices, but only {have} CUDA devices exist")
            return [torch.device("cuda", i) for i in range(self._count)]
        return [primary] * self._count

    def setup(self, model: nn.Module, optimizer_fn: OptimizerFactory,
              topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
        devices = self.device_list(topo.device)
        if devices[0] != topo.device:
            # The trainer puts batches and targets on the run's device; outputs are gathered on devices[0].
            raise ValueError(f"DP's primary device {devices[0]} must be the run's device {topo.device}; "
                             f"list {topo.device} first in device_ids")
        model = model.to(devices[0])
        return DataParallelModule(model, devices), optimizer_fn(model.parameters())
