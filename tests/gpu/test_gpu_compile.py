"""``compile=True`` with inductor, on CUDA and in float32: compiled blocks train as eager does, with the fp16
scaler too. Skipped without CUDA (tests/gpu/conftest.py). On CPU the suite runs every strategy's capture with
``aot_eager`` (tests/parallel/test_compile.py): inductor's code generation costs 15-35 s per process there."""
from __future__ import annotations

import functools

import pytest
import torch

import shardwise as sw
from shardwise.workloads import gpt

pytestmark = [pytest.mark.timeout(600)]


def fit(compile, precision):
    work = gpt(n_layer=2, n_embd=64, n_head=4, block=32, max_chars=20_000)
    return sw.Trainer("single", 1, accelerator="cuda", progress=False, compile=compile, precision=precision).fit(
        work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3), batch_size=8,
        max_steps=4)


@pytest.mark.parametrize("precision", ["32", "16-mixed"])
def test_inductor_blocks_train_as_eager_on_cuda(precision):
    eager, compiled = fit(False, precision), fit(True, precision)
    # float32 kernels that inductor fuses round differently from eager's: a tolerance, not equality
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-3, atol=1e-3)
    assert compiled.stats[0]["compile_frames"] > 0 and compiled.stats[0]["compile_recompiles"] == 0
