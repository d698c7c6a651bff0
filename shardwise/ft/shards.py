"""The global batch kept: fixed sample shards, one per original replica group, and who computes which.

Shard ``s`` of a step is what replica ``s`` of the uninterrupted run reads:
positions ``s, s + R, s + 2R, ...`` of the step's global batch
(:class:`shardwise.data.GlobalBatches` with ``R`` replicas). A live group keeps
its own shard; the shards of dead groups go round the live ones in order. The
assignment is a function of the membership alone, so every member computes it
alike and no message carries it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardwise.data import Kwargs


def assignment(members: Sequence[int], replicas: int) -> dict[int, list[int]]:
    """``{group: its shards}`` for the live ``members`` of ``replicas`` original groups."""
    live = sorted(members)
    owned: dict[int, list[int]] = {g: [g] for g in live}
    orphans = [s for s in range(replicas) if s not in owned]
    for i, s in enumerate(orphans):
        owned[live[i % len(live)]].append(s)
    return {g: sorted(shards) for g, shards in owned.items()}


def rows(x: Any, start: int, every: int) -> Any:
    """Rows ``start, start + every, ...`` of a batch (a tensor, or tuples, lists and dicts of them; a list of
    plain values, such as a dict batch's strings, is cut like a tensor)."""
    if hasattr(x, "shape"):
        return x[start::every]
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, (str, bytes, int, float)) for v in x):
        return x[start::every]
    if isinstance(x, (list, tuple)):
        cut = [rows(v, start, every) for v in x]
        return type(x)(cut) if isinstance(x, tuple) else cut
    if isinstance(x, Mapping):
        kind = Kwargs if isinstance(x, Kwargs) else dict
        return kind((k, rows(v, start, every)) for k, v in x.items())
    raise TypeError(f"cannot cut a batch of type {type(x).__name__} into sample shards")
