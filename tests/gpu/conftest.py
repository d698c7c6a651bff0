"""tests/gpu: run only where CUDA is present; every test here is skipped cleanly on a CPU machine.

`make test` (pytest over tests/) collects this directory and skips it on CPU;
`make test-gpu` runs it alone on the GPU machine (docs/gpu.md). Nothing here is
read by the library: no environment variable or hook changes what shardwise does.
"""
from __future__ import annotations

import pathlib

import pytest
import torch

HERE = pathlib.Path(__file__).parent
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (tests/gpu runs on the GPU machine)")


def pytest_collection_modifyitems(config, items):
    # A conftest's collection hook sees the whole session's items: mark only ours.
    for item in items:
        if HERE in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(NO_CUDA)
