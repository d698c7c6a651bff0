"""A RunLayout holds its ParallelDims (no loose sizes beside them); the keyword form and
``dataclasses.replace`` keep working, and dp's grouping always follows the data-parallel form."""
from __future__ import annotations

from dataclasses import fields, replace

import pytest

from shardwise.dims import ParallelDims
from shardwise.layout import RunLayout


def test_the_sizes_live_in_dims_only() -> None:
    lay = RunLayout("parallel", dp=4, tp=2, pp=2, zero=3, replicate=2)
    assert {f.name for f in fields(lay)} & {"dp", "tp", "pp", "cp", "ep"} == set()
    assert lay.dims == ParallelDims(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    assert (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.devices) == (4, 2, 2, 1, 1, 16)


def test_dp_is_grouped_by_the_form() -> None:
    assert RunLayout("ddp", dp=4).dims.dp_replicate == 4  # DDP: all replicas
    assert RunLayout("zero2", dp=4, zero=2).dims.dp_shard == 4  # ZeRO: all shards
    # replace regroups too: DDP's replicas do not leak into the FSDP alternative the planner suggests
    assert replace(RunLayout("ddp", dp=4), zero=3).dims == ParallelDims(dp_shard=4)


def test_replace_takes_sizes_and_dims() -> None:
    lay = RunLayout("parallel", dp=2, tp=2, cp=2, cp_mode="ring")
    assert replace(lay, tp=1).dims == ParallelDims(dp_replicate=2, cp=2)
    assert replace(lay, dims=ParallelDims(tp=4)).dims == ParallelDims(tp=4)
    assert RunLayout.of("parallel", ParallelDims(dp_replicate=2, dp_shard=2), zero=3).replicate == 2


def test_the_rules_are_those_of_dims() -> None:
    with pytest.raises(ValueError, match="parallel sizes must be >= 1"):
        RunLayout("ddp", dp=0)
    with pytest.raises(ValueError, match="must divide dp"):
        RunLayout("parallel", dp=2, ep=3)
