"""A mixture-of-experts layer for the project's GPT: a top-k router, experts as 3-D weights, the Switch loss.

The experts are stored as Mixtral's are in transformers 5 (``gate_up_proj``
of shape (E, 2I, H) and ``down_proj`` of shape (E, H, I), a SiLU-gated MLP per
expert), so expert parallelism (:mod:`shardwise.parallel.ep`) handles this
layer and Hugging Face's Mixtral/Qwen2-MoE/OLMoE experts with one adapter.

The router runs in at least float32 (a bf16 softmax over experts would pick
different experts from run to run of the same numbers). Scoring is ``softmax``
(Mixtral: softmax over all experts, the top-k renormalised) or ``sigmoid``
(DeepSeek-V3: independent sigmoid scores, the top-k normalised to sum to one).

The load-balancing loss of the Switch Transformer (Fedus et al. 2021, eq. 4),
``aux = E * sum_i f_i * P_i`` with ``f_i`` the fraction of routed slots that
chose expert i and ``P_i`` the mean router probability of expert i, is not
linear in the batch: averaging per-rank values is not the loss of the whole
batch. Here ``f_i`` is counted over every data-parallel rank's tokens (one
all-reduce of E counts over ``token_group``, which the strategy sets: Megatron
calls this the global auxiliary loss), and ``P_i`` is the local mean, whose
gradient the data-parallel average turns into the global mean's. The loss does
not change the model's output: it enters backward as an extra gradient on the
layer's output (Megatron's ``MoEAuxLossAutoScaler``), scaled by
``aux_grad_scale``, which the training step sets to the scale of each
micro-batch's loss (``loss_scale / micro-batches``).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

SCORES = ("softmax", "sigmoid")


class Reducer(Protocol):
    """What the global auxiliary loss needs of a process group (a :class:`shardwise.comm.Comm`)."""

    size: int

    def all_reduce(self, t: torch.Tensor, name: str) -> Any: ...


class Router(nn.Module):
    """Top-k routing: ``forward(x (N, H)) -> (probabilities (N, E), weights (N, k), expert indices (N, k))``.

    ``bias_update_rate`` > 0 turns on DeepSeek-V3's auxiliary-loss-free
    balancing (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section
    2.1.2): a per-expert ``bias`` is added to the scores only to *choose* the
    top-k (the weights stay the unbiased scores), and after each optimizer
    step every bias moves by ``bias_update_rate`` against its expert's load:
    up when the expert got fewer routed slots than the mean, down when more.
    The loads are counted over the whole step and every data-parallel rank
    (:meth:`update_bias`), so the update is the single-device one.
    """

    bias: torch.Tensor  # buffers, registered when bias_update_rate > 0
    load: torch.Tensor

    def __init__(self, hidden: int, n_experts: int, top_k: int, score: str = "softmax",
                 bias_update_rate: float = 0.0) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score={score!r}: valid are {', '.join(map(repr, SCORES))}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.n_experts, self.top_k, self.score = n_experts, top_k, score
        self.weight = nn.Parameter(torch.empty(n_experts, hidden))
        nn.init.normal_(self.weight, std=0.02)
        self.bias_update_rate = bias_update_rate
        if bias_update_rate:
            self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float64))
            # Routed slots per expert since the last update (not saved: a step's count, zero between steps).
            self.register_buffer("load", torch.zeros(n_experts, dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least fp32; a float64 model stays float64
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        probs = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        if not self.bias_update_rate:
            top, index = probs.topk(self.top_k, dim=-1)
        else:
            index = (probs.detach() + self.bias.to(dtype)).topk(self.top_k, dim=-1).indices
            top = probs.gather(-1, index)
            if self.training and torch.is_grad_enabled():
                self.load += torch.bincount(index.reshape(-1), minlength=self.n_experts).to(self.load.dtype)
        weights = top / top.sum(-1, keepdim=True)
        return probs, weights, index

    @torch.no_grad()
    def update_bias(self, group: Reducer | None = None) -> None:
        """After an optimizer step: move each bias against its expert's load over the step (summed over
        ``group``, the data-parallel ranks), then start counting again."""
        if not self.bias_update_rate:
            return
        if group is not None and group.size > 1:
            group.all_reduce(self.load, name="moe_bias_load")
        self.bias += self.bias_update_rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class Experts(nn.Module):
    """``E`` SiLU-gated MLPs as two 3-D weights; ``forward(x (N, H), index (N, k), weights (N, k)) -> (N, H)``.

    Each routed slot's output is scaled by its weight and summed into its token
    (the order of Mixtral's loop: expert by expert).
    """

    def __init__(self, hidden: int, intermediate: int, n_experts: int) -> None:
        super().__init__()
        self.num_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, intermediate))
        self.act_fn = nn.SiLU()
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            y = expert_mlp(self, e, x[token]) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out


def expert_mlp(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` (an index into the module's own weights) of a Mixtral-shaped experts module on rows ``x``."""
    gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)  # type: ignore[index]
    return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])  # type: ignore[index,operator]


class _AuxGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, ``scale`` as the gradient of ``aux`` (the loss enters only there)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=grad.dtype, device=grad.device), None


class MoE(nn.Module):
    """Router + experts over the tokens of a (B, T, H) input; see the module docstring."""

    def __init__(self, hidden: int, intermediate: int, n_experts: int, top_k: int = 2, score: str = "softmax",
                 aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0) -> None:
        super().__init__()
        self.router = Router(hidden, n_experts, top_k, score, bias_update_rate)
        self.experts = Experts(hidden, intermediate, n_experts)
        self.aux_loss_coef = aux_loss_coef
        self.aux_grad_scale = 1.0        # set per step by the strategy: the micro-batch loss's own scale
        self.token_group: Reducer | None = None  # the data-parallel ranks whose tokens f_i counts over

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs, weights, index = self.router(flat)
        out = self.experts(flat, index, weights)
        if self.aux_loss_coef and torch.is_grad_enabled() and self.training:
            aux = self.aux_loss(probs, index)
            out = _AuxGrad.apply(out, aux, self.aux_loss_coef * self.aux_grad_scale)
        return out.view_as(x)  # type: ignore[no-any-return]

    def after_optimizer_step(self) -> None:
        """The auxiliary-loss-free bias update (when on), with the step's loads counted over ``token_group``."""
        self.router.update_bias(self.token_group)

    def aux_loss(self, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``E * sum_i f_i * P_i`` with ``f_i`` over the token group (see the module docstring)."""
        n_experts = probs.shape[-1]
        counts = torch.bincount(index.reshape(-1), minlength=n_experts).to(torch.float64)
        if self.token_group is not None and self.token_group.size > 1:
            self.token_group.all_reduce(counts, name="moe_aux_counts")
        f = (counts / counts.sum()).to(probs.dtype)
        return n_experts * (f * probs.mean(0)).sum()


__all__ = ["Experts", "MoE", "Reducer", "Router", "SCORES", "expert_mlp"]
