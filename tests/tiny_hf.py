"""Hugging Face models from tiny configs (no download), shared by the tests that train them."""
from __future__ import annotations

import os

import torch
from torch import nn

from shardwise.models import lm_loss

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    """Next-token loss on a Hugging Face output (``.logits``) or on plain logits (a pipeline's last stage)."""
    return lm_loss(out.logits if hasattr(out, "logits") else out, y)


def bert_mlm() -> nn.Module:
    """An encoder with tied heads: the decoder weight is the word embedding, its bias is ``cls.predictions.bias``."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def qwen2() -> nn.Module:
    """Qwen2: biases on q, k and v, grouped-query attention (4 heads, 2 kv heads), RoPE."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, use_sliding_window=False))


def mistral() -> nn.Module:
    """Mistral: grouped-query attention (4 heads, 1 kv head), RoPE, no sliding window at this length."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
                                            bos_token_id=0, eos_token_id=0, sliding_window=None))


def mixtral() -> nn.Module:
    """Mixtral: 4 experts, top-2, as 3-D expert weights (transformers 5); grouped-query attention, RoPE.

    The experts run transformers' eager loop: its default, torch's grouped_mm, has no float64 kernel."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                            experts_implementation="eager"))


def qwen2_moe() -> nn.Module:
    """Qwen2-MoE: 4 routed experts (top-2) beside an always-on shared expert with its own sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48,
                                              moe_intermediate_size=24, shared_expert_intermediate_size=48,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                                              bos_token_id=0, eos_token_id=0, use_sliding_window=False,
                                              experts_implementation="eager"))


def olmoe() -> nn.Module:
    """OLMoE: 4 experts, top-2, no shared expert, q/k norms."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    return OlmoeForCausalLM(OlmoeConfig(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32, bos_token_id=0,
                                        eos_token_id=0, pad_token_id=0, experts_implementation="eager"))
