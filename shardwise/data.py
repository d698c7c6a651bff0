"""The data of a run: global batches that are the same for any device count, from any dataset users have.

A run reads GLOBAL batches of ``batch_size`` samples; a data-parallel rank
reads its share of each. Whatever the number of ranks, the union of the
shares is the batch one device would read, so training equals single-device
training (docs/practical.md, "Data").

* A map-style dataset (``len`` and index): :class:`GlobalBatches`, positions
  drawn through torch's ``DistributedSampler`` (one seeded permutation per
  epoch, reshuffled each epoch, whole global batches only).
* An iterable dataset (``torch.utils.data.IterableDataset``, or any object
  whose ``iter()`` starts the stream over): :class:`StreamBatches`. Global
  batch ``w`` is samples ``w*B .. (w+1)*B - 1`` of the stream; rank ``r`` of
  ``N`` keeps the positions ``r, r + N, ...`` of it (the same positions a
  map-style batch gives it), so every rank reads the stream and skips what is
  not its own. At the end of the stream the partial batch is dropped and the
  stream starts over (``dataset.set_epoch(epoch)`` first, when the dataset
  has it).
* DataLoader options (:class:`LoaderOptions`: ``num_workers``, ``collate_fn``,
  ``pin_memory``, ...): workers compute exactly the batches the main process
  would, in the same order (each batch's indices are fixed by the step, not by
  the loader).
* Dict samples (``{"input_ids": ..., "labels": ...}``): the collated batch is
  a dict; :func:`split_batch` makes the step's (model input, loss target)
  pair from it: the model gets ``model(**inputs)`` (every key but the label
  keys, or the keys ``inputs=`` names) or ``model(batch[inputs])`` for one key
  named as a string, and the loss gets ``loss_fn(output, batch)``, the whole
  batch dict.
* Resuming: the batches of a step depend only on the step, so a resumed run
  reads from the step it resumes at (a stream is read and skipped up to there).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, default_collate

from shardwise.torch_private import as_main_process

# Keys of a dict batch that are targets, not model inputs (Hugging Face's names), unless ``inputs=`` says otherwise.
LABEL_KEYS = ("labels", "label")
# DataLoader arguments a run may set; the batching (batch_size, sampler, shuffle, drop_last) is the Trainer's own.
LOADER_KEYS = ("num_workers", "collate_fn", "pin_memory", "prefetch_factor", "persistent_workers", "worker_init_fn",
               "multiprocessing_context", "timeout")
_REFUSED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")


class Kwargs(dict):  # type: ignore[type-arg]
    """A model input passed as keyword arguments, ``model(**inputs)`` (the inputs of a dict batch)."""


@dataclass(frozen=True)
class LoaderOptions:
    """How batches are loaded: DataLoader workers, the collate function, pinned memory and the rest."""

    num_workers: int = 0
    collate_fn: Callable[[list[Any]], Any] | None = None
    pin_memory: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # prefetch_factor, persistent_workers, worker_init_fn, ...

    def collate(self, samples: Sequence[Any]) -> Any:
        return (self.collate_fn or default_collate)(list(samples))

    def loader(self, dataset: Any, seed: int, **how: Any) -> DataLoader:  # type: ignore[type-arg]
        """A torch DataLoader over ``dataset`` with these options; ``how`` is its batching (a batch sampler, or
        ``batch_size=None`` for a dataset that yields whole batches). Its generator is seeded, so starting it
        draws nothing from torch's global RNG (training's dropout and the like stay as without workers)."""
        return DataLoader(dataset, num_workers=self.num_workers, pin_memory=self.pin_memory,
                          generator=torch.Generator().manual_seed(seed), **how, **self.extra)


def loader_options(kwargs: Mapping[str, Any] | None = None, **overrides: Any) -> LoaderOptions:
    """``Trainer(dataloader_kwargs=)`` with ``fit``'s ``num_workers``, ``collate_fn`` and ``pin_memory`` over it
    (None: not given), checked: the batching itself is the Trainer's (the global batch, fixed per step)."""
    given = dict(kwargs or {})
    given.update({k: v for k, v in overrides.items() if v is not None})
    refused = sorted(k for k in given if k in _REFUSED)
    if refused:
        raise ValueError(f"dataloader option(s) {', '.join(refused)} cannot be set: the Trainer makes the batches "
                         "itself (the global batch_size, split over data-parallel ranks, in an order fixed by the "
                         "seed and the step, so that any device count reads the same batches)"
                         + ("; Trainer(shuffle=False) keeps the dataset's order" if "shuffle" in refused else ""))
    unknown = sorted(k for k in given if k not in LOADER_KEYS)
    if unknown:
        raise ValueError(f"unknown dataloader option(s) {', '.join(unknown)}; valid: {', '.join(LOADER_KEYS)}")
    workers = given.pop("num_workers", 0)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"num_workers must be an integer >= 0, got {workers!r}")
    collate_fn = given.pop("collate_fn", None)
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn must be callable (a list of samples -> a batch), got {type(collate_fn).__name__}")
    if workers == 0:
        for k in ("prefetch_factor", "persistent_workers"):  # torch refuses them without workers
            given.pop(k, None)
    return LoaderOptions(workers, collate_fn, bool(given.pop("pin_memory", False)), given)


def is_stream(dataset: Any) -> bool:
    """An iterable (not indexable) dataset: read in order, its length unknown."""
    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


@dataclass
class DataSource:
    """A dataset with how to load it and how its batches feed the model (see the module docstring).

    ``inputs`` (dict samples only): None passes every key but :data:`LABEL_KEYS` as keyword arguments; a
    string passes that key's tensor as the one positional argument; a list of keys passes those as keyword
    arguments.
    """

    dataset: Any
    loader: LoaderOptions = field(default_factory=LoaderOptions)
    inputs: str | tuple[str, ...] | None = None

    @property
    def streaming(self) -> bool:
        return is_stream(self.dataset)

    def split(self, batch: Any) -> tuple[Any, Any]:
        return split_batch(batch, self.inputs)

    def train_batches(self, global_batch: int, replicas: int, rank: int, seed: int, start: int,
                      stop: int, shuffle: bool = True, epoch: int | None = None) -> GlobalBatches | StreamBatches:
        """Rank ``rank``'s batches of steps ``start .. stop - 1`` (read with :meth:`batch`, step by step);
        ``shuffle=False``: a map-style dataset in its own order each epoch (a stream is read in its order);
        ``epoch``: steps an epoch of a map-style dataset, its first batches (default: every whole one)."""
        if self.streaming:
            return StreamBatches(self.dataset, global_batch, replicas, rank, seed=seed, loader=self.loader,
                                 start=start, stop=stop)
        return GlobalBatches(self.dataset, global_batch, replicas, rank, seed=seed, shuffle=shuffle,
                             loader=self.loader, start=start, stop=stop, epoch=epoch)

    def eval_batches(self, global_batch: int, replicas: int, rank: int, seed: int) -> Iterator[tuple[Any, bool]]:
        """Every batch of an evaluation pass over the whole dataset, in order (see :func:`eval_batches`)."""
        return eval_batches(self, global_batch, replicas, rank, seed)


def as_source(dataset: Any) -> DataSource:
    return dataset if isinstance(dataset, DataSource) else DataSource(dataset)


def split_batch(batch: Any, inputs: str | Sequence[str] | None = None) -> tuple[Any, Any]:
    """The (model input, loss target) pair of a collated batch: an (input, target) pair as it is; a dict batch
    as (its inputs, the whole batch) by the ``inputs`` convention of :class:`DataSource`."""
    if isinstance(batch, Mapping):
        if isinstance(inputs, str):
            return _key(batch, inputs), batch
        keys = [k for k in batch if k not in LABEL_KEYS] if inputs is None else list(inputs)
        return Kwargs({k: _key(batch, k) for k in keys}), batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"a batch must be an (input, target) pair or a dict, got a {type(batch).__name__}"
                    + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
                    + " (check the collate_fn)")


def _key(batch: Mapping[str, Any], key: str) -> Any:
    if key not in batch:
        raise KeyError(f"inputs= names the key {key!r}, which the batch does not have; its keys: {sorted(batch)}")
    return batch[key]


def batch_len(x: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor (0 when it holds none)."""
    for t in leaves(x):
        return int(t.shape[0]) if t.dim() else 1
    return 0


def leaves(x: Any) -> list[torch.Tensor]:
    """The tensors of a batch or a model output, in order: a tensor, or tuples, lists, dicts and
    dataclasses of them (a Hugging Face ``ModelOutput`` is a dict holding only its set fields)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        return [t for v in x.values() for t in leaves(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in leaves(v)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in dataclasses.fields(x) for t in leaves(getattr(x, f.name))]
    return []


# ---- map-style datasets ------------------------------------------------------------------
class GlobalBatches:
    """Rank ``rank``'s share of each global batch of a map-style dataset, drawn through torch's DistributedSampler.

    DistributedSampler gives rank r the positions r, r+N, r+2N, ... of one
    seeded permutation. Taking ``b = B/N`` consecutive entries of that list for
    step w gives rank r the positions w*B + r + N*j, so the union over ranks is
    exactly positions w*B .. (w+1)*B - 1 of the permutation: the same global
    batch whatever N is. Only whole global batches are used in an epoch.

    With DataLoader workers the indices of steps ``start .. stop - 1`` feed the
    loader as its batch sampler, so the workers load the same batches, in order.
    """

    def __init__(self, dataset: Any, global_batch: int, replicas: int, rank: int, seed: int = 0,
                 shuffle: bool = True, loader: LoaderOptions | None = None, start: int = 0,
                 stop: int | None = None, epoch: int | None = None) -> None:
        n = len(dataset)
        check_dataset(n, global_batch)
        self.dataset = dataset
        self.local_batch = global_batch // replicas
        self.steps_per_epoch = min(n // global_batch, epoch or n)  # (Trainer(limit_train_batches=): the first ones)
        self.sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle,  # type: ignore[var-annotated]
                                          seed=seed, drop_last=False)
        self.opts = loader or LoaderOptions()
        self.seed, self.start, self.stop = seed, start, stop
        self._epoch = -1
        self._indices: list[int] = []
        self._it: Iterator[Any] | None = None
        self._next = start

    def indices(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._indices = list(self.sampler)
            self._epoch = epoch
        b = self.local_batch
        return self._indices[within * b:(within + 1) * b]

    def batch(self, step: int, device: torch.device) -> Any:
        """The collated batch of ``step`` on ``device``; with workers, steps come in order from ``start``."""
        if self.opts.num_workers == 0:
            return to_device(self.opts.collate([self.dataset[i] for i in self.indices(step)]), device)
        if self._it is None:
            if self.stop is None:
                raise ValueError("DataLoader workers need the last step (stop=)")
            steps = _Steps(self, self.start, self.stop)
            self._it = iter(self.opts.loader(self.dataset, self.seed, batch_sampler=steps,
                                             collate_fn=self.opts.collate_fn or default_collate))
        _expect(step, self._next)
        self._next += 1
        return to_device(next(self._it), device)

    def close(self) -> None:
        self._it = None  # the loader's workers stop when its iterator goes


class _Steps:
    """The batch sampler of a loader with workers: the indices of steps ``start .. stop - 1``, made as read."""

    def __init__(self, batches: GlobalBatches, start: int, stop: int) -> None:
        self.batches, self.start, self.stop = batches, start, stop

    def __iter__(self) -> Iterator[list[int]]:
        return (self.batches.indices(s) for s in range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def _expect(step: int, expected: int) -> None:
    if step != expected:
        raise RuntimeError(f"batches are read in order: step {step} was asked for, step {expected} comes next")


def check_dataset(n: int, global_batch: int) -> None:
    """A dataset must hold at least one whole global batch."""
    if n == 0:
        raise ValueError("the dataset is empty: it has no (input, target) pairs to train on")
    if global_batch < 1:
        raise ValueError(f"batch_size must be >= 1, got {global_batch}")
    if n < global_batch:
        raise ValueError(f"the dataset has {n} samples, fewer than one global batch "
                         f"(batch_size={global_batch}); lower batch_size or use more data")


# ---- iterable datasets ------------------------------------------------------------------
class _Reader:
    """The user's stream, read as the main process would (see :func:`shardwise.torch_private.as_main_process`)."""

    def __init__(self, dataset: Any, epoch: int | None = None) -> None:
        with as_main_process():
            if epoch is not None and hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)
            self.it = iter(dataset)

    def take(self, n: int, keep: Callable[[int], bool]) -> tuple[list[Any], int, Any]:
        """Read up to ``n`` samples: (those at positions ``keep`` accepts, how many were read, the first)."""
        mine, first, read = [], None, 0
        with as_main_process():
            for pos in range(n):
                try:
                    s = next(self.it)
                except StopIteration:
                    break
                if read == 0:
                    first = s
                read += 1
                if keep(pos):
                    mine.append(s)
        return mine, read, first


def stream_steps(dataset: Any, global_batch: int, replicas: int, rank: int, start: int = 0, part: int = 0,
                 parts: int = 1) -> Iterator[tuple[int, list[Any]]]:
    """(step, rank ``rank``'s samples of global batch ``step``) for the steps from ``start`` with
    ``(step - start) % parts == part``, forever: at the end of the stream the partial batch is dropped and the
    stream starts over (epoch + 1). Steps before ``start`` and other parts' steps are read and skipped."""
    step, epoch = 0, 0
    while True:
        reader, whole = _Reader(dataset, epoch), 0
        while True:
            wanted = step >= start and (step - start) % parts == part
            mine, read, _ = reader.take(global_batch, (lambda pos: pos % replicas == rank) if wanted else _never)
            if read < global_batch:
                break
            if wanted:
                yield step, mine
            step, whole = step + 1, whole + 1
        if whole == 0:
            raise ValueError(f"the iterable dataset yielded {read} samples in epoch {epoch}, fewer than one global "
                             f"batch (batch_size={global_batch}); lower batch_size or use more data")
        epoch += 1


def _never(pos: int) -> bool:
    return False


class _StreamPart(IterableDataset):  # type: ignore[type-arg]
    """What one DataLoader worker yields: the collated batches of its steps (every ``num_workers``-th step),
    which the loader interleaves back into step order."""

    def __init__(self, dataset: Any, opts: LoaderOptions, make: Callable[..., Iterator[Any]], **args: Any) -> None:
        self.dataset, self.opts, self.make, self.args = dataset, opts, make, args

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        part, parts = (info.id, info.num_workers) if info is not None else (0, 1)
        for item in self.make(self.dataset, part=part, parts=parts, **self.args):
            yield self._collated(item)

    def _collated(self, item: Any) -> Any:
        if isinstance(item[1], bool):  # an evaluation batch: (samples, real)
            return self.opts.collate(item[0]), item[1]
        return item[0], self.opts.collate(item[1])


def _as_is(x: Any) -> Any:
    return x


class StreamBatches:
    """Rank ``rank``'s share of each global batch of an iterable dataset (see :func:`stream_steps`), read in
    step order from ``start``; with DataLoader workers each worker reads the stream and builds every
    ``num_workers``-th batch, and the loader returns them in step order."""

    def __init__(self, dataset: Any, global_batch: int, replicas: int, rank: int, seed: int = 0,
                 loader: LoaderOptions | None = None, start: int = 0, stop: int | None = None) -> None:
        if global_batch < 1:
            raise ValueError(f"batch_size must be >= 1, got {global_batch}")
        self.opts, self.seed = loader or LoaderOptions(), seed
        self.part = _StreamPart(dataset, self.opts, stream_steps, global_batch=global_batch, replicas=replicas,
                                rank=rank, start=start)
        self._it: Iterator[Any] | None = None  # started at the first batch (a run with no step to take reads nothing)
        self._next = start

    def batch(self, step: int, device: torch.device) -> Any:
        _expect(step, self._next)
        if self._it is None:
            self._it = iter(self.part) if self.opts.num_workers == 0 else \
                iter(self.opts.loader(self.part, self.seed, batch_size=None, collate_fn=_as_is))
        got, batch = next(self._it)
        assert got == step, (got, step)
        self._next += 1
        return to_device(batch, device)

    def close(self) -> None:
        self._it = None  # the loader's workers stop when its iterator goes


# ---- evaluation -------------------------------------------------------------------------------
def eval_batches(source: DataSource, global_batch: int, replicas: int, rank: int,
                 seed: int = 0) -> Iterator[tuple[Any, bool]]:
    """Rank ``rank``'s part of every batch of one pass over ``source``, in order: (collated batch, real).

    Batch ``w`` holds positions ``w*B .. (w+1)*B - 1`` (the last one may be
    partial); rank r takes the positions ``r, r + N, ...`` of it. Every rank
    gets every batch (data-parallel wrappers gather and reduce in each forward,
    so all must run the same number): a rank whose part of the last batch is
    empty gets the batch's first sample with ``real=False``, to run and ignore.
    """
    if global_batch < 1:
        raise ValueError(f"val_batch_size must be >= 1, got {global_batch}")
    opts, dataset = source.loader, source.dataset
    if source.streaming:
        part = _StreamPart(dataset, opts, stream_eval, global_batch=global_batch, replicas=replicas, rank=rank)
        yield from part if opts.num_workers == 0 else opts.loader(part, seed, batch_size=None, collate_fn=_as_is)
        return
    n = len(dataset)
    plan = []
    for lo in range(0, n, global_batch):
        mine = list(range(lo + rank, min(n, lo + global_batch), replicas))
        plan.append((mine or [lo], bool(mine)))
    if opts.num_workers == 0:
        for idx, real in plan:
            yield opts.collate([dataset[i] for i in idx]), real
        return
    loader = opts.loader(dataset, seed, batch_sampler=[idx for idx, _ in plan],
                         collate_fn=opts.collate_fn or default_collate)
    yield from zip(loader, (real for _, real in plan))


def stream_eval(dataset: Any, global_batch: int, replicas: int, rank: int, part: int = 0,
                parts: int = 1) -> Iterator[tuple[list[Any], bool]]:
    """:func:`eval_batches` of a stream, for the batches ``w`` with ``w % parts == part``: (samples, real)."""
    reader, w = _Reader(dataset), 0
    while True:
        mine, read, first = reader.take(global_batch, lambda pos: pos % replicas == rank)
        if read == 0:
            return
        if w % parts == part:
            yield (mine, True) if mine else ([first], False)
        if read < global_batch:
            return
        w += 1


def collate(samples: Sequence[Any]) -> Any:
    return default_collate(list(samples))


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` on ``device``: a tensor, or tensors nested in tuples, lists and dicts (a Hugging Face
    ``BatchEncoding``, a mapping with its own ``.to``, moves itself); other leaves as they are."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, Mapping) and not isinstance(x, dict) and callable(getattr(x, "to", None)):
        return x.to(device)  # type: ignore[attr-defined]
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return type(x)((k, to_device(v, device)) for k, v in x.items()) if isinstance(x, Kwargs) else \
            {k: to_device(v, device) for k, v in x.items()}
    return x
