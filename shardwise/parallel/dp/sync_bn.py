"""Synchronised BatchNorm over the data-parallel group, on any backend (gloo on CPU included).

Under data parallelism each rank sees ``1/N`` of the batch; a plain BatchNorm
normalises with its own part's statistics, so the training differs from one
device from the first step. :class:`SyncBatchNorm` computes the statistics of
the whole global batch: all-reduces of ``[sum, count]`` and of the sum of squares
per channel in forward (the mean, then the squared deviations from it, as
exact as a single device), and one of ``[sum dy, sum dy * x_hat]`` in backward
(the two reductions the gradient of a normalisation needs; Ioffe & Szegedy
2015, section 3). torch's own ``nn.SyncBatchNorm`` runs only on CUDA; this one
is written with :class:`~shardwise.comm.Comm`, so its bytes are counted and a
hang is diagnosed like any other collective.

The running statistics follow ``nn.BatchNorm``: the unbiased variance of the
global batch, blended with ``momentum`` (or the cumulative average when
``momentum`` is None), so they too equal single-device training.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.comm import Comm
from shardwise.torch_private import BatchNormBase


class _SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                comm: Comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        c = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, c] + [1] * (x.dim() - 2)
        acc = torch.promote_types(x.dtype, torch.float32)  # half inputs are reduced in float32
        xf = x.to(acc)
        # Two passes, as a single-device BatchNorm is exact to: the mean first, then the squared
        # deviations from it (E[x^2] - E[x]^2 in one pass cancels badly when |mean| >> std).
        first = torch.cat([xf.sum(dims), torch.tensor([x.numel() / c], dtype=acc, device=x.device)])
        comm.all_reduce(first, name="sync_bn.mean")
        n = first[-1]
        mean = first[:c] / n
        centered = xf - mean.view(shape)
        sq = (centered * centered).sum(dims)
        comm.all_reduce(sq, name="sync_bn.var")
        var = sq / n  # biased: what normalises
        invstd = torch.rsqrt(var + eps)
        xhat = centered * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.to(acc).view(shape)
        if bias is not None:
            y = y + bias.to(acc).view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.comm, ctx.n, ctx.dims, ctx.shape, ctx.has_bias = comm, n, dims, shape, bias is not None
        ctx.mark_non_differentiable(mean, var, n)
        return y.to(x.dtype), mean, var, n

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        dims, shape, c = ctx.dims, ctx.shape, xhat.shape[1]
        dyf = dy.to(xhat.dtype)
        sums = torch.cat([dyf.sum(dims), (dyf * xhat).sum(dims)])
        # The parameters' gradients are this rank's share: the data-parallel wrapper averages them with the rest.
        grad_bias = sums[:c].clone() if ctx.has_bias else None
        grad_weight = sums[c:].clone() if weight is not None else None
        ctx.comm.all_reduce(sums, name="sync_bn.grad")
        g = weight.to(xhat.dtype).view(shape) * invstd.view(shape) if weight is not None else invstd.view(shape)
        # d/dx of (x - mean) * invstd over the whole batch of n elements per channel.
        dx = g * (dyf - (sums[:c].view(shape) + xhat * sums[c:].view(shape)) / ctx.n)
        return (dx.to(dy.dtype), grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(dy.dtype) if grad_bias is not None else None, None, None)


class SyncBatchNorm(nn.Module):
    """A BatchNorm whose batch statistics are those of the global batch (see the module docstring).

    Takes over an existing BatchNorm's parameters and buffers (the same tensor
    objects, under the same names), so a state dict, a checkpoint or an
    optimizer built before the conversion still refers to them.
    """

    def __init__(self, bn: BatchNormBase, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.num_features, self.eps, self.momentum = bn.num_features, bn.eps, bn.momentum
        self.affine, self.track_running_stats = bn.affine, bn.track_running_stats
        self.weight, self.bias = bn.weight, bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)
        self.training = bn.training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_batch = self.training or self.running_mean is None
        if not use_batch:  # evaluation with running statistics: nothing to synchronise
            return nn.functional.batch_norm(
                x,
                self.running_mean,  # type: ignore[arg-type]
                self.running_var,  # type: ignore[arg-type]
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        y, mean, var, n = _SyncBNFunction.apply(x, self.weight, self.bias, self.eps, self.comm)
        if self.training and self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1  # type: ignore[assignment,operator]
                m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum  # type: ignore[arg-type]
                unbiased = var * (n / (n - 1)) if float(n) > 1 else var
                self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)  # type: ignore[operator]
                self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)  # type: ignore[operator]
        return y  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, group={self.comm.label}"


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of ``model``'s BatchNorm layers (1d, 2d, 3d; not already synchronised)."""
    return [n for n, m in model.named_modules() if isinstance(m, BatchNormBase)]


def convert_sync_batchnorm(model: nn.Module, comm: Comm) -> nn.Module:
    """Replace every BatchNorm of ``model`` by a :class:`SyncBatchNorm` over ``comm``'s group, in place."""
    for name in batchnorm_layers(model):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, SyncBatchNorm(getattr(owner, child), comm))
    return model


__all__ = ["SyncBatchNorm", "batchnorm_layers", "convert_sync_batchnorm"]
