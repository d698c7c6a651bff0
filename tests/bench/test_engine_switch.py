"""The ddp and fsdp pairs as engine switches: one Trainer setup alternating ``engine="shardwise"`` and
``engine="torch"`` in the same ranks, repetition by repetition; in float64 both engines train the same losses,
and the bytes our communication layer counted per step equal the formula (torch's are not seen)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from shardwise import launch
from shardwise.bench.engines import SWITCHES, grad_bytes, loss_gap, run_switch

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64]


def made() -> tuple[nn.Module, TensorDataset, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    g = torch.Generator().manual_seed(0)
    return model, TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)), F.mse_loss


@pytest.mark.parametrize("pair", ["ddp", "fsdp"])
def test_a_switch_alternates_the_engines_of_one_trainer_setup(pair):
    switch = SWITCHES[pair]
    work = made()
    ranks, losses = run_switch(switch.strategy_for(2), work, 2, batch=8, reps=2, steps=2)
    assert len(ranks) == 2
    for r in ranks:
        assert r.names == ("shardwise", "torch")
        assert all(len(t) == 2 and min(t) > 0 for t in r.step_times.values())  # a run per engine per repetition
        assert all(len(m) == 2 for m in r.peak_rss_delta.values())
        assert r.sent_per_step == {"shardwise": switch.factor * (2 - 1) / 2 * grad_bytes(work[0]), "torch": None}
    assert len(losses["shardwise"]) == len(losses["torch"]) == 3  # the untimed first step and the 2 timed
    assert loss_gap(losses) <= 1e-12 * max(losses["torch"])  # the same training under both engines


def _threads_after_joining(rank: int, device: torch.device, path: str) -> None:
    before = torch.get_num_threads()
    launch.init("cpu")  # what a Trainer does when it joins this running group
    assert torch.get_num_threads() == before, (before, torch.get_num_threads())


@pytest.mark.timeout(60)
def test_a_fit_joining_the_ranks_keeps_their_threads(tmp_path):
    # launch.spawn gives each rank its share of the cores; joining its group once took them all again (each of the
    # 2 ranks on 2 cores 2 threads: the ddp switch's steps ran 4x slower than the same Trainer launched alone).
    launch.spawn(_threads_after_joining, 2, args=(str(tmp_path),))
