"""The mechanisms: one wing per paradigm, each holding both engines (ours and torch's) for it.

``parallelize.py`` is the one door for our engine (the pipeline split, then tp, then the data-parallel family);
``dp/``, ``tp/``, ``pp/``, ``cp/`` and ``ps/`` are the wings; ``ep.py`` (experts), ``checkpointing.py``
(activation checkpointing), ``compiling.py``, ``accounting.py`` and ``dtensor.py`` (what both engines read of
a DTensor) serve every wing. docs/architecture.md draws the plan.
"""
