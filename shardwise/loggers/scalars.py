"""Your own scalars in the step log: ``sw.log(name, value, reduce="mean")``, from anywhere a step runs.

Call :func:`log` from a loss function, a model's forward, or a callback: the
value joins the row of the step being trained (``metrics_path``,
``tensorboard_dir``), reduced over the ranks that hold different data. The
rules, each chosen so that the number means the same under every layout:

* **Ranks.** Every data shard counts once: data-parallel replicas and
  context-parallel ranks (each sees other samples or tokens) are reduced over;
  tensor-parallel peers compute the same value, so only tp rank 0's counts;
  pipeline stages count only where they log the name (a loss function runs on
  the last stage only). ``"mean"`` is the mean over the ranks that count,
  ``"sum"`` their sum, ``"max"``/``"min"`` their extreme.
* **Micro-batches.** A name logged once per micro-batch (gradient
  accumulation, pipeline micro-batches) is reduced over the calls first, as
  the loss is: the mean of the calls for ``"mean"``, their sum for ``"sum"``.
* **Activation recompute.** A forward that activation checkpointing re-runs in
  backward does not log again (:func:`shardwise.torch_private.recomputing`).
* **Validation.** Values logged while validation runs go to the validation row
  as ``val/<name>``, reduced over the whole validation pass.
* **A hand-written loop** set up with a logger (``sw.setup(..., logger=)``) records every value until its
  optimizer's step ends the row (:mod:`shardwise.loop.output`).
* **Outside a fit** (no run records this process's steps) :func:`log` does
  nothing, so a loss function that logs can be called on its own; the name
  and ``reduce`` are checked all the same.

Per step, the ranks agree on the logged names with one all-reduce of a
fingerprint per rank (the names themselves are gathered only when a rank's set
changes) and reduce every value in at most two all-reduces (one SUM for
``mean``/``sum``, one MAX for ``max``/``min``), never one per name.
"""
from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardwise.comm.topology import Topology
from shardwise.dims import TP, WORLD
from shardwise.torch_private import recomputing

REDUCES = ("mean", "sum", "max", "min")
# What the step row already holds (shardwise.fit.progress.StepLog.write, shardwise.fit.steps.step_scalars): a
# logged name must not overwrite it. Names, and prefixes ending in "/".
RESERVED = ("step", "loss", "step_time_s", "rss_bytes", "tokens_per_s", "mfu", "grad_norm", "clipped", "lr/",
            "comm_bytes/", "val/")


class Scalars:
    """The values :func:`log` recorded on this rank during one step (or one validation): name -> reduce, values.
    ``reserved``: the names its row already holds (a hand-written loop's row holds only the logged ones)."""

    def __init__(self, reserved: tuple[str, ...] = RESERVED) -> None:
        self.values: dict[str, tuple[str, list[torch.Tensor]]] = {}
        self.reserved = reserved

    def add(self, name: str, value: torch.Tensor, reduce: str) -> None:
        kept = self.values.setdefault(name, (reduce, []))
        if kept[0] != reduce:
            raise ValueError(f"sw.log({name!r}) was logged with reduce={kept[0]!r} and now with reduce={reduce!r}; "
                             "one name has one reduction")
        kept[1].append(value)

    def clear(self) -> None:
        self.values.clear()

    def names(self) -> list[tuple[str, str]]:
        return sorted((name, reduce) for name, (reduce, _) in self.values.items())

    def local(self, name: str, device: torch.device) -> torch.Tensor:
        """This rank's value of ``name``: its calls reduced (the mean of the micro-batches' values for "mean")."""
        reduce, values = self.values[name]
        v = torch.stack([x.to(device=device, dtype=torch.float64) for x in values])
        return {"mean": v.mean, "sum": v.sum, "max": v.max, "min": v.min}[reduce]()  # type: ignore[no-any-return,operator]


_recorders: list[Scalars] = []  # where log() writes: the innermost (a validation inside a step's)


@contextlib.contextmanager
def recording(into: Scalars) -> Iterator[Scalars]:
    """Inside the block, :func:`log` records into ``into``."""
    _recorders.append(into)
    try:
        yield into
    finally:
        _recorders.remove(into)


def log(name: str, value: float | torch.Tensor, reduce: str = "mean") -> None:
    """Log ``value`` under ``name`` in the row of the step being trained (see the module doc for the rules).

    ``value``: a Python number or a one-element tensor (kept on its device, read once per step, so logging
    does not wait for the device). ``reduce``: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``, over the
    step's calls and the ranks that hold different data. Outside a fit, nothing is recorded.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"sw.log: the name must be a non-empty string, got {name!r}")
    reserved = _recorders[-1].reserved if _recorders else RESERVED
    if any(name == r or (r.endswith("/") and name.startswith(r)) for r in reserved):
        raise ValueError(f"sw.log({name!r}): the step row already has {name!r} (it holds "
                         f"{', '.join(reserved)}); choose another name")
    if reduce not in REDUCES:
        raise ValueError(f"sw.log({name!r}): reduce must be one of {', '.join(map(repr, REDUCES))}, got {reduce!r}")
    scalar = _scalar(name, value)
    if _recorders and not recomputing():  # a recompute re-runs a forward that already logged
        _recorders[-1].add(name, scalar, reduce)


def _scalar(name: str, value: float | torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"sw.log({name!r}): the value must be one number, got a tensor of shape "
                             f"{list(value.shape)}")
        return value.detach().reshape(())
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(f"sw.log({name!r}): the value must be a number or a one-element tensor, got "
                    f"{type(value).__name__}")


class Reducer:
    """Reduces each step's :class:`Scalars` over the ranks; every rank calls :meth:`reduce` at the same point."""

    def __init__(self, topo: Topology) -> None:
        self._comm = topo.comm(WORLD)
        self._device = topo.device
        self._counts = topo.coord(TP) == 0  # tp peers hold the same values: one of them counts
        self._seen: tuple[tuple[int, ...], list[tuple[str, str]]] | None = None  # last fingerprints, their names

    def reduce(self, scalars: Scalars) -> dict[str, float]:
        """The step's values, the same on every rank: ``{name: value}`` for every name any rank logged."""
        names = self._agreed_names(scalars)
        if not names:
            return {}
        sums = [n for n, r in names if r in ("mean", "sum")]
        extremes = [n for n, r in names if r in ("max", "min")]
        out = self._sums(scalars, sums, [n for n, r in names if r == "mean"]) if sums else {}
        if extremes:
            out.update(self._extremes(scalars, extremes, {n for n, r in names if r == "min"}))
        return {n: out[n] for n, _ in names}

    def _agreed_names(self, scalars: Scalars) -> list[tuple[str, str]]:
        """Every rank's names, in one order: a fingerprint per rank is all-reduced; the names are gathered
        only when some rank's fingerprint differs from the last step's (a pipeline's stages log different
        names; the set rarely changes)."""
        mine = scalars.names()
        prints = torch.zeros(self._comm.size, dtype=torch.int64, device=self._device)
        if mine:
            prints[self._comm.rank] = zlib.crc32(json.dumps(mine).encode()) + 1
        self._comm.all_reduce(prints, name="metrics.log_names")
        key = tuple(prints.tolist())
        if not any(key):
            return []
        if self._seen is None or self._seen[0] != key:
            self._seen = key, union(self._comm.all_gather_object(mine, name="metrics.log_names"))
        return self._seen[1]

    def _value(self, scalars: Scalars, name: str) -> torch.Tensor | None:
        return scalars.local(name, self._device) if self._counts and name in scalars.values else None

    def _sums(self, scalars: Scalars, names: list[str], means: list[str]) -> dict[str, float]:
        """One SUM all-reduce: each name's counted values, then for each "mean" name how many ranks counted."""
        zero = torch.zeros((), dtype=torch.float64, device=self._device)
        values = [self._value(scalars, n) for n in names]
        counted = {n: v is not None for n, v in zip(names, values)}
        packed = torch.stack([zero if v is None else v for v in values] +
                             [zero + counted[n] for n in means])
        self._comm.all_reduce(packed, name="metrics.log")
        got = packed.tolist()
        out = dict(zip(names, got))
        for n, ranks in zip(means, got[len(names):]):
            out[n] = out[n] / ranks if ranks else float("nan")  # logged only where nothing counts (tp ranks > 0)
        return out

    def _extremes(self, scalars: Scalars, names: list[str], mins: set[str]) -> dict[str, float]:
        """One MAX all-reduce: "min" as the max of the negated values; ranks that do not count add -inf."""
        low = torch.full((), float("-inf"), dtype=torch.float64, device=self._device)
        values = [self._value(scalars, n) for n in names]
        packed = torch.stack([low if v is None else (-v if n in mins else v) for n, v in zip(names, values)])
        self._comm.all_reduce(packed, name="metrics.log", op=dist.ReduceOp.MAX)
        return {n: (-v if n in mins else v) for n, v in zip(names, packed.tolist())}


def union(every: list[list[list[str]]]) -> list[tuple[str, str]]:
    """The names every rank logged, sorted; a name logged with two reductions on two ranks is an error."""
    seen: dict[str, str] = {}
    for rank, names in enumerate(every):
        for name, reduce in names:
            if seen.setdefault(name, reduce) != reduce:
                raise ValueError(f"sw.log({name!r}) is logged with reduce={seen[name]!r} on one rank and "
                                 f"reduce={reduce!r} on rank {rank}; one name has one reduction")
    return sorted(seen.items())


__all__ = ["RESERVED", "REDUCES", "Reducer", "Scalars", "log", "recording", "union"]
