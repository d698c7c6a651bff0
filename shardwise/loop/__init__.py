"""Hand-written training loops: the second door into the strategies, beside the Trainer.

* :mod:`shardwise.loop.prepared`: ``sw.init``, ``sw.setup`` and the :class:`~shardwise.loop.prepared.Prepared`
  model it returns;
* :mod:`shardwise.loop.calls`: what a loop calls on that model: clipping, ``sw.save``/``sw.load``, ``sw.no_sync``;
* :mod:`shardwise.loop.torch_clip`: torch's own clip functions on it, routed to the strategy's;
* :mod:`shardwise.loop.data`: ``sw.prepare_dataloader``, ``sw.gather_for_metrics``, ``sw.gather``,
  ``sw.all_reduce_mean``.
"""
