"""What the ``shardwise`` command runs besides training: ``demo``, ``verify`` and the pictures (``plots``)."""
