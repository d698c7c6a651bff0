"""Global-batch data sharding that gives the same batches for any device count."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DistributedSampler
from torch.utils.data._utils.collate import default_collate


class GlobalBatches:
    """Rank ``rank``'s share of each global batch, drawn through torch's DistributedSampler.

    DistributedSampler gives rank r the positions r, r+N, r+2N, ... of one
    seeded permutation. Taking ``b = B/N`` consecutive entries of that list for
    step w gives rank r the positions w*B + r + N*j, so the union over ranks is
    exactly positions w*B .. (w+1)*B - 1 of the permutation: the same global
    batch whatever N is. Only whole global batches are used in an epoch.
    """

    def __init__(self, dataset: Any, global_batch: int, replicas: int, rank: int, seed: int = 0,
                 shuffle: bool = True) -> None:
        n = len(dataset)
        check_dataset(n, global_batch)
        self.dataset = dataset
        self.local_batch = global_batch // replicas
        self.steps_per_epoch = n // global_batch
        self.sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=False)
        self._epoch = -1
        self._indices: list[int] = []

    def indices(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._indices = list(self.sampler)
            self._epoch = epoch
        b = self.local_batch
        return self._indices[within * b:(within + 1) * b]

    def batch(self, step: int, device: torch.device) -> Any:
        return to_device(collate([self.dataset[i] for i in self.indices(step)]), device)


def check_dataset(n: int, global_batch: int) -> None:
    """A dataset must hold at least one whole global batch."""
    if n == 0:
        raise ValueError("the dataset is empty: it has no (input, target) pairs to train on")
    if global_batch < 1:
        raise ValueError(f"batch_size must be >= 1, got {global_batch}")
    if n < global_batch:
        raise ValueError(f"the dataset has {n} samples, fewer than one global batch "
                         f"(batch_size={global_batch}); lower batch_size or use more data")


def collate(samples: Sequence[Any]) -> Any:
    return default_collate(list(samples))


def to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x
