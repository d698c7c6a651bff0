"""FSDP (zero=3) and HSDP composed with tensor and pipeline parallelism equal training in one process.

``Parallel(dp=, tp=, pp=, zero=3, replicate=)`` on the project's GPT and on
Hugging Face GPT-2 and Llama built from tiny configs, each run with gradient
accumulation and global-norm clipping, must give the losses and final weights
of single-process training.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from tiny_hf import gpt2, llama, logits_loss
from torch import nn

import shardwise as sw
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.strategies.parallel import Parallel
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
# Hugging Face models: lr 1e-4, as in tests/strategies/test_hf_models.py (near-zero gradients under Adam).
ADAMW_HF = functools.partial(torch.optim.AdamW, lr=1e-4)
CLIP = 0.05  # small enough that every step clips: the global norm must be right on every rank


def gpt(tie: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_weights=tie))
    for b in m.blocks:
        # The key bias's gradient is identically zero (softmax ignores a shift shared by all keys).
        b.attn.k.bias.requires_grad_(False)
    return m


def tied_gpt() -> nn.Module:
    return gpt(tie=True)


def fit(strategy, devices: int, make) -> sw.FitResult:
    hf = make in (gpt2, llama)
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, gradient_clip_val=CLIP,
                      accumulate_grad_batches=2).fit(
        make(), CharText(stdlib_text(20_000), 16), logits_loss if hf else lm_loss, ADAMW_HF if hf else ADAMW,
        batch_size=8, max_steps=2)


_refs: dict[str, sw.FitResult] = {}


def reference(make) -> sw.FitResult:
    if make.__name__ not in _refs:
        _refs[make.__name__] = fit("single", 1, make)
    return _refs[make.__name__]


LAYOUTS = {
    "dp2-tp2": (4, dict(dp=2, tp=2, zero=3)),
    "dp2-pp2-gpipe": (4, dict(dp=2, pp=2, zero=3, schedule="gpipe", microbatches=2)),
    "dp2-pp2-1f1b": (4, dict(dp=2, pp=2, zero=3, schedule="1f1b", microbatches=2)),
    "dp2-pp2-interleaved": (4, dict(dp=2, pp=2, zero=3, schedule="interleaved", chunks=2, microbatches=2)),
    "dp2-tp2-pp2": (8, dict(dp=2, tp=2, pp=2, zero=3, microbatches=2)),
    "hsdp-dp4-tp2-r2": (8, dict(dp=4, tp=2, zero=3, replicate=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_fsdp_composed_equals_single(same_run, layout):
    devices, kw = LAYOUTS[layout]
    run = fit(Parallel(**kw), devices, gpt)
    same_run(reference(gpt), run)
    for s in run.stats:
        # Bytes are attributed to the group they crossed, and add up to the total.
        assert sum(s["comm_by_group"].values()) == s["comm_bytes"]
        assert s["comm_by_name"].get("fsdp_all_gather", 0) > 0 and s["comm_by_name"].get("fsdp_reduce_scatter", 0) > 0
        for dim in ("tp", "pp"):
            if kw.get(dim, 1) > 1:
                assert s["comm_by_group"].get(dim, 0) > 0, (dim, s["comm_by_group"])
    if kw.get("replicate", 1) > 1:
        assert all(s["comm_by_name"].get("hsdp_all_reduce", 0) > 0 for s in run.stats)
        assert all({"dp_shard", "dp_replicate"} <= set(s["comm_by_group"]) for s in run.stats)
    # Parameters are sharded: each rank holds about 1/(dp/replicate) of its (tp, pp) slice's.
    full = sum(v.numel() * v.element_size() for k, v in reference(gpt).state_dict.items() if "k.bias" not in k)
    shard = kw["dp"] // kw.get("replicate", 1) * kw.get("tp", 1) * kw.get("pp", 1)
    assert max(s["params_bytes"] for s in run.stats) < 1.25 * full / shard


def test_fsdp_with_weights_tied_across_stages_and_vocab_parallel_tp(same_run):
    """The tied embedding/head is a vocabulary-parallel slice on each stage; its FSDP pieces are summed over pp."""
    same_run(reference(tied_gpt), fit(Parallel(dp=2, tp=2, pp=2, zero=3, microbatches=2), 8, tied_gpt))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_hf_models_fsdp_composed_equals_single(same_run, make, layout):
    devices, kw = LAYOUTS[layout]
    same_run(reference(make), fit(Parallel(**kw), devices, make))


def test_invalid_compositions_are_refused_before_any_process_starts(no_spawn):
    with pytest.raises(ValueError, match=r"replicate=2 \(HSDP\) needs zero=3"):
        Parallel(dp=4, replicate=2, zero=1)
    with pytest.raises(ValueError, match=r"replicate=3 must divide the data-parallel size dp=4"):
        sw.Trainer(Parallel(dp=4, zero=3, replicate=3), 4)
    with pytest.raises(ValueError, match=r"offload='optimizer' needs zero >= 1"):
        Parallel(dp=2, offload="optimizer")
    with pytest.raises(ValueError, match=r"zero=2 with weights tied across pipeline stages is not supported"):
        sw.Trainer(Parallel(dp=2, pp=2, zero=2), 4, accelerator="cpu", progress=False).fit(
            tied_gpt(), CharText(stdlib_text(5_000), 16), lm_loss, ADAMW, batch_size=8, max_steps=1)
    with pytest.raises(ValueError, match=r"PP puts every device in the pipeline"):
        sw.PP(zero=3)


def test_parallel_is_a_strategy_name():
    assert "parallel" in sw.available_strategies()
    assert isinstance(sw.resolve("parallel"), Parallel)
    assert sw.Trainer("parallel", 4).sizes == {"pp": 1, "dp": 4, "tp": 1}
    assert sw.Parallel(dp=2, tp=2, pp=2, zero=3, replicate=2).describe(8).label() == \
        "parallel(dp=2, tp=2, pp=2, zero=3, replicate=2)"
