"""Naive model parallelism: one process, consecutive layers on a list of devices.

The textbook form of model parallelism (the ``cuda:0`` / ``cuda:1`` example of
PyTorch's "Single-Machine Model Parallel" tutorial): the layers of the model
are cut into as many contiguous groups as there are devices (the same cut as
a pipeline, :func:`shardwise.parallel.pp.build.stage_starts`), each group lives
on its device, and the activation is moved to the next device between
groups. Autograd moves the gradients back by itself. Only one device works at
a time, which is the problem pipelining (GPipe's micro-batches) solves; what
it buys is memory: each device holds only its layers' weights and
optimizer states.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardwise.parallel.pp.build import pipeline_layers, stage_starts
from shardwise.step import first_named


def _move(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_move(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    return x


class NaiveModelParallel(nn.Module):
    """``model``'s layers spread over ``devices`` in order; ``forward`` hops devices between groups.

    Args:
        model: anything :func:`~shardwise.parallel.pp.build.pipeline_layers` can flatten.
        devices: one device per group, e.g. ``["cuda:0", "cuda:1"]`` (``["cpu", "cpu"]`` works too).
        split_points: layer names where groups 1.. begin; None balances parameter counts.

    ``moves`` counts the activations moved between groups and ``moved_bytes`` their
    bytes (forward only), so the cost of the hops is visible even on CPU.
    """

    def __init__(self, model: nn.Module, devices: Sequence[str | torch.device],
                 split_points: Sequence[str] | None = None) -> None:
        super().__init__()
        if not devices:
            raise ValueError("naive model parallel needs at least one device")
        self.devices = [torch.device(d) for d in devices]
        layers = pipeline_layers(model)
        starts = stage_starts(layers, len(self.devices), split_points) + [len(layers)]
        self.groups = nn.ModuleList()
        self.names: list[list[str]] = []
        for i, dev in enumerate(self.devices):
            part = layers[starts[i]:starts[i + 1]]
            self.groups.append(nn.Sequential(*[m for _, m in part]).to(dev))
            self.names.append([n for n, _ in part])
        self._check_no_sharing()
        # State-dict keys of the original model, to give back its layout: each tensor's
        # first key (a tied weight's saved name) and, for every key, its tensor.
        state = model.state_dict(keep_vars=True)
        self._keys = {id(t): k for k, t in first_named(state.items())}
        self._key_ids = {k: id(t) for k, t in state.items()}
        self.moves = 0
        self.moved_bytes = 0

    def _check_no_sharing(self) -> None:
        seen: dict[int, int] = {}
        for i, g in enumerate(self.groups):
            for p in g.parameters():
                j = seen.setdefault(id(p), i)
                if j != i:
                    raise ValueError(f"a parameter of shape {list(p.shape)} is used by layer groups {j} and {i} "
                                     f"(a tied weight); it cannot live on both {self.devices[j]} and "
                                     f"{self.devices[i]}: untie it or choose split points that keep its users together")

    def forward(self, x: Any) -> Any:
        for dev, g in zip(self.devices, self.groups):
            if isinstance(x, torch.Tensor) and x.device != dev:
                self.moves += 1
                self.moved_bytes += x.numel() * x.element_size()
            x = _move(x, dev)
            x = g(x)
        return x

    @property
    def output_device(self) -> torch.device:
        return self.devices[-1]

    def device_of(self, group: int) -> torch.device:
        return self.devices[group]

    def original_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict in the original model's keys, on CPU."""
        out = {id(t): t.detach().cpu().clone() for _, t in self.held()}
        # Tied or aliased entries share one tensor: give each key its value.
        return {k: out[i] for k, i in self._key_ids.items() if i in out}

    def held(self) -> list[tuple[str, torch.Tensor]]:
        """(first state-dict key, tensor) of every parameter and persistent buffer, once each."""
        # parameters() and buffers() list each tensor once, and the two never share one.
        return [(self._keys[id(t)], t) for t in [*self.parameters(), *self.buffers()] if id(t) in self._keys]


__all__ = ["NaiveModelParallel"]
