"""Data parallelism, both engines: our DDP, ZeRO and FSDP wrappers (and the sharding, buckets and units they
share), sync BatchNorm, the threaded single-process DataParallel; torch's DDP, ZeroRedundancyOptimizer and FSDP2
builders (``torch_dp.py``) and its meta-device initialisation (``torch_meta.py``)."""
