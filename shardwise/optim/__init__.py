"""Around the user's optimizer: parameter groups carried onto shards (``param_groups.py``) and the wrapper that
shares an optimizer's groups and state (``wrapped.py``)."""
