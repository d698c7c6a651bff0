"""The planner's activations against what autograd really saves (CPU): shardwise's GPT and Hugging Face's Llama.

Both compute attention with torch's scaled_dot_product_attention, which keeps no score matrix: the planner
counted one (5 a s / h per token and width) and over-predicted up to 2.25x; on an H200 the GPT-2 small step kept
5.82 GB where it counted 10.28 GB. The bounds are the measured floor:
planned over saved was 0.88-1.06 for the GPT and 0.99 for Llama when this was written.
"""
from __future__ import annotations

import os

import pytest
import torch
from tiny_hf import logits_loss

import shardwise as sw
from shardwise.models import GPT, GPTConfig
from shardwise.parallel.checkpointing import apply_activation_checkpointing, track_saved_activations
from shardwise.plan import ModelSpec, plan_run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.timeout(120)

T, B, V = 256, 4, 512


def saved_and_planned(make, precision: str, checkpointing: bool) -> tuple[int, int]:
    model = make()
    if checkpointing:
        apply_activation_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    with track_saved_activations(model.parameters(), [x, y]) as saved:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "32"):
            loss = logits_loss(model(x), y)
        loss.backward()
    layout = sw.Trainer("single", 1, accelerator="cpu").strategy.describe(1).with_run(precision, checkpointing)
    planned = plan_run(make(), layout, 1 << 40, B, "adamw", suggest=False).activation_bytes
    return saved.peak, planned


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=4, n_head=4, n_embd=128, tie_weights=True))


def llama(attn: str = "sdpa") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                                        attn_implementation=attn, bos_token_id=0, eos_token_id=0))


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_planned_activations_of_our_gpt_near_what_autograd_saves(precision, checkpointing):
    saved, planned = saved_and_planned(gpt, precision, checkpointing)
    assert 0.85 <= planned / saved <= 1.10, (saved, planned)


def test_planned_activations_of_hf_llama_near_what_autograd_saves():
    saved, planned = saved_and_planned(llama, "32", False)
    assert 0.95 <= planned / saved <= 1.05, (saved, planned)


def test_fused_attention_is_read_from_the_model():
    assert ModelSpec.from_module(gpt()).fused_attention
    assert ModelSpec.from_module(llama("sdpa")).fused_attention
    # Eager attention keeps its (heads x s x s) probabilities: the score term stays in the count.
    eager = llama("eager")
    assert not ModelSpec.from_module(eager).fused_attention
    saved, planned = saved_and_planned(lambda: llama("eager"), "32", False)
    assert planned > saved  # what the eager kernel keeps besides the scores is not modelled; scores dominate
