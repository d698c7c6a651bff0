"""engine="torch"'s CUDA-only engines at world size 1 in a NCCL group of one: torch's context_parallel (a cp mesh
of one rank), torch.nn.DataParallel (over cuda:0) and nn.SyncBatchNorm (under torch's DDP), each equal to the
single-device CUDA run. On CPU each is refused before start
(tests/strategies/torch_engine/test_torch_engine_cuda_only.py).

Context parallelism at world size 1: the Trainer gives ``sw.Parallel(cp=N)`` N ranks, so the engine is built on
``sw.Parallel()`` directly (what the Trainer runs for cp=N, with N=1): context_parallel's block, its buffers cut
for one rank, the ring attention of one step through SDPA's DTensor dispatch, forward and backward, positions
passed by the hook. It runs in float32: the ring has no float64 kernel (flash, cuDNN: half only; efficient:
float32 and half), so the check is float32's, with SGD, whose step does not amplify rounding as Adam's does on
the parameters whose gradient is zero in exact arithmetic (the key biases).
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardwise as sw
from shardwise.comm.topology import Topology
from shardwise.parallel.dp.torch_dp import torch_sync_batchnorm
from shardwise.strategies.torch_engine.wrappers import TorchCP
from shardwise.workloads import CharText, Workload, digits, gpt, stdlib_text

from .test_gpu_world1 import ATOL, RTOL

pytestmark = pytest.mark.timeout(600)

SGD = functools.partial(torch.optim.SGD, lr=0.1)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CP_RTOL, CP_ATOL = 1e-4, 1e-6  # float32: the same efficient-attention kernel, reached through the ring or not
SDPA = F.scaled_dot_product_attention  # context_parallel's block puts its ring attention in its place


def fit(strategy, model, work, optimizer, steps=6, **kw):
    return sw.Trainer(strategy, 1, accelerator="cuda", progress=False, memory_check="off", **kw).fit(
        model, work.train, work.loss_fn, optimizer, batch_size=32, max_steps=steps)


def llama_work() -> Workload:
    pytest.importorskip("transformers")  # optional on the GPU machine
    import tiny_hf

    return Workload("llama", tiny_hf.llama, CharText(stdlib_text(20_000), 16), tiny_hf.logits_loss, batch_size=32)


@pytest.mark.parametrize("model, zero", [("gpt", 0), ("gpt", 3), ("llama", 0)])
def test_world1_torch_context_parallel_on_nccl_equals_single(nccl_group_of_one, same_run, model, zero):
    """torch's DDP (zero=0) or FSDP2 (zero=3) over dp x cp of one, each step inside context_parallel."""
    work = gpt() if model == "gpt" else llama_work()
    ref = fit("single", work.make_model(), work, SGD)
    ring, attend = [], work.make_model()
    for m in attend.modules():  # did attention run with torch's ring attention in place of SDPA?
        if type(m).__name__.endswith("Attention"):  # ours, LlamaAttention
            m.register_forward_pre_hook(lambda *_: ring.append(F.scaled_dot_product_attention is not SDPA))
    run = fit(TorchCP(of=sw.Parallel(zero=zero)), attend, work, SGD)
    assert ring and all(ring)
    same_run(ref, run, rtol=CP_RTOL, atol=CP_ATOL)



@pytest.mark.float64
def test_world1_torch_data_parallel_on_nccl_equals_single(nccl_group_of_one, same_run):
    """torch.nn.DataParallel over [cuda:0]: its scatter, replicas and gather of one device."""
    work = digits()
    same_run(fit("single", work.make_model(), work, ADAMW),
             fit(sw.DP(engine="torch"), work.make_model(), work, ADAMW), rtol=RTOL, atol=ATOL)


def batchnorm_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


@pytest.mark.float64
def test_world1_torch_sync_batchnorm_on_nccl_equals_single(nccl_group_of_one, same_run):
    """torch's nn.SyncBatchNorm under torch's DDP (in a group of one it normalises as BatchNorm does)."""
    work, kinds = digits(), []
    model = batchnorm_mlp()
    model.register_forward_pre_hook(lambda m, _: kinds.append(type(m[1]).__name__))
    run = fit("ddp", model, work, ADAMW, engine="torch", sync_batchnorm=True)
    assert set(kinds) == {"SyncBatchNorm"}
    same_run(fit("single", batchnorm_mlp(), work, ADAMW), run, rtol=RTOL, atol=ATOL)  # running stats included


@pytest.mark.float64
def test_torch_sync_batchnorm_takes_cuda_inputs(nccl_group_of_one):
    model = torch_sync_batchnorm(batchnorm_mlp().cuda(), Topology.create(torch.device("cuda", 0)))
    assert isinstance(model[1], nn.SyncBatchNorm)
    model(torch.randn(8, 64, device="cuda")).sum().backward()  # on CPU: "expected input tensor to be on GPU"
    assert model[1].weight.grad is not None
