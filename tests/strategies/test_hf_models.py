"""Hugging Face models, unchanged and built from configs (no download), under every data-parallel strategy.

GPT-2 and Llama train under every data-parallel strategy. Each run
must equal single-process training (losses and final weights, fp32).
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from tiny_hf import gpt2, llama, logits_loss

import shardwise as sw
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# lr 1e-4: Adam normalises each gradient, so a near-zero gradient whose rounding
# differs between a sum over ranks and a sum over one batch moves its weight by
# about lr; at 1e-4 that stays inside the comparison's tolerance.
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)


def fit(strategy: str, devices: int, make) -> sw.FitResult:
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
        make(), CharText(stdlib_text(20_000), 16), logits_loss, ADAMW, batch_size=8, max_steps=3)


_refs: dict[str, sw.FitResult] = {}


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_hf_model_under_data_parallel_strategy_equals_single(same_run, make, strategy):
    if make.__name__ not in _refs:
        _refs[make.__name__] = fit("single", 1, make)
    same_run(_refs[make.__name__], fit(strategy, 2, make))
