"""Checks of the user's data, model and loss made in the launching process, before any rank starts.

A mistake found inside the ranks costs a process start per rank, a process
group, and a traceback per rank wrapped in a failure report; found here it is
one exception whose message says what to fix. The model is run on the meta
device (shapes only, no data, no memory), on one real micro-batch of the
dataset moved to meta, so even a large model costs nothing to check. What the
meta device cannot run (data-dependent shapes, ``.item()``) is not judged: the
check then says nothing rather than refuse a model that would train. When the
meta run fails otherwise (a shape mistake, or a dtype mismatch seen by
:class:`_Calls`), the forward of a copy of the model runs once on the real
micro-batch, and what it raises is reported naming the innermost module that
was running and its inputs (:func:`_forward_error`). Lazy modules
(``nn.LazyLinear``...) are initialised in place by one forward of the first
micro-batch (:func:`materialize_lazy`), so every rank gets the same weights.

A dataset is map-style (``len`` and index) or a stream (an iterable dataset,
read from its start; see :mod:`shardwise.data`); either comes as is or as a
:class:`~shardwise.data.DataSource` (with its collate function and the
``inputs`` convention of dict batches).
"""
from __future__ import annotations

import copy
import functools
import itertools
import numbers
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import DataLoader

from shardwise.data import DataSource, Kwargs, as_source, check_dataset, is_stream, to_device
from shardwise.plan.trace import meta_copy
from shardwise.step import StepRun, call_model


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
    if isinstance(src.dataset, DataLoader):
        raise TypeError(f"the {what} is a torch DataLoader over a {type(src.dataset.dataset).__name__}, which yields "
                        "batches, not samples: pass the Dataset; the Trainer makes the batches and splits them over "
                        "ranks")
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
        for i, s in enumerate(samples):
            check_plain_lists(s, f"sample {i} of the {what}")
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


def check_plain_lists(sample: Any, where: str) -> None:
    """Refuse a sample whose input, target or dict value is a plain (nested) list of numbers: torch's
    ``default_collate`` batches it position by position, into a list of tensors that no model takes as an input
    (a DataLoader does the same). Making it a tensor is the user's choice of dtype, so it is not guessed here."""
    parts = sample.items() if isinstance(sample, dict) else zip(("input", "target"), sample)
    for role, value in parts:
        if not _numbers(value):
            continue
        shown = repr(value) if len(repr(value)) <= 40 else None
        part = f"value {role!r}" if isinstance(sample, dict) else role
        raise TypeError(f"{where} is a {type(sample).__name__} whose {part} is a plain {type(value).__name__} of "
                        f"numbers ({shown or repr(value)[:36] + ' ...'}): torch's default_collate batches it position "
                        f"by position, into a list of {len(value)} tensors rather than one tensor; make it a tensor "
                        f"(torch.tensor({shown or '...'})) or pass a collate_fn that builds the batch")


def _numbers(x: Any) -> bool:
    """A non-empty list or tuple of Python numbers (or of such lists)."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and \
        all(isinstance(v, numbers.Number) or _numbers(v) for v in x)


def materialize_lazy(model: nn.Module, batch: Any, precision: str = "32") -> None:
    """Initialise the lazy modules of ``model`` (``nn.LazyLinear``, ``nn.LazyConv2d``...) in place, by one forward
    of the micro-batch ``batch`` in eval mode without gradients (torch's "dry run"): in the caller, before the
    model is copied to any rank, so every rank starts from the same weights, drawn from the caller's RNG as the
    user's own dry run would draw them. Eval mode keeps the dry run from updating running statistics or drawing
    dropout masks. A forward that fails is reported as :func:`_meta_forward` reports it."""
    if not any(is_lazy(t) for t in itertools.chain(model.parameters(), model.buffers())):
        return
    device = _device_of(model)
    x = _to_meta(batch[0]) if device.type == "meta" else to_device(batch[0], device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        _named_forward(model, x, "32" if device.type == "meta" else precision)  # no autocast on meta
    finally:
        for m, training in modes:
            m.training = training
    left = [name or type(m).__name__ for name, m in model.named_modules()
            if any(is_lazy(t) for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)))]
    if left:
        raise ValueError(f"the model's lazy modules {', '.join(map(repr, left))} were not initialised by a forward "
                         "of the first batch (the forward did not call them); initialise them before fit with a "
                         "forward of one batch, or give them their sizes (nn.Linear instead of nn.LazyLinear)")


class _Calls:
    """Hooks on every module of ``model`` that keep the modules whose forward is running, outermost first, with
    their inputs: after an exception, the last one is the innermost module that was running. With
    ``dtypes``, a module called with floating-point tensors of another dtype than its own floating-point
    parameters raises :class:`_DtypeMismatch` (the meta device runs mixed dtypes that the CPU and CUDA refuse)."""

    def __init__(self, model: nn.Module, dtypes: bool = False) -> None:
        self.stack: list[tuple[str, nn.Module, tuple[Any, ...], dict[str, Any]]] = []
        self.dtypes = dtypes
        self.handles = [h for name, m in model.named_modules() for h in (
            m.register_forward_pre_hook(functools.partial(self._enter, name), with_kwargs=True),
            m.register_forward_hook(self._leave))]

    def _enter(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.stack.append((name, module, args, kwargs))
        own = {p.dtype for p in module.parameters(recurse=False) if p.is_floating_point()}
        given = {t.dtype for t in _tensors(args, kwargs) if t.is_floating_point()}
        if self.dtypes and own and given - own:
            raise _DtypeMismatch(f"{sorted(map(str, given))} into parameters of {sorted(map(str, own))}")

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        while self.stack and self.stack.pop()[1] is not module:  # a module that caught a child's exception
            pass

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _DtypeMismatch(RuntimeError):
    """A module called on meta with inputs of another dtype than its parameters: confirmed by a real forward."""


def _named_forward(model: nn.Module, x: Any, precision: str) -> Any:
    """``model(x)`` without gradients under the run's autocast; what it raises is re-raised as a ValueError
    naming the innermost module that was running and its inputs (:func:`_forward_error`)."""
    calls = _Calls(model)
    try:
        with torch.no_grad(), StepRun(precision).forward_context(_device_of(model)):
            return call_model(model, x)
    except Exception as e:
        raise _forward_error(calls.stack, e) from e
    finally:
        calls.close()


def _forward_error(stack: list[tuple[str, nn.Module, tuple[Any, ...], dict[str, Any]]], e: Exception) -> ValueError:
    where, inputs = "", ""
    if stack:
        name, module, args, kwargs = stack[-1]
        extra = module.extra_repr()
        shown = f"{type(module).__name__}({extra})" if extra else type(module).__name__
        where = f" in module {name!r} ({shown})" if name else f" in the model itself ({shown})"
        tensors = [f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in _tensors(args, kwargs)]
        inputs = f" on an input of shape {tensors[0]}" if len(tensors) == 1 else \
            f" on inputs of shapes {', '.join(tensors)}" if tensors else ""
    cause = str(e) if type(e) is RuntimeError else f"{type(e).__name__}: {e}"
    return ValueError(f"the model's forward failed before any process started,{where}{inputs}: {cause}")


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def _device_of(model: nn.Module) -> torch.device:
    return next((t.device for t in itertools.chain(model.parameters(), model.buffers())), torch.device("cpu"))


def _meta_limit(e: Exception) -> bool:
    """An error of the meta device itself (no data: ``.item()``, data-dependent shapes, an op without a meta
    kernel), not of the model."""
    return isinstance(e, NotImplementedError) or ("meta" in str(e).lower() and not isinstance(e, _DtypeMismatch))


_NO_VERDICT = object()  # the meta device could not run the model or the function: nothing to say


def _call_on_meta(model: nn.Module, batch: Any, fn: Any, who: str, call: str, advice: str = "",
                  precision: str | None = None) -> Any:
    """``fn(model(x), y)`` on the meta device, or ``_NO_VERDICT``; a ``fn`` that cannot take the model's output
    (a type, attribute, index or key error) is refused, naming ``who`` and what the model returns."""
    out = _meta_forward(model, batch[0], precision)
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


def check_loss(model: nn.Module, batch: Any, loss_fn: Any, precision: str | None = None) -> None:
    """Run ``loss_fn(model(x), y)`` on the meta device; refuse a model whose forward fails (see
    :func:`_meta_forward`; ``precision``: the run's, when known), and a loss that is not a scalar or cannot take
    the model's output."""
    loss = _call_on_meta(model, batch, loss_fn, "the loss function", "loss_fn(output, target)",
                         ". Make the forward return the tensor the loss needs, or unpack the output in loss_fn "
                         "(e.g. out[0] or out.logits)", precision)
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


def _meta_forward(model: nn.Module, x: Any, precision: str | None = None) -> Any:
    """The model's output on the meta device, or None where the meta device cannot run it (no verdict).

    A failure that is not the meta device's own (:func:`_meta_limit`) is confirmed by the forward of a copy of
    the model on the real micro-batch (only then: a large model costs a real forward only when it would fail),
    and what that raises is refused, naming the module (:func:`_named_forward`). With ``precision="32"`` a
    module's floating-point inputs must have its parameters' dtype, as CPU and CUDA kernels require and the
    meta device does not check; under autocast (or unknown precision) dtypes are left to the real forward."""
    calls = None
    try:
        m = meta_copy(model)
        calls = _Calls(m, dtypes=precision == "32")
        with torch.no_grad():
            return call_model(m, _to_meta(x))
    except Exception as e:  # noqa: BLE001 - the meta device cannot run every model: no verdict, no refusal
        if isinstance(e, TypeError) and isinstance(x, Kwargs) and "keyword argument" in str(e):
            raise TypeError(f"the model does not take the dict batch's inputs as keyword arguments "
                            f"({', '.join(x)}): {e}. fit(inputs=...) names them: a list of keys passed as keyword "
                            "arguments, or one key whose tensor is passed positionally (default: every key but "
                            "'labels' and 'label')") from None
        failed = e
    finally:
        if calls is not None:
            calls.close()
    if calls is not None and not _meta_limit(failed) and _device_of(model).type != "meta":
        _confirm(model, x, precision or "32")
    return None


def _confirm(model: nn.Module, x: Any, precision: str) -> None:
    """Run the forward of a copy of ``model`` on ``x`` (its RNG draws undone): a failure is refused with the
    innermost module named; a forward that works leaves no verdict."""
    try:
        twin = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - fit refuses an uncopyable model later, with its own message
        return
    with torch.random.fork_rng(devices=[]):
        _named_forward(twin, to_device(x, _device_of(twin)), precision)


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


__all__ = ["check_indexable", "check_loss", "check_metric", "check_plain_lists", "check_source", "first_batch",
           "materialize_lazy"]
