"""Hugging Face models, unchanged and built from configs (no download), under every data-parallel strategy.

Issue 8: "GPT-2, Llama ... train under every data-parallel strategy". Each run
must equal single-process training (losses and final weights, fp32).
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.models import lm_loss
from shardwise.workloads import CharText, stdlib_text

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# lr 1e-4: Adam normalises each gradient, so a near-zero gradient whose rounding
# differs between a sum over ranks and a sum over one batch moves its weight by
# about lr; at 1e-4 that stays inside the comparison's tolerance.
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    # The key part of the fused q|k|v bias has an identically zero gradient (softmax is shift-invariant
    # per query), so Adam turns pure rounding noise into updates: frozen, so weights compare meaningfully.
    for b in m.transformer.h:
        b.attn.c_attn.bias.requires_grad_(False)
    return m


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                        bos_token_id=0, eos_token_id=0))


def logits_loss(out, y):
    return lm_loss(out.logits, y)


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
