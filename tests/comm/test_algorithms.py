"""Naive and ring all-reduce on point-to-point: same result as the backend's, exact bytes, usable in DDP."""
from __future__ import annotations

import functools

import pytest
import torch

import shardwise as sw
from shardwise import launch
from shardwise.comm.algorithms import (
    chunk_sizes,
    naive_allreduce,
    naive_bytes,
    ring_allreduce,
    ring_bytes,
)
from shardwise.comm.topology import Topology
from shardwise.strategies.dp.ddp import allreduce_fn
from shardwise.workloads import digits

pytestmark = pytest.mark.timeout(240)

SHAPES = [(1,), (2,), (3,), (7,), (1001,), (3, 5, 7), (64, 33)]
ALGOS = {
    "naive": naive_allreduce,
    "ring": ring_allreduce,
    # Tiny segments: many messages per chunk in flight, so the pipeline's ordering is exercised.
    "ring-seg": functools.partial(ring_allreduce, segment_bytes=12),
}


def _against_backend(rank: int, device: torch.device) -> None:
    topo = Topology.create(device)
    comm = topo.comm("dp")
    n = comm.size
    for shape in SHAPES:
        numel = torch.Size(shape).numel()
        g = torch.Generator().manual_seed(100 * rank + numel)
        # Integer-valued floats: every summation order gives the same bits, so results compare exactly.
        ints = torch.randint(-1000, 1000, shape, generator=g).float()
        reals = torch.randn(shape, generator=g, dtype=torch.float64)
        for op in ("sum", "avg"):
            for base in (ints, reals):
                expected = base.clone()
                comm.all_reduce(expected, name="test.native")
                if op == "avg":
                    expected /= n
                for algo, fn in ALGOS.items():
                    got = base.clone()
                    sent0, recv0 = topo.stats.sent, topo.stats.received
                    handle = fn(got, comm, "test.algo", op=op)
                    handle.wait()
                    sent, received = topo.stats.sent - sent0, topo.stats.received - recv0
                    where = f"{algo} {op} shape={shape} world={n} rank={rank}"
                    if base is ints and op == "sum":
                        assert torch.equal(got, expected), where
                    else:
                        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=where)
                    # Every rank holds the very same bits (replicas must not drift apart).
                    # (as JSON numbers: Python's float repr round-trips every float64 exactly)
                    everyone = comm.all_gather_object(got.flatten().tolist(), name="test.gather")
                    assert all(x == everyone[0] for x in everyone), where
                    formula = (naive_bytes if algo == "naive" else ring_bytes)(
                        numel, n, got.element_size(), rank)
                    assert (sent, received) == formula, f"{where}: bytes {(sent, received)} != {formula}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_same_result_as_backend_and_exact_bytes(world):
    launch.spawn(_against_backend, world)


def _non_contiguous(rank: int, device: torch.device) -> None:
    topo = Topology.create(device)
    comm = topo.comm("dp")
    for fn in (naive_allreduce, ring_allreduce):
        t = (torch.arange(30, dtype=torch.float32).view(5, 6) * (rank + 1)).t()  # transposed: not contiguous
        assert not t.is_contiguous()
        fn(t, comm, "test.nc").wait()
        assert torch.equal(t, torch.arange(30, dtype=torch.float32).view(5, 6).t() * 3), fn.__name__  # 1x + 2x


def test_non_contiguous_tensor_is_written_back():
    launch.spawn(_non_contiguous, 2)


def test_formulas():
    # Even chunks: the ring moves 2(N-1)/N x S per rank, the naive master (N-1) x S.
    for n in (2, 4, 8):
        s = 1 << 20
        for r in range(n):
            assert ring_bytes(s // 4, n, 4, r) == (2 * (n - 1) * s // n,) * 2
        assert naive_bytes(s // 4, n, 4, 0) == ((n - 1) * s,) * 2
        assert naive_bytes(s // 4, n, 4, 1) == (s, s)
    # Uneven chunks: 7 elements on 3 ranks are chunks of 3, 2, 2.
    assert chunk_sizes(7, 3) == [3, 2, 2]
    assert [ring_bytes(7, 3, 1, r) for r in range(3)] == [(9, 9), (10, 9), (9, 10)]
    # Sent and received balance over the ring.
    for numel, n in ((1001, 4), (2, 3), (1, 4)):
        assert sum(ring_bytes(numel, n, 4, r)[0] for r in range(n)) == \
            sum(ring_bytes(numel, n, 4, r)[1] for r in range(n))


def test_bad_arguments():
    comm = Topology.create(torch.device("cpu")).comm("dp")
    with pytest.raises(ValueError, match="unknown reduction 'max'; valid: sum, avg"):
        ring_allreduce(torch.ones(3), comm, "x", op="max")
    with pytest.raises(TypeError, match="op='avg' needs a floating-point tensor, got torch.int64"):
        naive_allreduce(torch.ones(3, dtype=torch.long), comm, "x", op="avg")
    with pytest.raises(ValueError, match=r"unknown all-reduce algorithm 'tree'; valid: \['naive', 'native', 'ring'\]"):
        allreduce_fn("tree")
    # Selectable by name without importing this module first (allreduce_fn imports it).
    assert allreduce_fn("ring") is ring_allreduce and allreduce_fn("naive") is naive_allreduce


# ---- inside DDP ---------------------------------------------------------------
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _fit(strategy, devices, steps=4):
    work = digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=48, max_steps=steps)


@pytest.fixture(scope="module")
def reference():
    return _fit("single", 1)


@pytest.mark.float64
@pytest.mark.parametrize("algo,devices", [("ring", 3), ("naive", 2)])
def test_ddp_with_p2p_allreduce_equals_single(reference, same_run, algo, devices):
    run = _fit(sw.DDP(allreduce=algo), devices)
    same_run(reference, run)
    numel = sum(p.numel() for p in digits().make_model().parameters())
    assert numel % 3 == 1  # uneven ring chunks on 3 ranks
    for s in run.stats:
        want = (ring_bytes if algo == "ring" else naive_bytes)(numel, devices, 8, s["rank"])[0]  # float64
        assert s["comm_bytes_per_step"] == want  # one bucket (default 25 MB cap) per step


def test_objects_travel_as_json_never_as_pickles():
    from shardwise.comm import Comm
    from shardwise.comm.collectives import CommStats

    comm = Comm(None, CommStats())
    assert comm.all_gather_object(("ddp.check", [3, 4], None), name="t") == [["ddp.check", [3, 4], None]]
    with pytest.raises(TypeError, match="Object of type Tensor is not JSON serializable"):
        comm.all_gather_object(torch.zeros(1), name="t")
