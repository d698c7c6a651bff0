"""tests/gpu: run only where CUDA is present; every test here is skipped cleanly on a CPU machine.

`make test` (pytest over tests/) collects this directory and skips it on CPU;
`make test-gpu` runs it alone on the GPU machine (docs/gpu.md). Nothing here is
read by the library: no environment variable or hook changes what shardwise does.
"""
from __future__ import annotations

import datetime as dt
import pathlib

import pytest
import torch
import torch.distributed as dist

HERE = pathlib.Path(__file__).parent
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (tests/gpu runs on the GPU machine)")


def pytest_collection_modifyitems(config, items):
    # A conftest's collection hook sees the whole session's items: mark only ours.
    for item in items:
        if HERE in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(NO_CUDA)


@pytest.fixture(scope="module")
def nccl_group_of_one():
    """A NCCL process group of one, joined by Trainer.fit (as under `shardwise run --nproc 1`)."""
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=dt.timedelta(minutes=2))
    try:
        yield
    finally:
        dist.destroy_process_group()
