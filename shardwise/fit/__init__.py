"""The fit layer: ``sw.Trainer`` and everything a fit runs, top to bottom.

:mod:`~shardwise.fit.trainer` (the Trainer and the launch), :mod:`~shardwise.fit.options`
(its options as one frozen value), :mod:`~shardwise.fit.prestart.checks`, :mod:`~shardwise.fit.prestart.preflight`
and :mod:`~shardwise.fit.prestart.tp_check` (what is refused before any process starts),
:mod:`~shardwise.fit.job` (one rank's run), :mod:`~shardwise.fit.steps` (the step loop),
:mod:`~shardwise.fit.evaluate`, :mod:`~shardwise.fit.callbacks` and :mod:`~shardwise.fit.progress`.
Nothing below this layer imports it (docs/architecture.md).
"""
