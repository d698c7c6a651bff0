"""One process, one device (``strategy="single"``): the reference every other strategy must equal."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardwise.layout import RunLayout
from shardwise.strategies.base import Strategy


@dataclass
class Single(Strategy):
    """One process, one device: the reference every other strategy must equal."""

    name: ClassVar[str] = "single"

    def layout(self, devices: int) -> RunLayout:
        if devices != 1:
            raise ValueError(f"strategy 'single' runs on exactly one device, got devices={devices}")
        return RunLayout(self.name)
