"""dp x tp x pp composition (with DDP or ZeRO over dp) equals training in one process."""
from __future__ import annotations

import functools

import pytest
import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.strategies.parallel import Parallel
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def make_gpt(tie: bool = False) -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_weights=tie))
    for b in m.blocks:
        # The key bias's gradient is identically zero (softmax ignores a shift shared by all keys);
        # frozen so Adam's amplification of its rounding noise does not decide the comparison.
        b.attn.k.bias.requires_grad_(False)
    return m


def make_tied_gpt() -> GPT:
    return make_gpt(tie=True)


def fit(strategy, devices, make=make_gpt, steps=3, clip=None):
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, gradient_clip_val=clip).fit(
        make(), CharText(stdlib_text(20_000), 16), lm_loss, ADAMW, batch_size=8, max_steps=steps)


@pytest.fixture(scope="module")
def reference():
    return fit("single", 1)


@pytest.mark.parametrize("zero,schedule", [(1, "1f1b"), (0, "gpipe")])
def test_3d_on_8_ranks_equals_single(reference, same_run, zero, schedule):
    run = fit(Parallel(dp=2, tp=2, pp=2, zero=zero, schedule=schedule, microbatches=2), 8)
    same_run(reference, run)
    names = set().union(*(s["comm_by_name"] for s in run.stats))
    assert {"tp", "pp"} <= names and ({"zero_reduce_scatter", "zero_all_gather"} <= names if zero else "ddp" in names)


def test_zero1_over_dp_with_pipeline_tied_weights_and_clipping(same_run):
    ref = fit("single", 1, make_tied_gpt, clip=0.05)
    same_run(ref, fit(Parallel(dp=2, pp=2, zero=1, microbatches=2), 4, make_tied_gpt, clip=0.05))


def test_tp_inside_pipeline_stages_with_clipping(same_run):
    ref = fit("single", 1, clip=0.05)
    same_run(ref, fit(Parallel(dp=1, tp=2, pp=2, schedule="gpipe", microbatches=4), 4, clip=0.05))


def test_interleaved_chunks_each_get_their_own_ddp(reference, same_run):
    same_run(reference, fit(Parallel(dp=2, pp=2, schedule="interleaved", chunks=2, microbatches=2), 4))


def test_sizes_and_options_are_checked():
    assert Parallel(tp=2, pp=2).sizes(8) == {"pp": 2, "dp": 2, "tp": 2}
    with pytest.raises(ValueError, match=r"dp\*tp\*pp = 2\*2\*2 = 8 does not equal the world size 4"):
        sw.Trainer(Parallel(dp=2, tp=2, pp=2), 4)
    with pytest.raises(ValueError, match=r"zero=4: valid are 0 \(DDP over dp\), 1, 2 \(ZeRO stage 1/2\) and 3"):
        Parallel(zero=4)
