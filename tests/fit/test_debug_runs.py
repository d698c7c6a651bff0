"""Debugging a script: fast_dev_run (one step, one validation batch, nothing written), limit_val_batches, and
detect_anomaly naming the operation whose backward made a NaN."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import shardwise as sw

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64]
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def points(n: int = 40) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g, dtype=torch.float64),
                                          torch.randn(n, 1, generator=g, dtype=torch.float64))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def first_batch_loss(net: nn.Module, size: int) -> float:
    x, y = points().tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(net(x[:size]), y[:size]))


def test_fast_dev_run_takes_one_step_and_one_validation_batch_and_writes_nothing(tmp_path):
    ck = tmp_path / "ck"
    net = model()
    result = sw.Trainer("single", accelerator="cpu", progress=False, fast_dev_run=True, checkpoint_dir=ck,
                        checkpoint_every=1, metrics_path=tmp_path / "m.jsonl").fit(
        net, points(), nn.functional.mse_loss, SGD, batch_size=8, max_steps=50, val_dataset=points(), val_every=1)
    assert len(result.losses) == 1
    assert [v["step"] for v in result.val_metrics] == [1]
    assert result.val_metrics[0]["val_loss"] == pytest.approx(first_batch_loss(net, 8), rel=1e-12)
    assert not ck.exists() and not (tmp_path / "m.jsonl").exists()


def test_limit_val_batches_validates_on_the_first_batches():
    net = model()
    result = sw.Trainer("single", accelerator="cpu", progress=False, limit_val_batches=2).fit(
        net, points(), nn.functional.mse_loss, SGD, batch_size=8, max_steps=2, val_dataset=points(), val_batch_size=5)
    assert result.val_metrics[-1]["val_loss"] == pytest.approx(first_batch_loss(net, 10), rel=1e-12)
    with pytest.raises(ValueError, match=r"^limit_val_batches must be a positive integer \(or None: the whole set\), "
                                         "got 0$"):
        sw.Trainer("single", accelerator="cpu", limit_val_batches=0)


def nan_backward(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A finite loss whose backward makes a NaN: sqrt's gradient at 0 (inf) times 0."""
    return nn.functional.mse_loss(out, y) + 0.0 * torch.sqrt(out - out.detach()).sum()


def test_detect_anomaly_names_the_backward_that_made_a_nan():
    with pytest.raises(RuntimeError, match="^Function 'SqrtBackward0' returned nan values in its 0th output"), \
            pytest.warns(UserWarning, match="Error detected in SqrtBackward0"):
        sw.Trainer("single", accelerator="cpu", progress=False, detect_anomaly=True).fit(
            model(), points(), nan_backward, SGD, batch_size=8, max_steps=1)
    assert not torch.is_anomaly_enabled()
