"""Pipeline parallelism, both engines: the split (``build.py``, ``layers.py``), where stages sit
(``placement.py``), the schedules and their timelines, the runtime (``run.py``) and the split backward of the
zero-bubble schedules; torch's pipelining (``torch_pp.py``); naive model parallelism (layers on devices, no
micro-batches)."""
