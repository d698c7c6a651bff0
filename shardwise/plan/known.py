"""Well-known model shapes, as plain data.

Sources: GPT-2 (Radford et al. 2019, the released checkpoints' configs),
GPT-3 (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads,
context 2048), Llama 2 (Touvron et al. 2023 and the released configs: RoPE,
RMSNorm, SwiGLU, no biases, untied output layer; 70B uses 8 key/value heads),
Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1 and the
released config: Mistral-7B's attention with 8 key/value heads, every MLP
8 SwiGLU experts of width 14336 of which each token uses 2; 46.7B
parameters, 12.9B active; trained at 4096 tokens here, its window).
The parameter counts they imply are checked against the published ones in
tests/plan/test_model.py.
"""
from __future__ import annotations

_GPT2 = dict(vocab=50257, norm="layernorm", bias=True, tied_embeddings=True, learned_positions=True)
_LLAMA2 = dict(vocab=32000, seq_len=4096, norm="rmsnorm", bias=False, tied_embeddings=False,
               learned_positions=False, gated_mlp=True)

SHAPES: dict[str, dict[str, object]] = {
    "gpt2": dict(layers=12, hidden=768, heads=12, seq_len=1024, **_GPT2),
    "gpt2-medium": dict(layers=24, hidden=1024, heads=16, seq_len=1024, **_GPT2),
    "gpt2-large": dict(layers=36, hidden=1280, heads=20, seq_len=1024, **_GPT2),
    "gpt2-xl": dict(layers=48, hidden=1600, heads=25, seq_len=1024, **_GPT2),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, seq_len=2048, **_GPT2),
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, ffn_hidden=11008, **_LLAMA2),
    "llama2-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, **_LLAMA2),
    "mixtral-8x7b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, experts=8, top_k=2,
                         moe_ffn_hidden=14336, **_LLAMA2),
}

# Other spellings people type.
ALIASES: dict[str, str] = {
    "gpt2-small": "gpt2", "gpt2-124m": "gpt2", "gpt2-355m": "gpt2-medium", "gpt2-774m": "gpt2-large",
    "gpt2-1.5b": "gpt2-xl", "gpt3": "gpt3-175b", "gpt-3": "gpt3-175b", "llama-2-7b": "llama2-7b",
    "llama-2-70b": "llama2-70b", "mixtral": "mixtral-8x7b", "mixtral-8x7b-v0.1": "mixtral-8x7b",
}
