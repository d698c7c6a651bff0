"""engine="torch" options on CUDA at world size 1, in a NCCL group of one: FSDP2's CPUOffloadPolicy with a CUDA
model (pinned shards on the host, copied to cuda:0 at each gather; clipping with host gradients), a meta-device
model offloaded, and DDP's bfloat16 compress hook, which torch runs on NCCL only.

The CPU suite (tests/strategies/torch_engine/test_torch_engine_options.py) checks the same options on gloo, where
offload stays on the CPU, unpinned, and the bfloat16 hook is refused.
"""
from __future__ import annotations

import functools

import pytest
import torch

import shardwise as sw
from shardwise.models import MLP
from shardwise.workloads import digits, gpt

pytestmark = [pytest.mark.timeout(600), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
RTOL, ATOL = 1e-9, 1e-12  # tests/conftest.py: FLOAT64_RTOL, FLOAT64_ATOL


def fit(strategy, work, model=None, steps=6, accelerator="cuda", **kw):
    return sw.Trainer(strategy, 1, accelerator=accelerator, progress=False, memory_check="off",
                      gradient_clip_val=0.05, **kw).fit(
        model if model is not None else work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=32,
        max_steps=steps)


@pytest.fixture(scope="module")
def reference():
    return {"mlp": fit("single", digits()), "gpt": fit("single", gpt())}


@pytest.mark.parametrize("work", ["mlp", "gpt"])
@pytest.mark.parametrize("strategy", [sw.FSDP, sw.HSDP], ids=lambda c: c.name)
def test_world1_fsdp2_cpu_offload_on_nccl_equals_single(nccl_group_of_one, reference, same_run, strategy, work):
    """FSDP2's CPUOffloadPolicy(pin_memory=True) on a CUDA model: the shards, their gradients and the optimizer
    step on the host, the gathers on cuda:0."""
    run = fit(strategy(offload="all", engine="torch"), digits() if work == "mlp" else gpt())
    same_run(reference[work], run, rtol=RTOL, atol=ATOL)


def test_world1_meta_model_offloaded_by_fsdp2_equals_single(nccl_group_of_one, reference, same_run):
    """A model built on the meta device (digits' MLP, seeded as the Trainer seeds): its shards get host memory,
    its buffers the device's, each module initialised by reset_parameters()."""
    with torch.device("meta"):
        model = MLP(64, 128, 2, 10)
    run = fit(sw.FSDP(offload="all", engine="torch"), digits(), model=model)
    same_run(reference["mlp"], run, rtol=RTOL, atol=ATOL)


def test_world1_ddp_bf16_hook_equals_our_bf16_reduction(nccl_group_of_one, same_run):
    """DDP(reduce_dtype="bfloat16"): torch's bf16_compress_hook (NCCL only) and our bfloat16 reduction give the
    same run (a world of one divides by one)."""
    ours = fit(sw.DDP(reduce_dtype="bfloat16"), digits())
    same_run(ours, fit(sw.DDP(reduce_dtype="bfloat16", engine="torch"), digits()), rtol=RTOL, atol=ATOL)
