"""Debugging a script: fast_dev_run (one step, one validation batch, nothing written), limit_val_batches,
limit_train_batches and overfit_batches (equal to a plain loop over the batches they keep), and detect_anomaly naming
the operation whose backward made a NaN."""
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
    fraction = sw.Trainer("single", accelerator="cpu", progress=False, limit_val_batches=0.3).fit(
        model(), points(), nn.functional.mse_loss, SGD, batch_size=8, max_steps=2, val_dataset=points(),
        val_batch_size=5)  # 8 batches of 5: 0.3 keeps 2
    assert fraction.val_metrics == result.val_metrics


def nan_backward(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A finite loss whose backward makes a NaN: sqrt's gradient at 0 (inf) times 0."""
    return nn.functional.mse_loss(out, y) + 0.0 * torch.sqrt(out - out.detach()).sum()


def test_detect_anomaly_names_the_backward_that_made_a_nan():
    with pytest.raises(RuntimeError, match="^Function 'SqrtBackward0' returned nan values in its 0th output"), \
            pytest.warns(UserWarning, match="Error detected in SqrtBackward0"):
        sw.Trainer("single", accelerator="cpu", progress=False, detect_anomaly=True).fit(
            model(), points(), nan_backward, SGD, batch_size=8, max_steps=1)
    assert not torch.is_anomaly_enabled()


def plain_run(batches: list[list[int]]) -> list[float]:
    """SGD over the given batches of points() (sample indices), by hand: each step's loss."""
    (x, y), net, losses = points().tensors, model(), []
    opt = SGD(net.parameters())
    for idx in batches:
        loss = nn.functional.mse_loss(net(x[idx]), y[idx])
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def first_of_each_epoch(epochs: int, kept: int) -> list[list[int]]:
    """The first ``kept`` batches of 8 of each epoch's seeded permutation (seed 0), as one device reads them."""
    out = []
    for e in range(epochs):
        sampler = torch.utils.data.DistributedSampler(points(), num_replicas=1, rank=0, seed=0)
        sampler.set_epoch(e)
        order = list(sampler)
        out += [order[8 * b:8 * (b + 1)] for b in range(kept)]
    return out


def test_limit_train_batches_and_overfit_batches_train_on_the_batches_they_keep(tmp_path):
    def fit(devices: int = 1, **kw) -> sw.FitResult:
        return sw.Trainer("ddp" if devices > 1 else "single", devices, accelerator="cpu", progress=False,
                          max_epochs=3, **kw).fit(model(), points(), nn.functional.mse_loss, SGD, batch_size=8,
                                                  val_dataset=points(), val_batch_size=5)
    limited = fit(limit_train_batches=2)  # 5 batches an epoch, 2 kept: 6 steps
    assert limited.losses == pytest.approx(plain_run(first_of_each_epoch(3, 2)), rel=1e-9)
    assert fit(limit_train_batches=0.5).losses == limited.losses  # 5 x 0.5 keeps 2
    overfit = fit(2, overfit_batches=2)  # the dataset's first 2 batches, every epoch; validation on 2 batches too
    assert overfit.losses == pytest.approx(plain_run([list(range(8)), list(range(8, 16))] * 3), rel=1e-9)
    net = model()
    net.load_state_dict(overfit.state_dict)
    assert overfit.val_metrics[-1]["val_loss"] == pytest.approx(first_batch_loss(net, 10), rel=1e-9)


def test_bad_batch_limits_are_refused(no_spawn):
    cases = [({"limit_train_batches": 0}, "limit_train_batches must be a positive integer (global batches) or a "
                                          "fraction in (0, 1] (or None), got 0"),
             ({"overfit_batches": 1.5}, "overfit_batches must be a positive integer (global batches) or a fraction "
                                        "in (0, 1] (or None), got 1.5"),
             ({"limit_val_batches": True}, "limit_val_batches must be a positive integer (global batches) or a "
                                           "fraction in (0, 1] (or None), got True"),
             ({"overfit_batches": 1, "limit_train_batches": 2}, "overfit_batches=1 trains on the same first batches "
                                                                "every epoch, and limit_train_batches=2 limits the "
                                                                "epoch: pass one of them")]
    for kw, text in cases:
        with pytest.raises(ValueError) as e:
            sw.Trainer("single", accelerator="cpu", **kw)
        assert str(e.value) == text
    with pytest.raises(ValueError) as e:
        sw.Trainer("single", accelerator="cpu", limit_train_batches=0.1).fit(
            model(), points(), nn.functional.mse_loss, SGD, batch_size=8, max_steps=2)
    assert str(e.value) == "limit_train_batches=0.1 keeps no whole batch of the 5 there are: raise it, or pass a " \
                           "number of batches"
    with pytest.raises(ValueError) as e:
        sw.Trainer("single", accelerator="cpu", overfit_batches=2).fit(
            model(), Stream(), nn.functional.mse_loss, SGD, batch_size=8, max_steps=2)
    assert str(e.value) == "overfit_batches needs a map-style dataset (len and index): an iterable dataset is read " \
                           "as one stream; bound the run with fit(max_steps=) instead"


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(points())
