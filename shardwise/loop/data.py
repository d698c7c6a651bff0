"""Data and metrics of a hand-written loop: each rank's part of every global batch, and evaluation that counts
each sample once.

* :func:`prepare_dataloader`: a DataLoader (or a dataset) made to give this rank its share of every GLOBAL
  batch through torch's ``DistributedSampler``, on the rank's device;
* :func:`gather_for_metrics`: predictions and targets of the batch just read, from every data-parallel rank,
  each sample once and in the loader's order (the sampler's padding dropped);
* :func:`gather` and :func:`all_reduce_mean`: plain collectives over the data-parallel ranks.

How the padding is found: with ``drop_last=False`` the sampler makes every rank read ``ceil(n / W)`` samples by
repeating the first few at the end, and deals the global order round-robin (rank ``r`` reads positions ``r``,
``r + W``, ...). So batch ``j`` of every rank holds positions ``j*b*W .. (j+1)*b*W - 1`` interleaved, and the
positions past ``n`` (the repeats) are all at the end of the last one. Each prepared loader records the batch it
yielded last; :func:`gather_for_metrics` interleaves the ranks' rows back into that order and keeps the first
``n - j*b*W`` of them.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from shardwise import precision as precision_mod
from shardwise.comm import Comm
from shardwise.data import leaves, to_device
from shardwise.dims import DP
from shardwise.loop.prepared import Prepared, kept_by

# A DataLoader's options that prepare_dataloader carries over when given a DataLoader (the rest it decides).
_CARRIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
            "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def _group(model: nn.Module | None) -> tuple[Comm | None, int, int]:
    """(comm or None, size, rank) of the data-parallel group of ``model`` (the world without a model)."""
    if model is not None:
        if not isinstance(model, Prepared):
            raise TypeError(f"expected the model sw.setup returned, got {type(model).__name__}")
        topo = model.topo
        return topo.comm(DP), topo.size(DP), topo.coord(DP)
    if dist.is_initialized():
        return None, dist.get_world_size(), dist.get_rank()
    return None, 1, 0


def prepare_dataloader(dataset: Any, batch_size: int | None = None, model: nn.Module | None = None,
                       shuffle: bool | None = None, seed: int = 0, drop_last: bool | None = None,
                       device: torch.device | str | None = None, **loader_kwargs: Any) -> DataLoader[Any]:
    """A DataLoader that gives this rank its part of every GLOBAL batch of ``batch_size`` samples, on its device.

    Each data-parallel replica (of ``model``'s layout; every rank without a model) reads ``batch_size /
    replicas`` samples per step through torch's DistributedSampler, so the replicas together read one
    global batch: the same as one device with ``batch_size`` (with ``shuffle``, one seeded permutation per
    epoch: call ``loader.sampler.set_epoch(epoch)``). Tensor- and pipeline-parallel ranks of one replica read
    the same samples. Batches come on ``device`` (default: ``model``'s, else the CPU); on CUDA from pinned
    memory (``pin_memory`` defaults to True there) with non-blocking copies. Other DataLoader options
    (num_workers, collate_fn, pin_memory) pass through.

    ``dataset`` may be a DataLoader: its dataset, batch size (taken as the global batch, the one its loop used on
    one device), order (shuffled or sequential), ``drop_last``, collate function and workers are used. One whose
    samples cannot be dealt out by index (an IterableDataset, a sampler or batch sampler of its own) is refused.

    ``shuffle`` defaults to True; ``drop_last`` to ``shuffle``: a shuffled (training) loader drops the last
    partial global batch, so every step has ``batch_size`` samples; an unshuffled (evaluation) loader keeps
    every sample, the last batch short and padded by the sampler, which :func:`gather_for_metrics` drops again.
    """
    if isinstance(dataset, DataLoader):
        dataset, batch_size, shuffle, drop_last, loader_kwargs = _from_loader(dataset, batch_size, shuffle,
                                                                               drop_last, loader_kwargs)
    if batch_size is None:
        raise TypeError("prepare_dataloader() needs batch_size, the GLOBAL batch per step (or a DataLoader)")
    if isinstance(dataset, IterableDataset):
        raise TypeError(_ITERABLE)
    shuffle = True if shuffle is None else shuffle
    drop_last = shuffle if drop_last is None else drop_last
    _, size, rank = _group(model)
    if batch_size % size:
        raise ValueError(f"batch_size={batch_size} (global) does not split over {size} data-parallel replicas; "
                         f"use a multiple of {size}")
    where = torch.device(device) if device is not None else \
        (model.topo.device if isinstance(model, Prepared) else torch.device("cpu"))
    loader_kwargs.setdefault("pin_memory", where.type == "cuda")
    # The workers' seeds come from a generator of the loader's own, not from torch's global one: a pass that a
    # resume starts mid-epoch then draws nothing the uninterrupted pass did not (sw.save keeps its state).
    if loader_kwargs.get("generator") is None:
        loader_kwargs["generator"] = torch.Generator().manual_seed(seed + rank)
    sampler = _Sampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    loader = DeviceLoader(dataset, batch_size=batch_size // size, sampler=sampler, drop_last=drop_last, device=where,
                          **loader_kwargs)
    kept = kept_by(model)
    if kept is not None:  # sw.save keeps its position
        kept.loaders.append(weakref.ref(loader))
    return loader


_ITERABLE = ("prepare_dataloader() of an IterableDataset: its samples come as a stream, which a "
             "DistributedSampler cannot deal out to the data-parallel ranks by index; give a map-style dataset "
             "(with __getitem__ and __len__), or shard the stream yourself by the rank's data-parallel coordinate")


def _from_loader(loader: DataLoader[Any], batch_size: int | None, shuffle: bool | None, drop_last: bool | None,
                 given: dict[str, Any]) -> tuple[Any, int, bool, bool, dict[str, Any]]:
    """What a DataLoader passed to :func:`prepare_dataloader` says: its dataset, global batch, order, drop_last
    and the options it carries over (``given`` ones win)."""
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(_ITERABLE)
    if loader.batch_size is None:
        raise TypeError("prepare_dataloader() of a DataLoader with a batch_sampler of its own: which samples make "
                        "a batch is then its choice, which cannot be split over the data-parallel ranks; pass its "
                        "dataset and a batch_size instead")
    if type(loader.sampler) not in (RandomSampler, SequentialSampler):
        raise TypeError(f"prepare_dataloader() of a DataLoader with a {type(loader.sampler).__name__}: each rank "
                        "reads through a DistributedSampler, which deals out the dataset in order or in one seeded "
                        "permutation; pass its dataset and a batch_size, and shuffle=True or False")
    if batch_size is not None and batch_size != loader.batch_size:
        raise ValueError(f"batch_size={batch_size} differs from the DataLoader's batch_size={loader.batch_size}; "
                         "pass one of them (it is the GLOBAL batch per step)")
    carried = {k: getattr(loader, k) for k in _CARRIED if hasattr(loader, k)}
    if not carried.get("num_workers"):  # these options are refused by a DataLoader without workers
        for k in ("prefetch_factor", "persistent_workers", "multiprocessing_context", "timeout"):
            carried.pop(k, None)
    order = isinstance(loader.sampler, RandomSampler) if shuffle is None else shuffle
    return (loader.dataset, loader.batch_size, order, loader.drop_last if drop_last is None else drop_last,
            {**carried, **given})


@dataclass(frozen=True)
class _Batch:
    """The batch a prepared loader yielded last: its rows on each rank, and how many of the ranks' rows together
    are real samples (the rest are the sampler's padding)."""

    rows: int
    valid: int


_LAST: dict[str, _Batch] = {}  # "batch": the batch any prepared loader yielded last in this process


class _Sampler(DistributedSampler):  # type: ignore[type-arg]
    """torch's DistributedSampler, whose next pass may start ``skip`` samples in (a resumed epoch)."""

    skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return iter(list(super().__iter__())[skip:])


class DeviceLoader(DataLoader[Any]):
    """A DataLoader whose batches come on ``device`` (tensors nested in tuples, lists, dicts); it records where
    in the epoch each batch lies, for :func:`gather_for_metrics`, and how many batches of its sampler's epoch it
    gave, for ``sw.save``: after ``sw.load``, the next pass of the saved epoch starts with the batch after the
    checkpoint's (a pass of another epoch, set with ``loader.sampler.set_epoch``, starts at its beginning)."""

    def __init__(self, *args: Any, device: torch.device, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = device
        self._given = 0  # batches given in the sampler's epoch
        self._resume: dict[str, int] | None = None  # the position sw.load restored, for the next pass

    def position(self) -> dict[str, int]:
        """The sampler's epoch and the batches given in it (what ``sw.save`` keeps)."""
        return {"epoch": int(self.sampler.epoch), "batches": self._given}  # type: ignore[attr-defined]

    def resume_at(self, position: dict[str, int]) -> None:
        """The next pass of ``position``'s epoch starts after its batches (the sampler set to that epoch)."""
        self.sampler.set_epoch(position["epoch"])  # type: ignore[attr-defined]
        self._resume = dict(position)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler: _Sampler = self.sampler  # type: ignore[assignment]
        skip = self._resume["batches"] if self._resume and self._resume["epoch"] == sampler.epoch else 0
        self._resume = None
        sampler.skip = min(skip * self.batch_size, sampler.num_samples)  # type: ignore[operator]
        n, ranks = len(self.dataset), sampler.num_replicas  # type: ignore[arg-type]
        start, self._given = skip * self.batch_size * ranks, skip  # type: ignore[operator]
        for batch in super().__iter__():
            rows = _rows(batch)
            _LAST["batch"] = _Batch(rows, max(0, min(rows * ranks, n - start)))
            start += rows * ranks
            self._given += 1
            yield to_device(batch, self.device)


def _rows(batch: Any) -> int:
    """The number of samples in a collated batch (the first dimension of its first tensor)."""
    first = next(iter(leaves(batch)), None)
    return int(first.shape[0]) if first is not None and first.dim() else 1


def gather(tensor: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape everywhere) stacked along a new first dimension, on every rank:
    over ``model``'s data-parallel group, or the world."""
    comm, size, _ = _group(model)
    if size == 1:
        return tensor.detach().unsqueeze(0).clone()
    t = tensor.detach().contiguous()
    out = torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
    if comm is not None:
        comm.all_gather(out.view(-1), t.view(-1), name="loop.gather")
    else:
        dist.all_gather_into_tensor(out.view(-1), t.view(-1))
    return out


def gather_for_metrics(data: Any, model: nn.Module | None = None) -> Any:
    """The tensors of the batch just read from a prepared loader (a tensor, or a tuple, list or dict of them,
    each with the batch's samples along dimension 0), from every data-parallel rank: each sample once, in the
    loader's order (the dataset's, unshuffled), the sampler's padding of the last batch dropped. Every rank gets
    the same result (a collective over ``model``'s data-parallel ranks, or the world).

    A tensor whose first dimension is not the batch's (a per-rank scalar, say) comes back as the ranks' values
    concatenated in rank order, nothing dropped."""
    last = _LAST.get("batch")

    def one(t: torch.Tensor) -> torch.Tensor:
        everyone = gather(t, model)
        if last is None or t.dim() == 0 or t.shape[0] != last.rows:
            return everyone.reshape(-1, *t.shape[1:]) if t.dim() else everyone
        return everyone.transpose(0, 1).reshape(-1, *t.shape[1:])[:last.valid]

    return _map_tensors(one, data)


def _map_tensors(fn: Any, data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)((k, _map_tensors(fn, v)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a named tuple
        return type(data)(*(_map_tensors(fn, v) for v in data))
    if isinstance(data, (tuple, list)):
        return type(data)(_map_tensors(fn, v) for v in data)
    raise TypeError(f"gather_for_metrics() takes a tensor, or a tuple, list or dict of tensors; got "
                    f"{type(data).__name__}")


def all_reduce_mean(tensor: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
    """The mean of ``tensor`` over the ranks (``model``'s data-parallel group, or the world), on every rank."""
    return precision_mod.widened(gather(tensor, model)).mean(0).to(tensor.dtype)


__all__ = ["DeviceLoader", "all_reduce_mean", "gather", "gather_for_metrics", "prepare_dataloader"]
