"""Pipeline parallelism over all devices (``strategy="pp"``): the preset of
:class:`~shardwise.strategies.parallel.Parallel` with ``pp = devices``."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from shardwise.dims import CP, DP, EP, TP, ParallelDims
from shardwise.dims import PP as PIPELINE
from shardwise.layout import RunLayout
from shardwise.strategies.parallel import Parallel

# The sizes of Parallel's mesh (and its data-parallel form) that PP fixes: every device is a pipeline stage.
FIXED = (DP, TP, PIPELINE, CP, EP, "zero", "replicate")


@dataclass
class PP(Parallel):
    """Pipeline parallelism over all devices (``pp = devices``): the preset of :class:`Parallel`.

    The sizes of :class:`Parallel` (dp, tp, pp, cp, ep, zero, replicate) are refused, with the
    ``sw.Parallel(...)`` that composes them: PP would otherwise build none of them.
    """

    name: ClassVar[str] = "pp"

    def __post_init__(self) -> None:
        defaults = {f.name: f.default for f in fields(Parallel) if f.name in FIXED}
        given = {k: getattr(self, k) for k in FIXED if getattr(self, k) != defaults[k]}
        if given:
            shown = ", ".join(f"{k}={v}" for k, v in given.items())
            fix = shown if PIPELINE in given else f"{PIPELINE}=<stages>, {shown}"
            raise ValueError(f"PP puts every device in the pipeline (pp = devices): it takes none of "
                             f"{', '.join(FIXED)}, got {shown}; use sw.Parallel({fix}), which composes them")
        super().__post_init__()

    def layout(self, devices: int) -> RunLayout:
        return self._layout(ParallelDims(pp=devices))
