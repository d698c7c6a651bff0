"""The strategies layer: one file per strategy over the mechanisms of :mod:`shardwise.parallel`.

:mod:`~shardwise.strategies.base` (the base class and capabilities),
:mod:`~shardwise.strategies.registry` (names to classes, loaded on first use),
single, ps, tp, pp, parallel and naive_mp at this level; the data-parallel family in ``dp/``
(:mod:`~shardwise.strategies.dp.family`, the presets' shared setup and clipping, then ddp, zero, fsdp and the
threaded dp); ``engine="torch"``'s wrappers and its choice in ``torch_engine/``.
"""
