"""Where each virtual stage of a pipeline lives: virtual stage ``k`` -> (pipeline rank, model chunk on that rank).

The model is cut into ``stages * chunks`` contiguous *virtual stages*; each pipeline rank holds ``chunks`` of
them. Which ones is the schedule's choice (:func:`shardwise.parallel.pp.schedules.placement`), and everything
that names a neighbour (the layers a rank keeps, the peers of its messages, the simulator, the order check)
asks this one object instead of assuming a formula:

* ``"loop"`` (Megatron's interleaving; one chunk: plain 1F1B): chunk ``c`` of rank ``r`` is ``c * p + r``.
  The activations go round the ranks ``v`` times, and every boundary is a message to the next rank.
* ``"v"`` (Qi et al. 2024, ZB-V; DeepSeek-V3's DualPipeV): the chunks zigzag, ``c * p + r`` for even ``c``
  and ``c * p + (p - 1 - r)`` for odd ``c``. With 2 chunks rank ``r`` holds ``r`` and ``2p - 1 - r``: the
  first and the last virtual stage are both on rank 0 (the loss is computed where the input enters), and
  the turn of the V (``p - 1`` to ``p``) stays on rank ``p - 1``, a hand-over with no message.
"""
from __future__ import annotations

from dataclasses import dataclass

LOOP, V = "loop", "v"
SHAPES = (LOOP, V)


@dataclass(frozen=True)
class Placement:
    """``stages`` pipeline ranks, ``chunks`` model chunks on each, laid out as ``shape`` (see the module doc)."""

    stages: int
    chunks: int = 1
    shape: str = LOOP

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"placement shape {self.shape!r}; valid: {', '.join(map(repr, SHAPES))}")
        if self.stages < 1 or self.chunks < 1:
            raise ValueError(f"placement: stages ({self.stages}) and chunks ({self.chunks}) must be >= 1")

    @property
    def total(self) -> int:
        """How many virtual stages the model is cut into."""
        return self.stages * self.chunks

    @property
    def last(self) -> int:
        """The last virtual stage: the one that computes the loss."""
        return self.total - 1

    def virtual(self, rank: int, chunk: int) -> int:
        """The virtual stage that chunk ``chunk`` of rank ``rank`` runs."""
        if not (0 <= rank < self.stages and 0 <= chunk < self.chunks):
            raise ValueError(f"rank {rank}, chunk {chunk} outside {self.stages} ranks x {self.chunks} chunks")
        turned = self.shape == V and chunk % 2 == 1  # the V's way back up: the ranks in reverse
        return chunk * self.stages + (self.stages - 1 - rank if turned else rank)

    def where(self, k: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage ``k``."""
        if not 0 <= k < self.total:
            raise ValueError(f"virtual stage {k} outside 0..{self.last}")
        chunk, pos = divmod(k, self.stages)
        return (self.stages - 1 - pos if self.shape == V and chunk % 2 == 1 else pos), chunk

    def rank_of(self, k: int) -> int:
        return self.where(k)[0]

    def mine(self, rank: int) -> list[int]:
        """The virtual stages of ``rank``, by chunk."""
        return [self.virtual(rank, c) for c in range(self.chunks)]


__all__ = ["LOOP", "SHAPES", "V", "Placement"]
