"""The data-parallel strategies: the family's shared setup (``family.py``) and its presets ddp, zero1/2,
zero3/fsdp/hsdp, and the threaded single-process ``dp``."""
