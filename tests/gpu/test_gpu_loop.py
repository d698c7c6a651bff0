"""The hand-written loop on a CUDA device: CPU batches reach a model on the GPU, fp16 through
``model.backward``, parameter groups carried onto FSDP shards, all in a group of one (``sw.init`` from plain
python). Skipped without CUDA (tests/gpu/conftest.py); the CPU side is tests/loop/test_loop_device.py."""
from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def group_of_one():
    sw.init(accelerator="cuda")
    yield
    sw.teardown()


def by_dim(params):
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_the_docs_loop_runs_on_cuda_with_cpu_datasets(group_of_one, strategy, precision):
    work = digits()
    model, opt = sw.setup(work.make_model(), by_dim, strategy=strategy, accelerator="cuda", precision=precision)
    loader = sw.prepare_dataloader(work.train, batch_size=64, model=model)
    assert loader.pin_memory
    for _, (x, y) in zip(range(3), loader):
        assert x.is_cuda and y.is_cuda
        loss = work.loss_fn(model(x), y)
        model.backward(loss)
        sw.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    cpu_batch = (torch.randn(4, 64), torch.zeros(4, dtype=torch.long))  # straight from a CPU tensor
    assert model(cpu_batch[0]).is_cuda
