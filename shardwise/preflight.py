"""Checks of the user's data, model and loss made in the launching process, before any rank starts.

A mistake found inside the ranks costs a process start per rank, a process
group, and a traceback per rank wrapped in a failure report; found here it is
one exception whose message says what to fix. The model is run on the meta
device (shapes only, no data, no memory), on one real micro-batch of the
dataset moved to meta, so even a large model costs nothing to check. What the
meta device cannot run (data-dependent shapes, ``.item()``) is not judged: the
check then says nothing rather than refuse a model that would train.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.data import collate


def check_indexable(dataset: Any) -> None:
    """The trainer reads a dataset by ``len()`` and index (global batches by position)."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"the dataset must support len() and indexing (a torch Dataset, a TensorDataset, a list of "
                        f"(input, target) pairs); got {type(dataset).__name__}")


def first_batch(dataset: Any, count: int) -> Any:
    """The first ``count`` samples (of an indexable dataset, :func:`check_indexable`) collated into a batch, with
    a message that says what is wrong if they do not."""
    samples = [dataset[i] for i in range(min(count, len(dataset)))]
    if not all(isinstance(s, (tuple, list)) and len(s) == 2 for s in samples):
        bad = next(s for s in samples if not (isinstance(s, (tuple, list)) and len(s) == 2))
        raise TypeError(f"each sample must be an (input, target) pair; dataset[0..{len(samples) - 1}] holds "
                        f"{_describe(bad)} (wrap inputs without targets as (x, x) or (x, 0))")
    try:
        return collate(samples)
    except (RuntimeError, TypeError) as e:
        shapes = sorted({_describe(s) for s in samples})
        raise ValueError(f"samples 0..{len(samples) - 1} of the dataset cannot be stacked into one batch "
                         f"({str(e).splitlines()[0]}); every sample must have the same shapes and types, found "
                         f"{', '.join(shapes[:4])}: pad or crop them to one size") from None


def check_loss(model: nn.Module, batch: Any, loss_fn: Any) -> None:
    """Run ``loss_fn(model(x), y)`` on the meta device; refuse a loss that is not a scalar or cannot take the
    model's output."""
    from shardwise.plan.trace import meta_copy

    x, y = batch[0], batch[1]
    try:
        m = meta_copy(model)
        with torch.no_grad():
            out = m(_to_meta(x))
    except Exception:  # noqa: BLE001 - the meta device cannot run every model: no verdict, no refusal
        return
    try:
        with torch.no_grad():
            loss = loss_fn(out, _to_meta(y))
    except (TypeError, AttributeError, IndexError) as e:
        raise TypeError(f"the loss function cannot take the model's output: the model returns {_describe(out)}, "
                        f"and loss_fn(output, target) raised {type(e).__name__}: {e}. Make the forward return the "
                        "tensor the loss needs, or unpack the output in loss_fn (e.g. out[0] or out.logits)") from None
    except Exception:  # noqa: BLE001 - another meta limitation, inside the loss
        return
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar (one number per batch: the mean over samples), got a "
                         f"tensor of shape {list(loss.shape)}; reduce it, e.g. with .mean()")


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)} ({str(x.dtype).replace('torch.', '')})"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of ({', '.join(_describe(v) for v in x[:3])}{', ...' if len(x) > 3 else ''})"
    return f"a {type(x).__name__}"


__all__ = ["check_indexable", "check_loss", "first_batch"]
