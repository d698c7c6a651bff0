"""The planner's Layout reads its size rules from shardwise/dims.py instead of restating them."""
from __future__ import annotations

import pytest

from shardwise.dims import ParallelDims
from shardwise.plan.specs import Layout


def test_layout_sizes_are_parallel_dims() -> None:
    assert Layout("hsdp", 8, tp=2, cp=2, shard_group=4).dims == ParallelDims(dp_replicate=2, dp_shard=4, cp=2, tp=2)
    lay = Layout("fsdp", 8, cp=2, ep=4)
    assert (lay.devices, lay.shard_size, lay.expert_shard_size) == (16, 16, 4)


@pytest.mark.parametrize(("layout", "message"), [
    (dict(strategy="ddp", dp=6, ep=4), "ep=4 must divide dp\\*cp = 6\\*1"),
    (dict(strategy="hsdp", dp=8, shard_group=3), "^HSDP shard_size=3 must divide the data-parallel size 8$"),
    (dict(strategy="hsdp", dp=8, shard_group=2, ep=2), "ep=2 with HSDP"),
    (dict(strategy="ddp", dp=2, tp=0), "^tp=0: parallel sizes must be >= 1$"),
])
def test_layout_errors_are_those_of_dims(layout: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Layout(**layout)  # type: ignore[arg-type]
