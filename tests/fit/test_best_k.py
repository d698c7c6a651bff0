"""checkpoint_best=(name, mode, k) keeps the checkpoints of the k best validations in <checkpoint_dir>/best, beside
the last ones, across a resume."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.checkpoint import store as checkpoint

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64]
SGD = functools.partial(torch.optim.SGD, lr=0.3)


def points(n: int = 40, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g, dtype=torch.float64),
                                          torch.randn(n, 1, generator=g, dtype=torch.float64))


def fit(ckpt, steps: int, best) -> sw.FitResult:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    return sw.Trainer("single", accelerator="cpu", progress=False, checkpoint_dir=ckpt, checkpoint_every=1,
                      checkpoint_keep=1).fit(net, points(), nn.functional.mse_loss, SGD, batch_size=8, max_steps=steps,
                                             val_dataset=points(16, seed=1), val_every=1, checkpoint_best=best)


def kept(ckpt) -> dict[int, float]:
    return {int(os.path.basename(p)[5:]): checkpoint.read_manifest(p)["run"]["best"]["value"]
            for p in checkpoint.checkpoints(os.path.join(ckpt, "best"))}


def test_the_k_best_are_kept_beside_the_last_across_a_resume(tmp_path):
    whole = fit(tmp_path / "a", 8, ("val_loss", "max", 3))  # "max": the worst losses, which are not all the first
    values = {int(m["step"]): m["val_loss"] for m in whole.val_metrics}
    top = sorted(values, key=lambda s: -values[s])[:3]
    assert kept(tmp_path / "a") == {s: values[s] for s in top}
    assert [os.path.basename(p) for p in checkpoint.checkpoints(tmp_path / "a")] == ["step_00000008"]
    fit(tmp_path / "b", 4, ("val_loss", "max", 3))
    fit(tmp_path / "b", 8, ("val_loss", "max", 3))  # resumed: the history before the resume ranks too
    assert kept(tmp_path / "b") == kept(tmp_path / "a")
    fit(tmp_path / "c", 8, "val_loss")
    assert list(kept(tmp_path / "c")) == [min(values, key=values.get)]  # one, as before


def test_a_bad_k_is_refused(no_spawn, tmp_path):
    for best, text in [(("val_loss", "min", 0), "checkpoint_best's k (how many of the best checkpoints to keep) must "
                                                 "be a positive integer, got 0"),
                       (("val_loss",), "checkpoint_best must be a metric name, (name, 'min' | 'max') or (name, mode, "
                                       "k), got ('val_loss',)")]:
        with pytest.raises(ValueError) as e:
            fit(tmp_path, 2, best)
        assert str(e.value) == text
