"""``init_from=``: start a run (``fit``, ``sw.setup``) from pretrained weights, read straight into the shards.

The model may be built on the meta device. Around the strategy's setup:

* :func:`before_setup`: FSDP, ZeRO-3 and HSDP keep a meta model meta and
  materialise it one module at a time into the shards (their ``param_init_fn``
  becomes the model's own initialisation, :class:`OwnInit`, which skips the
  modules the load fills: those get only their shards); every other
  strategy needs real tensors to wrap or split, so the meta tensors get memory
  first (:func:`materialize`), initialised the same way on every rank;
* :func:`after_setup`: each rank copies into what it holds of every tensor, from
  the source, only those rectangles (:mod:`shardwise.checkpoint.pretrained`).

The model's own initialisation matters only for what the source does not hold:
modules named in ``allow_missing`` and buffers outside the state dict (rotary
tables), which it computes as the model's code does: each module's
``reset_parameters()``, else Hugging Face's ``_init_weights`` for a Hugging Face model.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.checkpoint import pretrained
from shardwise.checkpoint.held import named_state
from shardwise.checkpoint.store import Checkpointed, model_shapes, tied_aliases
from shardwise.comm.topology import Topology
from shardwise.dims import TP
from shardwise.strategies.data_parallel import on_meta
from shardwise.strategies.fsdp import FSDP


@dataclass(frozen=True)
class InitFrom:
    """Where the weights come from (``path``) and which model names are meant to be new (fnmatch patterns)."""

    path: str
    allow_missing: tuple[str, ...] = ()

    @classmethod
    def of(cls, path: str | os.PathLike[str] | None, allow_missing: Sequence[str] = ()) -> InitFrom | None:
        if path is None:
            if allow_missing:
                raise ValueError("init_allow_missing was given without init_from: there is nothing to load")
            return None
        return cls(os.fspath(path), tuple(allow_missing))

    def check(self, model: nn.Module) -> None:
        """Refuse, before any process starts, weights that do not fit ``model`` (reads headers only)."""
        pretrained.match(pretrained.open_source(self.path), model_shapes(model), tied_aliases(model),
                         self.allow_missing)


class OwnInit:
    """Initialise one module of ``root`` as the model's own code does (its tensors zeroed first, so a module
    that has no initialiser is the same on every rank). ``loaded``: the tensors a load fills afterwards."""

    def __init__(self, root: nn.Module, loaded: set[int] | None = None) -> None:
        self.hf = getattr(root, "_init_weights", None)
        self.loaded = loaded or set()

    def __call__(self, m: nn.Module) -> None:
        with torch.no_grad():
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                t.zero_()
        if hasattr(m, "reset_parameters"):  # the module's own (an adapter's), before the model's generic one
            m.reset_parameters()
        elif self.hf is not None:
            self.hf(m)

    def filled_later(self, m: nn.Module) -> bool:
        """Whether the load fills every tensor of ``m`` (then FSDP allocates only its shards, and no rank
        initialises it): not a module with buffers outside the state dict, nor one with new tensors."""
        own = [*m.parameters(recurse=False), *(b for b in m.buffers(recurse=False) if b is not None)]
        return not m._non_persistent_buffers_set and all(id(t) in self.loaded for t in own)


def materialize(model: nn.Module, device: torch.device | str, init: Callable[[nn.Module], None] | None) -> None:
    """Give every meta tensor of ``model`` memory on ``device`` in place (a tied weight stays one Parameter,
    which ``Module.to_empty`` would split), then ``init`` each module (None: left uninitialised)."""
    done: set[int] = set()
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if p.device.type == "meta" and id(p) not in done:
                fresh = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, fresh)  # the same Parameter object: hooks, ties and names stay
                done.add(id(p))
        for k, b in m._buffers.items():
            if b is not None and b.device.type == "meta":
                m._buffers[k] = torch.empty(b.shape, dtype=b.dtype, device=device)
    if init is not None:
        for m in model.modules():
            init(m)


def before_setup(init: InitFrom | None, model: nn.Module, strategy: Checkpointed,
                 device: torch.device) -> Checkpointed:
    """Prepare a meta-device ``model`` for ``strategy``'s setup; returns the strategy to set it up with."""
    if init is None or not on_meta(model):
        return strategy
    if isinstance(strategy, FSDP):  # materialises module by module into its shards
        return dataclasses.replace(strategy, param_init_fn=strategy.param_init_fn
                                   or OwnInit(model, _loaded(init, model)))
    materialize(model, device, OwnInit(model))
    return strategy


def _loaded(init: InitFrom, model: nn.Module) -> set[int]:
    """The ids of ``model``'s tensors that ``init`` fills."""
    pairs = pretrained.match(pretrained.open_source(init.path), model_shapes(model), tied_aliases(model),
                             init.allow_missing)
    return {id(t) for n, t in named_state(model) if n in pairs}


def after_setup(init: InitFrom, strategy: Checkpointed, model: nn.Module, optimizer: torch.optim.Optimizer,
                topo: Topology, shapes: dict[str, list[int]], aliases: dict[str, str]) -> int:
    """Read the weights into what this rank holds of the set-up ``model``; returns the bytes it read."""
    source = pretrained.open_source(init.path)
    pairs = pretrained.match(source, shapes, aliases, init.allow_missing)
    held = strategy.checkpoint_held(model, optimizer, topo)
    return pretrained.load(source, held, shapes, pairs, topo.coord(TP), topo.size(TP))


__all__ = ["InitFrom", "OwnInit", "after_setup", "before_setup", "materialize"]
