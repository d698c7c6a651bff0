"""Checks of the user's data, model and loss made in the launching process, before any rank starts.

A mistake found inside the ranks costs a process start per rank, a process
group, and a traceback per rank wrapped in a failure report; found here it is
one exception whose message says what to fix. The model is run on the meta
device (shapes only, no data, no memory), on one real micro-batch of the
dataset moved to meta, so even a large model costs nothing to check. What the
meta device cannot run (data-dependent shapes, ``.item()``) is not judged: the
check then says nothing rather than refuse a model that would train.

A dataset is map-style (``len`` and index) or a stream (an iterable dataset,
read from its start; see :mod:`shardwise.data`); either comes as is or as a
:class:`~shardwise.data.DataSource` (with its collate function and the
``inputs`` convention of dict batches).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from shardwise.data import DataSource, Kwargs, as_source, check_dataset, is_stream
from shardwise.plan.trace import meta_copy
from shardwise.step import call_model


def check_indexable(dataset: Any) -> None:
    """The trainer reads a dataset by ``len()`` and index (global batches by position), or as a stream that
    starts over at each ``iter()``: an iterator (a generator) can be read only once."""
    if isinstance(dataset, DataSource):
        dataset = dataset.dataset
    if is_stream(dataset) and iter(dataset) is not dataset:
        return
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"the dataset must support len() and indexing (a torch Dataset, a TensorDataset, a list of "
                        f"(input, target) pairs), or be a torch.utils.data.IterableDataset whose iter() starts the "
                        f"stream over (an iterator or generator can be read only once); got {type(dataset).__name__}")


def check_source(source: Any, batch_size: int, what: str = "dataset") -> None:
    """A dataset the trainer can read that holds at least one batch of ``batch_size`` (a stream is read that far)."""
    src = as_source(source)
    check_indexable(src.dataset)
    if not src.streaming:
        if what != "dataset" and len(src.dataset) == 0:
            raise ValueError(f"the {what} is empty")
        check_dataset(len(src.dataset), batch_size)
        return
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = sum(1 for _ in itertools.islice(iter(src.dataset), batch_size))
    if n == 0:
        raise ValueError(f"the {what} is an empty stream: iterating it yields no samples")
    if n < batch_size:
        raise ValueError(f"the {what} stream yields {n} samples, fewer than one global batch "
                         f"(batch_size={batch_size}); lower batch_size or use more data")


def first_batch(dataset: Any, count: int, what: str = "dataset") -> Any:
    """The first ``count`` samples collated into a batch and split into the step's (input, target), with a message
    that says what is wrong if they do not. Samples must be (input, target) pairs or dicts, unless a
    ``collate_fn`` makes the batch (then the batch must be a pair or a dict)."""
    src = as_source(dataset)
    data = src.dataset
    samples = list(itertools.islice(iter(data), count)) if src.streaming else \
        [data[i] for i in range(min(count, len(data)))]
    where = f"{what}[0..{len(samples) - 1}]"
    if src.loader.collate_fn is None:
        ok = [isinstance(s, dict) or (isinstance(s, (tuple, list)) and len(s) == 2) for s in samples]
        if not all(ok):
            bad = samples[ok.index(False)]
            raise TypeError(f"each sample must be an (input, target) pair; {where} holds {_describe(bad)} (wrap "
                            "inputs without targets as (x, x) or (x, 0), or return a dict and pick the model's "
                            "inputs with fit(inputs=...))")
        if any(isinstance(s, dict) for s in samples) and not all(isinstance(s, dict) for s in samples):
            raise TypeError(f"{where} mixes dict samples and (input, target) pairs; use one kind")
    if src.inputs is not None and not all(isinstance(s, dict) for s in samples):
        raise ValueError("inputs= picks the model's inputs among the keys of dict samples, but the samples are not "
                         "dicts (an (input, target) pair feeds the model its input as it is)")
    try:
        batch = src.loader.collate(samples)
    except (RuntimeError, TypeError, ValueError) as e:
        shapes = sorted({_describe(s) for s in samples})
        raise ValueError(f"samples 0..{len(samples) - 1} of the {what} cannot be stacked into one batch "
                         f"({str(e).splitlines()[0]}); every sample must have the same shapes and types, found "
                         f"{', '.join(shapes[:4])}: pad or crop them to one size (or pass a collate_fn that "
                         "pads)") from None
    return src.split(batch)


_NO_VERDICT = object()  # the meta device could not run the model or the function: nothing to say


def _call_on_meta(model: nn.Module, batch: Any, fn: Any, who: str, call: str, advice: str = "") -> Any:
    """``fn(model(x), y)`` on the meta device, or ``_NO_VERDICT``; a ``fn`` that cannot take the model's output
    (a type, attribute, index or key error) is refused, naming ``who`` and what the model returns."""
    out = _meta_forward(model, batch[0])
    if out is None:
        return _NO_VERDICT
    try:
        with torch.no_grad():
            return fn(out, _to_meta(batch[1]))
    except (TypeError, AttributeError, IndexError, KeyError) as e:
        raise TypeError(f"{who} cannot take the model's output: the model returns {_describe(out)}, and {call} "
                        f"raised {type(e).__name__}: {e}{advice}" + _dict_hint(batch)) from None
    except Exception:  # noqa: BLE001 - another meta limitation (.item() on meta, ...): no verdict
        return _NO_VERDICT


def check_loss(model: nn.Module, batch: Any, loss_fn: Any) -> None:
    """Run ``loss_fn(model(x), y)`` on the meta device; refuse a loss that is not a scalar or cannot take the
    model's output."""
    loss = _call_on_meta(model, batch, loss_fn, "the loss function", "loss_fn(output, target)",
                         ". Make the forward return the tensor the loss needs, or unpack the output in loss_fn "
                         "(e.g. out[0] or out.logits)")
    if loss is _NO_VERDICT:
        return
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar (one number per batch: the mean over samples), got a "
                         f"tensor of shape {list(loss.shape)}; reduce it, e.g. with .mean()")


def check_metric(model: nn.Module, batch: Any, fn: Any, name: str) -> None:
    """A validation metric takes the model's output and returns one number (checked on meta, as the loss is)."""
    value = _call_on_meta(model, batch, fn, f"val_metrics[{name!r}]", "fn(output, target)")
    if value is _NO_VERDICT:
        return
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"val_metrics[{name!r}] must return one number per batch (the mean over the batch), got a "
                         f"tensor of shape {list(value.shape)}")
    if not isinstance(value, (torch.Tensor, int, float)):
        raise TypeError(f"val_metrics[{name!r}] must return a number or a one-element tensor, got "
                        f"{type(value).__name__}")


def _meta_forward(model: nn.Module, x: Any) -> Any:
    """The model's output on the meta device, or None where the meta device cannot run it (no verdict)."""
    try:
        m = meta_copy(model)
        with torch.no_grad():
            return call_model(m, _to_meta(x))
    except TypeError as e:
        if isinstance(x, Kwargs) and "keyword argument" in str(e):
            raise TypeError(f"the model does not take the dict batch's inputs as keyword arguments "
                            f"({', '.join(x)}): {e}. fit(inputs=...) names them: a list of keys passed as keyword "
                            "arguments, or one key whose tensor is passed positionally (default: every key but "
                            "'labels' and 'label')") from None
        return None
    except Exception:  # noqa: BLE001 - the meta device cannot run every model: no verdict, no refusal
        return None


def _dict_hint(batch: Any) -> str:
    if isinstance(batch[1], dict):
        return f" (with dict samples the target is the whole batch dict, keys {sorted(batch[1])})"
    return ""


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, Kwargs):
        return Kwargs((k, _to_meta(v)) for k, v in x.items())
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)} ({str(x.dtype).replace('torch.', '')})"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of ({', '.join(_describe(v) for v in x[:3])}{', ...' if len(x) > 3 else ''})"
    if isinstance(x, dict):
        return f"a dict of {{{', '.join(f'{k!r}: {_describe(v)}' for k, v in list(x.items())[:4])}}}"
    return f"a {type(x).__name__}"


__all__ = ["check_indexable", "check_loss", "check_metric", "check_source", "first_batch"]
