"""Small reference models used by the demo, the tests, the benchmarks and `verify`.

They are deliberately plain PyTorch so that every strategy sees an ordinary
`nn.Module`; the tensor-parallel plans name their submodules by these paths.

Public: :class:`GPT`, :class:`GPTConfig` and :func:`lm_loss` (the docs and
examples train them; a change to their arguments or submodule names is noted in
CHANGELOG.md), and :class:`MLP`. The building blocks (:class:`Attention`,
:class:`FeedForward`, :class:`Block`, :func:`causal_attention`) are public as
the submodules of GPT that the tensor-parallel plans and ``activation_checkpointing``
name, not as a library of layers.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from shardwise.moe import MoE


class MLP(nn.Module):
    """`depth` Linear(width, width) layers with ReLU between, then a classifier head."""

    def __init__(self, in_features: int = 64, width: int = 128, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = in_features
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        layers.append(nn.Linear(d, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


@dataclass
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_weights: bool = False
    # Mixture of experts (shardwise.moe): n_experts > 0 replaces every block's MLP by a routed MoE layer.
    n_experts: int = 0
    top_k: int = 2
    moe_intermediate: int = 0   # each expert's hidden width (0: 2 * n_embd)
    moe_score: str = "softmax"  # "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3)
    aux_loss_coef: float = 0.0  # the Switch load-balancing loss's weight (0: off)
    bias_update_rate: float = 0.0  # DeepSeek-V3's auxiliary-loss-free balancing (0: off)
    # Attention is torch's scaled_dot_product_attention (causal_attention): named as Hugging Face's configs name
    # it, so the planner counts no score matrix for either (shardwise.plan.model.fused_attention).
    _attn_implementation: ClassVar[str] = "sdpa"


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of (B, H, T, d) queries, keys and values over the whole local sequence."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal multi-head self-attention.

    The attention itself is the ``attend`` attribute (:func:`causal_attention`):
    context parallelism replaces it on each instance with attention across the
    cp ranks (:mod:`shardwise.parallel.cp.apply`), which the projections never see.
    """

    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = staticmethod(causal_attention)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Heads are inferred from the projection width (-1), so a tensor-parallel
        # q/k/v that holds n_head / tp heads runs this same code unchanged.
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = self.attend(q, k, v)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.proj(y)  # type: ignore[no-any-return]


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp: nn.Module = FeedForward(cfg) if not cfg.n_experts else MoE(
            cfg.n_embd, cfg.moe_intermediate or 2 * cfg.n_embd, cfg.n_experts, cfg.top_k, cfg.moe_score,
            cfg.aux_loss_coef, cfg.bias_update_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2 layout, pre-norm); input token ids (B, T), output logits (B, T, V)."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of token ids ``idx`` (B, T); ``position_ids`` (T or 1 x T) are the tokens' places in their
        sequence (default ``0..T-1``; under context parallelism a rank's tokens are not the first T)."""
        pos = torch.arange(idx.shape[1], device=idx.device) if position_ids is None else position_ids
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

