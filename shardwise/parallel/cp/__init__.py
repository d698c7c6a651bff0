"""Context parallelism, both engines: ring and all-to-all attention (``attention.py``), their installation on a
model and the sequence split (``apply.py``); torch's ``context_parallel`` (``torch_cp.py``)."""
