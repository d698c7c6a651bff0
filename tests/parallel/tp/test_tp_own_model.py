"""A hand-written GPT with fused q/k/v under tensor parallelism.

Written here the way many people write a GPT (one ``c_attn`` projection that
holds q|k|v, ``F.scaled_dot_product_attention``, the output head tied to the
token embedding), not through our models module. Under tp each rank holds
1/tp of the heads, so the forward must reshape with per-rank counts: the
plan's ``local_attrs`` divides them. A forward that reshapes with the full
width read from its input is refused before any process starts, with the fix.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardwise as sw
from shardwise.parallel.tp.plans import Plan
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

# SGD, not Adam: the key bias gets no gradient in exact arithmetic (softmax ignores a shift shared by every
# key), only rounding noise of ~1e-9, which Adam would normalise into lr-sized steps of random sign under any
# change of summation order; SGD moves it by the noise itself, and every other tensor is compared as usual.
SGD = functools.partial(torch.optim.SGD, lr=0.3, momentum=0.9)


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, width_from_input: bool) -> None:
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.width_from_input = width_from_input
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        if self.width_from_input:  # the full width C of the input: wrong on a rank holding 1/tp of the heads
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        else:  # the per-rank counts the plan's local_attrs set
            q, k, v = (t.view(B, T, self.n_head, self.n_embd // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_embd))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, width_from_input: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, width_from_input)
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class HandGPT(nn.Module):
    def __init__(self, vocab: int = 128, n_embd: int = 32, n_head: int = 4, n_layer: int = 2, block: int = 16,
                 width_from_input: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, width_from_input) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2 does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


PLAN = Plan({"wte": "vocab", "h.*.attn.c_attn": "colwise_qkv", "h.*.attn.c_proj": "rowwise",
             "h.*.c_fc": "colwise", "h.*.c_proj": "rowwise", "lm_head": "colwise_gather"},
            local_attrs={"h.*.attn": ("n_head", "n_embd")})


def fit(strategy, devices, model=None):
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
        model or HandGPT(), CharText(stdlib_text(20_000), 16), lm_loss, SGD, batch_size=8, max_steps=4)


@pytest.fixture(scope="module")
def single():
    return fit("single", 1)


@pytest.mark.parametrize("strategy,devices", [(sw.TP(plan=PLAN), 2), (sw.Parallel(dp=2, tp=2, tp_plan=PLAN), 4)],
                         ids=["tp2", "dp2-tp2"])
def test_hand_written_fused_qkv_gpt_under_tp_equals_single(single, same_run, strategy, devices):
    run = fit(strategy, devices)
    same_run(single, run)
    assert single.losses[-1] < single.losses[0]


def test_a_forward_that_reshapes_with_the_input_width_is_refused_before_spawning(no_spawn):
    with pytest.raises(ValueError, match=r"^tensor parallel: HandGPT runs whole, but its forward fails once split "
                                         r"over tp=2 ranks: RuntimeError: .*give the plan local_attrs"):
        fit(sw.TP(plan=PLAN), 2, HandGPT(width_from_input=True))


def test_a_plan_that_does_not_fit_is_refused_before_spawning(no_spawn):
    with pytest.raises(ValueError, match=r"^tensor parallel: plan pattern\(s\) \['h\.\*\.attn\.qkv'\] match no module "
                                         r"of HandGPT$"):
        fit(sw.TP(plan={"h.*.attn.qkv": "colwise"}), 2)
    with pytest.raises(ValueError, match=r"^tensor parallel: local_attrs names 'h.0.attn.heads', which is missing, "
                                         r"not an integer count$"):
        fit(sw.TP(plan=Plan(PLAN.styles, local_attrs={"h.*.attn": ("heads",)})), 2)
    with pytest.raises(ValueError, match=r"^no built-in tensor-parallel plan for HandGPT; pass plan="):
        fit("tp", 2)
