"""TODO docstring."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from shardwise.strategies.base import Strategy

if TYPE_CHECKING:
    pass


@dataclass
class Single(Strategy):
    """One process, one device: the reference every other strategy must equal."""

    name: ClassVar[str] = "single"

    def sizes(self, devices: int) -> dict[str, int]:
        if devices != 1:
            raise ValueError(f"strategy 'single' runs on exactly one device, got devices={devices}")
        return {"dp": 1, "tp": 1, "pp": 1}
