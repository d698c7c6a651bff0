"""Every strategy at world size 1 on CUDA, in a NCCL process group of one, equals the single-device run.

With one GPU, NCCL cannot hold two ranks (one device per rank), so this is the
NCCL-side check a one-GPU machine can make: the library joins a NCCL group,
puts every tensor on cuda:0, runs the CUDA-only code (side streams, pinned
offload rows, non_blocking copies, CUDA memory accounting). Collectives of a
group of one are no-ops in :class:`shardwise.comm.Comm`, so NCCL traffic itself
is checked by the multi-GPU runs listed in docs/gpu.md.
"""
from __future__ import annotations

import functools

import pytest
import torch

import shardwise as sw
from shardwise.workloads import digits, gpt

# "The same maths" is claimed in float64 (tests/conftest.py): in float32 a GPU's summation order (cuBLAS split-K,
# atomics in backward kernels) against the reference's moved single weights past 1e-4 under Adam (seen on an
# H200: blocks.0.mlp.fc1.weight of the GPT under tp, 1.3e-5 absolute against 9.7e-6 allowed). In float64 that
# noise is about 1e-13, far under the tolerance, while a real difference (a dropped bucket) is 1e-3.
pytestmark = [pytest.mark.timeout(600), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
RTOL, ATOL = 1e-9, 1e-12  # tests/conftest.py: FLOAT64_RTOL, FLOAT64_ATOL


def fit(strategy, work, steps=6, accelerator="cuda", **kw):
    return sw.Trainer(strategy, 1, accelerator=accelerator, progress=False, memory_check="off", **kw).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=32, max_steps=steps)


@pytest.fixture(scope="module")
def reference():
    return {"mlp": fit("single", digits()), "gpt": fit("single", gpt())}


# The offload forms run the pinned host rows and non_blocking copies.
MLP_STRATEGIES = ["ddp", "dp", "zero1", "zero2", "zero3", "fsdp", "hsdp",
                  sw.ZeRO2(offload="optimizer"), sw.FSDP(offload="optimizer"), sw.FSDP(offload="all")]


@pytest.mark.parametrize("strategy", MLP_STRATEGIES, ids=str)
def test_world1_on_nccl_equals_single(nccl_group_of_one, reference, same_run, strategy):
    try:
        run = fit(strategy, digits())
    except ValueError as e:  # a strategy that cannot run on one device says so up front
        pytest.skip(f"{strategy} at devices=1: {e}")
    same_run(reference["mlp"], run, rtol=RTOL, atol=ATOL)
    s = run.stats[0]
    assert s["cuda_peak_allocated_bytes"] > 0
    assert s["cuda_peak_reserved_bytes"] >= s["cuda_peak_allocated_bytes"]


@pytest.mark.parametrize("strategy", ["tp", "pp", "fsdp"])
def test_world1_gpt_on_nccl_equals_single(nccl_group_of_one, reference, same_run, strategy):
    try:
        run = fit(strategy, gpt())
    except ValueError as e:
        pytest.skip(f"{strategy} at devices=1: {e}")
    ref = reference["gpt"]
    assert all(t.dtype == torch.float64 for t in ref.state_dict.values() if t.is_floating_point())
    same_run(ref, run, rtol=RTOL, atol=ATOL)  # every weight, k.bias too: float64 leaves Adam no noise to amplify


def test_cuda_single_equals_cpu_single(reference, same_run):
    # Same model, same data, another device: float64 on both, so only summation orders differ.
    same_run(fit("single", digits(), accelerator="cpu"), reference["mlp"], rtol=RTOL, atol=ATOL)


def test_cpu_run_has_no_cuda_stats():
    run = fit("single", digits(), steps=2, accelerator="cpu")
    assert "cuda_peak_allocated_bytes" not in run.stats[0]


def test_side_stream_orders_work():
    from shardwise.comm.streams import SideStream

    side = SideStream(torch.device("cuda", 0))
    assert side.active
    x = torch.randn(1 << 20, device="cuda")
    y = x * 2  # queued on the compute stream
    with side.enter(y):
        y.mul_(3)  # the side stream waits for the multiply above first
    side.join()
    torch.testing.assert_close(y, x * 6)


def test_offload_rows_are_pinned():
    from shardwise.comm.streams import pinned_like

    t = torch.randn(16, device="cuda")
    host = pinned_like(t, torch.device("cpu"), t.device)
    assert host.is_pinned() and torch.equal(host.cuda(), t)


@pytest.mark.parametrize("work", ["mlp", "gpt"])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp", "hsdp", "tp"])
def test_world1_torch_engines_on_nccl_equal_single(nccl_group_of_one, reference, same_run, strategy, work):
    """engine="torch": torch's DDP (zero1: with ZeroRedundancyOptimizer), FSDP2 (on a mesh of one; hsdp's 1 x 1)
    and parallelize_module (a tp mesh of one) in the NCCL group of one, on cuda:0."""
    run = fit(strategy, digits() if work == "mlp" else gpt(), engine="torch")
    same_run(reference[work], run, rtol=RTOL, atol=ATOL)


def test_world1_torch_sequence_parallel_on_nccl_equals_single(nccl_group_of_one, reference, same_run):
    """engine="torch" with sequence parallelism: SequenceParallel norms and the gathers of a tp mesh of one."""
    run = fit(sw.Parallel(sequence_parallel=True, engine="torch"), gpt())
    same_run(reference["gpt"], run, rtol=RTOL, atol=ATOL)
