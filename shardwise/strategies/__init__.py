"""The strategies layer: one file per strategy over the mechanisms of :mod:`shardwise.parallel`.

:mod:`~shardwise.strategies.base` (the base class and capabilities),
:mod:`~shardwise.strategies.registry` (names to classes, loaded on first use),
:mod:`~shardwise.strategies.data_parallel` (the data-parallel presets' shared
setup and clipping), and single, ddp, dp, ps, zero, fsdp, tp, pp, parallel, naive_mp.
"""
