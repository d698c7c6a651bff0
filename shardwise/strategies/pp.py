"""Pipeline parallelism over all devices (``strategy="pp"``): the preset of :class:`~shardwise.strategies.parallel.Parallel` with ``pp = devices``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardwise.dims import ParallelDims
from shardwise.layout import RunLayout
from shardwise.strategies.parallel import Parallel


@dataclass
class PP(Parallel):
    """Pipeline parallelism over all devices (``pp = devices``): the preset of :class:`Parallel`."""

    name: ClassVar[str] = "pp"

    def __post_init__(self) -> None:
        if (self.dp, self.tp, self.pp, self.zero) != (-1, 1, 1, 0):
            raise ValueError("PP puts every device in the pipeline; for dp/tp/zero use sw.Parallel(dp=, tp=, pp=, "
                             "zero=)")
        super().__post_init__()

    def layout(self, devices: int) -> RunLayout:
        return self._layout(ParallelDims(pp=devices))
