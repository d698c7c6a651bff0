"""Synchronised BatchNorm on gloo: the global batch's statistics, forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise import launch
from shardwise.comm.topology import Topology
from shardwise.parallel.dp.sync_bn import (
    SyncBatchNorm,
    batchnorm_layers,
    convert_sync_batchnorm,
)

pytestmark = pytest.mark.timeout(120)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 4, 4, generator=g, dtype=torch.float64) * 3 + 1
    c = torch.randn(8, 3, 4, 4, generator=g, dtype=torch.float64)
    return x, c


def _bn():
    torch.manual_seed(1)
    bn = nn.BatchNorm2d(3, momentum=0.3).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _reference():
    x, c = _data()
    x.requires_grad_(True)
    bn = _bn()
    for _ in range(2):  # two steps: the running statistics blend twice
        loss = (bn(x) * c).sum()
    loss.backward()
    return bn(x).detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var


def _ranks(rank, device, world):
    topo = Topology.create(device)
    x, c = _data()
    part = slice(rank * 8 // world, (rank + 1) * 8 // world)
    xr = x[part].clone().requires_grad_(True)
    sbn = SyncBatchNorm(_bn(), topo.comm("dp"))
    for _ in range(2):
        loss = (sbn(xr) * c[part]).sum()
    loss.backward()
    out, gx, gw, gb, rm, rv = _reference()
    torch.testing.assert_close(sbn(xr).detach(), out[part], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(xr.grad, gx[part], rtol=1e-10, atol=1e-10)
    # Parameter gradients are each rank's share: summed over ranks they are the whole batch's.
    for mine, ref in ((sbn.weight.grad, gw), (sbn.bias.grad, gb)):
        total = mine.clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sbn.running_mean, rm, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sbn.running_var, rv, rtol=1e-10, atol=1e-10)
    assert topo.stats.by_name["sync_bn"] > 0  # its traffic is counted like any other collective


@pytest.mark.parametrize("world", [2, 4])
def test_equals_batchnorm_over_the_whole_batch(world):
    launch.spawn(_ranks, world, args=(world,))


def test_conversion_keeps_the_tensors_and_their_names():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Sequential(nn.BatchNorm1d(4)))
    before = dict(model.state_dict(keep_vars=True))
    assert batchnorm_layers(model) == ["1", "3.0"]
    convert_sync_batchnorm(model, Topology.create(torch.device("cpu")).comm("dp"))
    assert batchnorm_layers(model) == []
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)
