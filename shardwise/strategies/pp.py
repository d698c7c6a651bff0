"""TODO docstring."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from shardwise.strategies.parallel import Parallel

if TYPE_CHECKING:
    pass


@dataclass
class PP(Parallel):
    """Pipeline parallelism over all devices (``pp = devices``): the preset of :class:`Parallel`."""

    name: ClassVar[str] = "pp"

    def __post_init__(self) -> None:
        if (self.dp, self.tp, self.pp, self.zero) != (-1, 1, 1, 0):
            raise ValueError("PP puts every device in the pipeline; for dp/tp/zero use sw.Parallel(dp=, tp=, pp=, "
                             "zero=)")
        super().__post_init__()

    def sizes(self, devices: int) -> dict[str, int]:
        return {"dp": 1, "tp": 1, "pp": devices}
