"""Runs you can repeat: Trainer(seed=) seeds Python's random, numpy and torch on every rank before the model is
built, so a dataset that augments with random and numpy gives the same losses run after run under ddp;
Trainer(deterministic=True) sets torch's deterministic algorithms; sw.seed_everything for a script's own code."""
from __future__ import annotations

import functools
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import launch

pytestmark = [pytest.mark.timeout(180)]
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class Jittered(torch.utils.data.Dataset):
    """24 points, each read with noise from Python's random and numpy's global generator (augmentation)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        noise = random.gauss(0.0, 0.5) + np.random.normal(0.0, 0.5, 4)
        return self.x[i] + torch.as_tensor(noise, dtype=torch.float32), self.y[i]


def _runs(rank: int, device: torch.device, out: str) -> None:
    """Three fits in the ranks of one launch: twice with seed 3, once with seed 4."""
    losses = []
    for seed in (3, 3, 4):
        random.seed(rank + len(losses))  # whatever state the process had before: the Trainer's seed decides
        np.random.seed(rank + 10 * len(losses))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))  # dropout: torch's RNG
        losses.append(sw.Trainer("ddp", 2, accelerator="cpu", progress=False, seed=seed, deterministic=True).fit(
            model, Jittered(), nn.functional.mse_loss, SGD, batch_size=8, max_steps=4).losses)
    if rank == 0:
        torch.save({"losses": losses, "deterministic": torch.are_deterministic_algorithms_enabled()},
                   os.path.join(out, "got.pt"))


def test_a_dataset_augmenting_with_random_and_numpy_repeats_under_ddp(tmp_path):
    launch.spawn(_runs, 2, args=(str(tmp_path),))
    got = torch.load(tmp_path / "got.pt")
    first, again, other = got["losses"]
    assert first == again  # bit for bit
    assert first != other
    assert got["deterministic"]


def test_seed_everything_seeds_python_numpy_and_torch():
    draws = []
    for _ in range(2):
        assert sw.seed_everything(7) == 7
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(())), workers()))
    assert draws[0] == draws[1]
    with pytest.raises(ValueError, match=r"^seed must be an integer in \[0, 2\*\*32\), got -1$"):
        sw.seed_everything(-1)
    with pytest.raises(ValueError, match=r"^seed_everything\(workers=False\) is not supported: DataLoader workers "
                                         "are always seeded from torch's generator"):
        sw.seed_everything(7, workers=False)


class Draws(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        return torch.tensor([random.random(), np.random.rand(), torch.rand(())], dtype=torch.float64)


def workers() -> list[float]:
    """What a DataLoader worker draws from random, numpy and torch (torch seeds it from its generator)."""
    return torch.cat(list(torch.utils.data.DataLoader(Draws(), batch_size=1, num_workers=1))).flatten().tolist()
