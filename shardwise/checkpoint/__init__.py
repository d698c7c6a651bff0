"""Layout-free checkpoints: any layout saves, any other resumes.

* :mod:`~shardwise.checkpoint.store`: save, load, verify and export a checkpoint
  directory (torch.distributed.checkpoint underneath, loaded only when used);
* :mod:`~shardwise.checkpoint.held`: what one rank holds of each tensor;
* :mod:`~shardwise.checkpoint.pieces`: those holdings as the rectangles DCP writes and reads;
* :mod:`~shardwise.checkpoint.tools`: ``shardwise checkpoint ls`` and ``export``, as functions returning data.
"""
