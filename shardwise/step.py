"""What one training step is made of, below every strategy: the user's callables and the batch helpers.

``OptimizerFactory`` and ``LossFn`` are the types of fit's ``optimizer`` and
``loss_fn``; :class:`StepRun` is what the run (not the strategy) decides about
one step; :func:`call_model` calls a model with a tensor or keyword inputs,
:func:`iter_chunks` cuts a batch into micro-batches and :func:`unwrap` finds
the user's module inside a wrapper. Strategies, mechanisms and the fit loop
all use these, so they live in a base module that imports no layer.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.data import Kwargs
from shardwise.precision import autocast

OptimizerFactory = Callable[..., torch.optim.Optimizer]


LossFn = Callable[[Any, Any], torch.Tensor]

# fit's ``training_step``: ``fn(model, batch)`` returns the loss, or a dict with "loss" and other scalars to log.
StepFn = Callable[[nn.Module, Any], Any]


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


@dataclass(frozen=True)
class StepRun:
    """What the run, not the strategy, decides about one step: passed in, never stored in a strategy.

    ``precision``: autocast for forward and loss (backward runs outside it);
    ``loss_scale``: the fp16 loss scaler's current factor (1 otherwise).
    """

    precision: str = "32"
    loss_scale: float = 1.0

    def forward_context(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        return autocast(self.precision, device)


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` moved to ``device``; a model with meta tensors stays as it is: it is split first and gets memory
    for what this rank keeps afterwards (:mod:`shardwise.init_from`)."""
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        return model
    return model.to(device)


def call_model(model: nn.Module, x: Any) -> Any:
    """``model(x)``, or ``model(**x)`` for the keyword inputs of a dict batch (:class:`shardwise.data.Kwargs`)."""
    return model(**x) if isinstance(x, Kwargs) else model(x)


class TrainingStep:
    """A user's ``training_step(model, batch)`` in the place of ``loss_fn``: called on each micro-batch with the
    strategy's model (wrapped, split or sharded as the layout needs; called like the original) and the whole
    collated batch, this rank's part of it. The other scalars of a dict result are summed (tensors stay on
    their device: reading one per micro-batch would stop the host until the GPU is done) until the loop takes
    their mean over the step's micro-batches (:meth:`take`)."""

    def __init__(self, fn: StepFn) -> None:
        self.fn = fn
        self.sums: dict[str, torch.Tensor | float] = {}
        self.calls = 0

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        got = self.fn(model, batch)
        loss, scalars = step_result(got)
        for k, v in scalars.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.calls += 1
        return loss

    def take(self) -> dict[str, float]:
        """The mean of each logged scalar over the micro-batches since the last call."""
        out = {k: float(v) / max(1, self.calls) for k, v in self.sums.items()}
        self.sums, self.calls = {}, 0
        return out

    def __getstate__(self) -> dict[str, Any]:  # pickled into ranks: only the function travels
        return {"fn": self.fn}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["fn"])  # type: ignore[misc]


def step_result(got: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """A training_step's result as (the loss tensor, the other scalars, detached), or why it cannot be."""
    if isinstance(got, torch.Tensor):
        scalars: dict[str, Any] = {}
        loss = got
    elif isinstance(got, dict) and "loss" in got:
        loss, scalars = got["loss"], {k: v for k, v in got.items() if k != "loss"}
    else:
        raise TypeError(f"training_step must return the loss tensor or a dict with a 'loss' tensor (and other "
                        f"scalars to log), got {type(got).__name__}"
                        + (f" with keys {sorted(map(str, got))}" if isinstance(got, dict) else ""))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"training_step's loss must be a one-element tensor (the batch's mean), got "
                         f"{type(loss).__name__}{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    out: dict[str, torch.Tensor | float] = {}
    for k, v in scalars.items():
        one = isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)
        if not isinstance(k, str) or not one:
            shape = f" of shape {list(v.shape)}" if isinstance(v, torch.Tensor) else ""
            raise ValueError(f"training_step's dict may hold, beside 'loss', only named scalars to log; {k!r} is a "
                             f"{type(v).__name__}{shape}")
        out[k] = v.detach().reshape(()) if isinstance(v, torch.Tensor) else float(v)
    return loss.reshape(()), out


def forward_loss(model: nn.Module, x: Any, y: Any, loss_fn: LossFn) -> torch.Tensor:
    """One micro-batch's loss: ``loss_fn(model(x), y)``, or a :class:`TrainingStep`'s own (``y``: the whole batch)."""
    if isinstance(loss_fn, TrainingStep):
        return loss_fn(model, y)
    return loss_fn(call_model(model, x), y)


def iter_chunks(x: Any, k: int) -> Iterator[Any]:
    """Split a batch (tensor or tuple/dict of tensors) into ``k`` equal micro-batches along dim 0."""
    if isinstance(x, torch.Tensor):
        yield from x.chunk(k)
    elif isinstance(x, (list, tuple)) and x and all(isinstance(v, (str, bytes, int, float)) for v in x):
        n = -(-len(x) // k)  # a collated list of plain values (the strings of a dict batch): split like a tensor
        yield from (x[i:i + n] for i in range(0, len(x), n))
    elif isinstance(x, (list, tuple)):
        for parts in zip(*(list(iter_chunks(v, k)) for v in x)):
            yield type(x)(parts) if isinstance(x, tuple) else list(parts)
    elif isinstance(x, dict):
        keys = list(x)
        for parts in zip(*(list(iter_chunks(x[kk], k)) for kk in keys)):
            yield Kwargs(zip(keys, parts)) if isinstance(x, Kwargs) else dict(zip(keys, parts))
    else:
        raise TypeError(f"cannot split a batch of type {type(x).__name__} into micro-batches")


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """Tell every layer with an auxiliary loss (:class:`shardwise.moe.MoE`) the scale of this step's micro-batch
    losses (``loss_scale / micro-batches``), which its loss's gradient must carry as the main loss's does."""
    for m in model.modules():
        if hasattr(m, "aux_grad_scale"):
            m.aux_grad_scale = scale  # type: ignore[assignment]


def after_optimizer_step(model: nn.Module) -> None:
    """Run what layers do once per optimizer step (a MoE router's auxiliary-loss-free bias update): the
    Trainer calls it after ``optimizer.step()``; a hand-written loop calls it there too."""
    for m in model.modules():
        if hasattr(m, "after_optimizer_step"):
            m.after_optimizer_step()  # type: ignore[operator]


def first_named(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of ``named`` once, under the first name it comes with (a tied weight's saved name)."""
    seen: set[int] = set()
    out = []
    for k, v in named:
        if id(v) not in seen:
            seen.add(id(v))
            out.append((k, v))
    return out
