"""``engine="torch"``: strategies that train with PyTorch's own engines (``wrappers.py``), and the choice of
one for a strategy, with the refusals of what torch's engines do not run (``choice.py``)."""
