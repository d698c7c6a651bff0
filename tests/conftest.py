"""Shared test helpers: every distributed test runs real gloo processes on CPU.

Ranks run on a session-wide :class:`shardwise.pool.WorkerPool`: the same
processes serve every test (each test still gets a fresh store and process
group), so torch and transformers are imported once per rank, not once per
test. A test that needs a clean interpreter in every rank is marked
``@pytest.mark.fresh_processes`` and gets ``launch.spawn``'s fresh processes;
``SHARDWISE_TEST_POOL=0`` turns the pool off for the whole run.
"""
from __future__ import annotations

import os

import pytest
import torch

from shardwise import launch
from shardwise.pool import WorkerPool

# Tests run ranks as processes on a small machine: one thread each keeps them
# from fighting over cores (the library divides cores itself; this only makes
# the single-process reference runs cheap too).
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def assert_same_run(ref, run, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Losses of every step equal within rtol; every final weight within rtol of its tensor's scale.

    Weights are compared with an absolute tolerance of ``rtol * max|w|`` per
    tensor (see shardwise.verify.compare for why element-wise relative error
    is meaningless for near-zero weights under Adam).
    """
    assert len(ref.losses) == len(run.losses)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol)
    assert set(ref.state_dict) == set(run.state_dict)
    for k, a in ref.state_dict.items():
        b = run.state_dict[k]
        scale = float(a.abs().max()) if a.numel() and a.is_floating_point() else 0.0
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol + rtol * scale, msg=lambda m: f"{k}: {m}")


@pytest.fixture
def same_run():
    return assert_same_run


class Spawned(Exception):
    """Raised instead of starting worker processes under the ``no_spawn`` fixture."""


@pytest.fixture
def no_spawn(monkeypatch):
    """Make starting worker processes an error, for checks that must fire before any process starts.

    Yields the exception class, so a test can expect the spawn attempt itself.
    """
    def spawn(*args, **kwargs):
        raise Spawned("processes were started")
    monkeypatch.setattr(launch, "spawn", spawn)
    return Spawned


@pytest.fixture(scope="session")
def worker_pool():
    with WorkerPool(8) as pool:
        yield pool


@pytest.fixture(autouse=True)
def _ranks_from_the_pool(request, monkeypatch):
    """Route every ``launch.spawn`` of this test to the session's pool, unless marked ``fresh_processes``."""
    if request.node.get_closest_marker("fresh_processes") or os.environ.get("SHARDWISE_TEST_POOL") == "0":
        return
    monkeypatch.setattr(launch, "spawn", request.getfixturevalue("worker_pool").spawn)
