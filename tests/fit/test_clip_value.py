"""gradient_clip_algorithm="value" clamps every gradient element as one device does, under ddp; the global
gradient norm is in the step log on every logged step, clipping or not."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

import shardwise as sw

pytestmark = [pytest.mark.timeout(180), pytest.mark.float64]
SGD = functools.partial(torch.optim.SGD, lr=0.5)


def points() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g, dtype=torch.float64),
                                          torch.randn(32, 1, generator=g, dtype=torch.float64))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def run(strategy: str, devices: int, log: str | None = None, **kw) -> tuple[sw.FitResult, list[dict]]:
    result = sw.Trainer(strategy, devices, accelerator="cpu", progress=False, metrics_path=log, seed=1, **kw).fit(
        model(), points(), nn.functional.mse_loss, SGD, batch_size=16, max_steps=4)
    if log is None:
        return result, []
    with open(log) as f:
        return result, [json.loads(line) for line in f if '"loss"' in line]


def first_norm() -> float:
    """The global gradient norm of the first step, by hand: the batch the seed's permutation puts first."""
    data, net = points(), model()
    order = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=1))[:16]
    x, y = data.tensors[0][order], data.tensors[1][order]
    nn.functional.mse_loss(net(x), y).backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])))


def test_value_clipping_under_ddp_equals_one_device_and_the_norm_is_logged_unclipped(tmp_path, same_run):
    clip = {"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"}
    one, one_rows = run("single", 1, str(tmp_path / "one.jsonl"), log_every_n_steps=1, **clip)
    two, two_rows = run("ddp", 2, str(tmp_path / "two.jsonl"), log_every_n_steps=2, **clip)
    same_run(one, two)
    assert run("single", 1)[0].losses[1:] != one.losses[1:]  # the clamp changed the run
    assert [r["step"] for r in two_rows] == [1, 3]  # logged steps only
    assert [r["grad_norm"] for r in two_rows] == pytest.approx([one_rows[1]["grad_norm"], one_rows[3]["grad_norm"]],
                                                               rel=1e-9)
    assert one_rows[0]["grad_norm"] == pytest.approx(first_norm(), rel=1e-9)
    assert "clipped" not in one_rows[0]  # said for a clip by norm only


def test_a_wrong_clip_algorithm_is_refused(no_spawn):
    with pytest.raises(ValueError, match="^gradient_clip_algorithm must be 'norm' or 'value', got 'max'$"):
        sw.Trainer("single", accelerator="cpu", gradient_clip_algorithm="max")
