"""One seed for every generator a run draws from: Python's ``random``, numpy's global one and torch's (CPU and
every CUDA device), and torch's deterministic algorithms.

``Trainer(seed=)`` calls :func:`seed_everything` on every rank before the model
is built, and ``Trainer(deterministic=True)`` calls :func:`deterministic`. The
ranks draw the same streams (as torch's own seeding does); what differs between
ranks is the samples they hold. A DataLoader worker is seeded by torch itself:
its ``random``, numpy and torch generators start from the loader's base seed
plus the worker's index, and the base seed comes from the loader's generator,
seeded here (the Trainer's loaders: from ``seed``).
"""
from __future__ import annotations

import os
import random

import torch

try:  # numpy is not one of torch's requirements: seeded where it is installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy is in every environment the tests run in
    np = None  # type: ignore[assignment]

# cuBLAS's deterministic mode needs a fixed workspace, set before its first use (torch's reproducibility notes).
CUBLAS_WORKSPACE = ":4096:8"


def seed_everything(seed: int, workers: bool = True) -> int:
    """Seed Python's ``random``, numpy's global generator and torch's (CPU and CUDA) with ``seed``; returns it.

    ``workers`` (Lightning's argument): DataLoader workers are seeded from torch's generator, which this
    seeds (torch gives each worker ``random``, numpy and torch seeds of the loader's base seed and its index);
    ``workers=False`` is refused, as there is no unseeded mode to choose.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    if not workers:
        raise ValueError("seed_everything(workers=False) is not supported: DataLoader workers are always seeded "
                         "from torch's generator (their random, numpy and torch), which this call seeds")
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)
    torch.manual_seed(seed)  # (every CUDA device's generator too)
    return seed


def deterministic() -> None:
    """torch's deterministic algorithms (an operation without one raises), cuDNN without benchmarking, and the
    cuBLAS workspace its deterministic mode needs."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


__all__ = ["deterministic", "seed_everything"]
