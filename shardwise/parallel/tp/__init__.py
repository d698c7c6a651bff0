"""Tensor parallelism, both engines: our split layers (``layers.py``), the plans that name them (``plans.py``),
their application (``apply.py``), sequence parallelism; torch's DTensor tensor parallelism (``torch_tp.py``)."""
