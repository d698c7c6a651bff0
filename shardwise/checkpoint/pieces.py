"""Layout-free checkpoint tensors: each rank's parts of each tensor of the unsplit model.

A checkpoint stores every tensor under its name in the unsplit model
(``model.<fqn>``, ``optim.<fqn>.<state>``) with its global shape. A rank
describes what it holds of a tensor as a :class:`Held`: which elements of the
tensor-parallel slice it has (a contiguous run ``[start, start + n)`` of the
slice flattened, the form every ZeRO / FSDP / parameter-server shard takes) and
where that slice sits in the global tensor (``tp_spec``: the dimension and the
number of fused parts, :func:`shardwise.parallel.tp.apply.tp_spec`).

:func:`boxes` turns that into rectangles of the global tensor (a contiguous
run of a row-major tensor is at most ``2 * ndim - 1`` rectangles; a fused
tensor-parallel slice cuts each into ``parts``), each a view of live storage.
:class:`Pieces` hands those rectangles to torch.distributed.checkpoint (DCP) as
chunks with global offsets, so a save writes only what a rank holds and a load
asks DCP for exactly the rectangles it needs, from whatever chunks some other
layout wrote. DCP dedups chunks several ranks hold (replicas) by their offsets.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardwise.checkpoint.held import Held, unscoped

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, flat start) in one tensor


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Rectangles of a row-major tensor of ``shape`` that tile its flat elements ``[start, stop)``, in order.

    Each is (offsets, sizes, flat start) and is contiguous in the flat order, so
    a run of a 1-D view reshapes into it.
    """
    shape = tuple(shape)
    if stop <= start:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    out: list[Box] = []
    i, pos = start // inner, start
    if pos % inner:  # a partial first row
        end = min(stop, (i + 1) * inner)
        for off, size, s in flat_boxes(shape[1:], pos - i * inner, end - i * inner):
            out.append(((i, *off), (1, *size), i * inner + s))
        pos, i = end, i + 1
    full = (stop - pos) // inner
    if full > 0:
        out.append(((i, *([0] * (len(shape) - 1))), (full, *shape[1:]), pos))
        pos, i = pos + full * inner, i + full
    if pos < stop:  # a partial last row
        for off, size, s in flat_boxes(shape[1:], 0, stop - pos):
            out.append(((i, *off), (1, *size), i * inner + s))
    return out


Piece = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the global tensor, a view of live storage)


def pieces_of(held: Held, shape: Sequence[int], tp_rank: int, tp_size: int) -> list[Piece]:
    """(global offsets, view) of each rectangle of the global tensor ``shape`` that ``held`` covers."""
    if held.ep is not None:
        # An expert-parallel tensor: this rank's rows of dim 0 are a tensor of their own (tp may split it further).
        rank, size = held.ep
        if shape[0] % size:
            raise ValueError(f"{held.key}: dimension 0 of {list(shape)} does not split into ep={size} parts")
        rows = shape[0] // size
        inner = replace(held, ep=None)
        return [((o[0] + rank * rows, *o[1:]), v)
                for o, v in pieces_of(inner, (rows, *tuple(shape)[1:]), tp_rank, tp_size)]
    shape = tuple(shape)
    local = list(shape)
    if held.tp is not None:
        dim, parts = held.tp
        if shape[dim] % (tp_size * parts):
            raise ValueError(f"{held.key}: dimension {dim} of {list(shape)} does not split into {tp_size} x {parts}")
        local[dim] //= tp_size
    whole = held.start == 0 and tuple(held.data.shape) == tuple(local)
    numel = math.prod(local)
    flat = None if whole else held.data.reshape(-1)
    if flat is not None and flat.data_ptr() != held.data.data_ptr() and held.data.numel():
        raise ValueError(f"{held.key}: a partial piece must be a 1-D view of live storage")
    boxes = [(tuple([0] * len(local)), tuple(local), 0)] if whole else \
        flat_boxes(local, held.start, min(numel, held.start + held.data.numel()))
    out: list[Piece] = []
    for off, size, s in boxes:  # type: ignore[assignment]
        lo = s - held.start
        view = held.data if whole else flat[lo:lo + math.prod(size)].view(size)  # type: ignore[index,call-overload]
        if held.tp is None:
            out.append((off, view))
            continue
        dim, parts = held.tp
        block = local[dim] // parts                  # a fused part's rows on this rank
        for j in range(parts):
            lo, hi = max(off[dim], j * block), min(off[dim] + size[dim], (j + 1) * block)  # type: ignore[index]
            if lo >= hi:
                continue
            g = list(off)
            g[dim] = j * (shape[dim] // parts) + tp_rank * block + (lo - j * block)
            out.append((tuple(g), view.narrow(dim, lo - off[dim], hi - lo)))
    return out


class Pieces:
    """The rectangles of one global tensor this rank holds, in the form DCP asks of a checkpointable object.

    Implements the ``__create_write_items__`` / ``__create_chunk_list__`` /
    ``__get_tensor_shard__`` protocol (``torch.distributed._checkpointable``)
    that DTensor implements; the planners below find the views by offset.
    """

    def __init__(self, shape: Sequence[int], parts: list[Piece]) -> None:
        self.shape = torch.Size(shape)
        self.parts = [(torch.Size(o), v) for o, v in parts]

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, o, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=v.size()),
                                                      properties=TensorProperties.create_from_tensor(v),
                                                      size=self.shape))
                for i, (o, v) in enumerate(self.parts)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=v.size()) for o, v in self.parts]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.parts) and self.parts[index.index][0] == index.offset:
            return self.parts[index.index][1]
        for o, v in self.parts:
            if o == index.offset:
                return v
        raise ValueError(f"no piece of {index.fqn} at {index.offset}")

    def __repr__(self) -> str:
        return f"Pieces({list(self.shape)}, {[(list(o), list(v.shape)) for o, v in self.parts]})"


def _lookup(state: dict[str, Any], index: MetadataIndex) -> Any:
    obj = state[index.fqn]
    return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else None


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, finding :class:`Pieces` views by offset (DCP itself only does so for tensors)."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, finding :class:`Pieces` views by offset."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up replaces every value it does not know (not a tensor, DTensor or
        # ShardedTensor) by None, in place; the Pieces go back in afterwards.
        kept = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(kept)
        self.state_dict.update(kept)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)


def build_state(held: Sequence[Held], shapes: dict[str, list[int]], tp_rank: int = 0,
                tp_size: int = 1) -> dict[str, Pieces]:
    """This rank's DCP state: one :class:`Pieces` per key it holds a part of.

    ``shapes`` gives each parameter's global shape (``model.<fqn>`` keys drop the
    prefix; an optimizer state ``optim.<fqn>.<state>`` has its parameter's shape
    unless it is a scalar).
    """
    out: dict[str, list[Piece]] = {}
    dims: dict[str, tuple[int, ...]] = {}
    for h in held:
        shape = _shape_of(h, shapes)
        got = pieces_of(h, shape, tp_rank, tp_size)
        if got:
            seen = {o for o, _ in out.get(h.key, [])}
            out.setdefault(h.key, []).extend((o, v) for o, v in got if o not in seen)
            dims[h.key] = shape
    return {k: Pieces(dims[k], v) for k, v in out.items()}


def _shape_of(h: Held, shapes: dict[str, list[int]]) -> tuple[int, ...]:
    key = unscoped(h.key)
    if key.startswith("model."):
        return tuple(shapes[key[len("model."):]])
    if h.data.dim() == 0 and h.start == 0:
        return ()
    name = key[len("optim."):].rpartition(".")[0]
    return tuple(shapes[name])


__all__ = ["Held", "Pieces", "SavePlanner", "LoadPlanner", "build_state", "flat_boxes", "pieces_of"]
