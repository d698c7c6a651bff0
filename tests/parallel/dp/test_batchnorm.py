"""BatchNorm under data parallelism.

With ``sync_batchnorm=True`` a CNN with BatchNorm trains as on one device
(running statistics included) under ddp, zero3, fsdp, hsdp and dp x tp;
without it every rank ends with the same buffers and a warning says what
differs.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardwise as sw
from shardwise.strategies.parallel import Parallel
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3)


class BNNet(nn.Module):
    # No bias before a BatchNorm, as in torchvision's ResNets: the normalisation removes it, so its
    # gradient is zero and Adam would turn rounding noise into O(1) steps of it.
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.fc1, self.bn3, self.fc2 = nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32), nn.Linear(32, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc2(F.relu(self.bn3(self.fc1(x.mean((2, 3))))))


def make():
    torch.manual_seed(0)
    return BNNet()


def fit(strategy, devices, **kw):
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, **kw).fit(
        make(), digits().train, F.cross_entropy, ADAMW, batch_size=64, max_steps=4)


@pytest.fixture(scope="module")
def reference():
    return fit("single", 1)


@pytest.mark.parametrize("strategy,devices", [
    ("ddp", 2), ("zero3", 2), ("fsdp", 4), (sw.HSDP(shard_size=2), 4),
    (Parallel(dp=2, tp=2, tp_plan={"fc2": "colwise_gather"}), 4)],
    ids=["ddp", "zero3", "fsdp4", "hsdp4", "dp2-tp2"])
def test_sync_batchnorm_equals_single_device(reference, same_run, strategy, devices):
    run = fit(strategy, devices, sync_batchnorm=True)
    same_run(reference, run)  # every tensor: weights, running_mean, running_var, num_batches_tracked
    assert "sync_bn" in run.stats[0]["comm_by_name"]


def test_without_it_the_replicas_agree_and_a_warning_says_why(reference):
    with pytest.warns(UserWarning, match=r"^the model has BatchNorm layers \(bn1, bn2, bn3\): under 'ddp' each of "
                                         r"the 2 data-parallel ranks normalises with the statistics of its own part"):
        run = fit("ddp", 2)
    assert len({s["buffers_sum"] for s in run.stats}) == 1  # every rank holds rank 0's running statistics
    # And it really is not single-device training: the per-rank batch statistics differ.
    assert run.losses[1] != pytest.approx(reference.losses[1], rel=1e-6)


def test_sync_batchnorm_needs_ranks(no_spawn):
    with pytest.raises(ValueError, match="^sync_batchnorm is not supported by strategy 'dp': one process drives"):
        fit("dp", 2, sync_batchnorm=True)
