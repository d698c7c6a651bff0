"""``init_from=``: start a run (``fit``, ``sw.setup``) from pretrained weights, read straight into the shards.

The model may be built on the meta device. Around the strategy's setup:

* :func:`before_setup`: FSDP, ZeRO-3 and HSDP keep a meta model meta and
  materialise it one module at a time into the shards (their ``param_init_fn``
  becomes the model's own initialisation, :class:`OwnInit`, which skips the
  modules the load fills: those get only their shards; FSDP2 under
  ``engine="torch"`` initialises those too, then the load overwrites them); every other
  strategy needs real tensors to wrap or split, so the meta tensors get memory
  first (:func:`materialize`), initialised the same way on every rank;
* :func:`after_setup`: what the setup split on meta gets memory for this rank's part;
* :func:`read_into` (unless a checkpoint is resumed): each rank copies into what it
  holds of every tensor, from the source, only those rectangles
  (:mod:`shardwise.checkpoint.pretrained`).

The model's own initialisation matters only for what the source does not hold:
modules named in ``allow_missing`` and buffers outside the state dict (rotary
tables), which it computes as the model's code does: each module's
``reset_parameters()``, else Hugging Face's ``_init_weights`` for a Hugging Face model.
"""
from __future__ import annotations

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
from shardwise.strategies.base import Strategy
from shardwise.strategies.dp.family import on_meta


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

    @classmethod
    def checked(cls, path: str | os.PathLike[str] | None, allow_missing: Sequence[str],
                model: nn.Module) -> InitFrom | None:
        """:meth:`of`, then :meth:`check` against ``model``: before any process starts, the weights fit the model,
        or the message names those that differ."""
        init = cls.of(path, allow_missing)
        if init is not None:
            init.check(model)
        return init

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
            m.reset_parameters()  # type: ignore[operator]
        elif self.hf is not None:
            self.hf(m)

    def filled_later(self, m: nn.Module) -> bool:
        """Whether the load fills every tensor of ``m`` (then FSDP allocates only its shards, and no rank
        initialises it): not a module with buffers outside the state dict, nor one with new tensors."""
        own = [*m.parameters(recurse=False), *(b for b in m.buffers(recurse=False) if b is not None)]
        return not m._non_persistent_buffers_set and all(id(t) in self.loaded for t in own)


def materialize(model: nn.Module, device: torch.device | str, init: Callable[[nn.Module], None] | None) -> None:
    """Give every meta tensor of ``model`` memory on ``device`` in place (a tied weight stays one Parameter,
    which ``Module.to_empty`` would split), then ``init`` each module that had one (None: left uninitialised)."""
    done: set[int] = set()
    touched: list[nn.Module] = []
    for m in model.modules():
        own = [p for p in m.parameters(recurse=False) if p.device.type == "meta" and id(p) not in done]
        bufs = [k for k, b in m._buffers.items() if b is not None and b.device.type == "meta"]
        for p in own:
            fresh = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            marks = dict(p.__dict__)  # a tp slice's or an expert's spec: swap_tensors swaps the attributes too
            torch.utils.swap_tensors(p, fresh)  # the same Parameter object: hooks, ties, optimizer entries stay
            p.__dict__.update(marks)
            done.add(id(p))
        for k in bufs:
            b = m._buffers[k]
            m._buffers[k] = torch.empty(b.shape, dtype=b.dtype, device=device)  # type: ignore[union-attr]
        if own or bufs:
            touched.append(m)
    if init is not None:
        for m in touched:
            init(m)


def before_setup(init: InitFrom | None, model: nn.Module, strategy: Strategy, topo: Topology) -> Strategy:
    """Prepare a meta-device ``model`` for ``strategy``'s setup; returns the strategy to set it up with.

    A strategy that materialises it module by module into its shards (FSDP: ours, or FSDP2 under
    ``engine="torch"``) gets the model's own initialisation for it. One that takes it as it is and splits it
    (tp, pp and their composition with no data-parallel wrapper) keeps it on meta through the setup, and
    :func:`after_setup` gives memory only to what this rank kept. A data-parallel wrapper (DDP, ZeRO-1/2, or
    FSDP inside ``sw.Parallel``) starts from real tensors: the whole model gets memory here.
    """
    if init is None or not on_meta(model):
        return strategy
    if strategy.materialises_meta():
        return strategy.with_param_init(OwnInit(model, _loaded(init, model)))
    if not strategy.splits_meta(topo):
        materialize(model, topo.device, OwnInit(model))
    return strategy


def _loaded(init: InitFrom, model: nn.Module) -> set[int]:
    """The ids of ``model``'s tensors that ``init`` fills."""
    pairs = pretrained.match(pretrained.open_source(init.path), model_shapes(model), tied_aliases(model),
                             init.allow_missing)
    return {id(t) for n, t in named_state(model) if n in pairs}


def after_setup(init: InitFrom | None, model: nn.Module, topo: Topology, root: nn.Module) -> None:
    """Give memory to what this rank kept of a model that the setup split on the meta device (``root``: the
    bare model, whose own code initialises what no load fills)."""
    if init is not None:
        materialize(model, topo.device, OwnInit(root))


def read_into(init: InitFrom, strategy: Checkpointed, model: nn.Module, optimizer: torch.optim.Optimizer,
              topo: Topology, shapes: dict[str, list[int]], aliases: dict[str, str]) -> int:
    """Read the weights into what this rank holds of the set-up ``model``; returns the bytes it read."""
    source = pretrained.open_source(init.path)
    pairs = pretrained.match(source, shapes, aliases, init.allow_missing)
    held = strategy.checkpoint_held(model, optimizer, topo)
    return pretrained.load(source, held, shapes, pairs, topo.coord(TP), topo.size(TP))


__all__ = ["InitFrom", "OwnInit", "after_setup", "before_setup", "materialize", "read_into"]
