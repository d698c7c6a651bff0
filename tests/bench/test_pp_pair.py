"""The pp pair (`shardwise bench --pairs pp`) at every rank count the benchmarks use: every stage gets a layer."""
from __future__ import annotations

import pytest

from shardwise.bench.pp.mp import mlp, pp_sizes
from shardwise.parallel.pp.build import stage_starts
from shardwise.parallel.pp.layers import pipeline_layers

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("stages", [2, 4, 8, 16])
def test_pp_pair_model_fills_every_stage(stages):
    # The 16-core machine's run at 8 ranks stopped at "the model has 7 pipeline layers ..., fewer than the 8
    # stages asked for": the pair's model is sized to the stage count now.
    depth, micro = pp_sizes(stages)
    layers = pipeline_layers(mlp(64, depth))
    starts = stage_starts(layers, stages) + [len(layers)]
    assert len(starts) == stages + 1 and all(a < b for a, b in zip(starts, starts[1:]))
    assert micro >= stages  # 1F1B reaches its steady phase (one forward, one backward) on every stage
    assert (depth, micro) == ((4, 4) if stages <= 4 else (stages, stages))  # 4 ranks: the recorded pair unchanged
