"""The host memory a save in the background stages (``checkpoint_async``), planned rank by rank, against what
the Saver copies."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.plan import plan_run
from shardwise.plan.fit import fmt_bytes
from shardwise.plan.staging import STAGING, buffer_bytes, model_share, run_state_bytes
from shardwise.plan.states import local_chunks
from shardwise.strategies.registry import resolve

pytestmark = pytest.mark.timeout(120)

STEPS = 2


class Odd(nn.Module):
    """Sizes no shard group of 2 divides (FSDP's pieces end short on rank 1), a frozen parameter (whole on every
    rank, no optimizer state) and a persistent buffer (whole on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)
        self.b.bias.requires_grad_(False)
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(32, 7, generator=g), torch.randint(0, 3, (32,), generator=g))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_planned_staging_bytes_equal_the_bytes_the_saver_stages(tmp_path, strategy):
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    run = sw.Trainer(strategy, 2, accelerator="cpu", progress=False, checkpoint_dir=str(tmp_path),
                     checkpoint_every=STEPS, checkpoint_async=True).fit(
        Odd(), data(), nn.functional.cross_entropy, adamw, batch_size=8, max_steps=STEPS)
    layout = resolve(strategy).describe(2)
    probe = adamw([nn.Parameter(torch.zeros(1))])
    plan = plan_run(Odd(), layout, 10**12, 8, probe, checkpoint_async=True, steps=STEPS)
    share = model_share(local_chunks(Odd(), layout), layout, probe)
    staged = [s["checkpoint_staged_bytes"] for s in run.stats]
    assert [s["checkpoint_staged_model_bytes"] for s in run.stats] == [b + 3 * 4 for b in share]
    assert list(plan.host[STAGING]) == staged
    assert staged == [b + buffer_bytes(Odd()) + run_state_bytes(STEPS) for b in share]
    if strategy == "fsdp":  # each rank stages its own piece: rank 1's pieces end short
        assert share[0] > share[1]
    assert f"{STAGING} {fmt_bytes(max(staged))} of host memory per rank" in plan.summary()
