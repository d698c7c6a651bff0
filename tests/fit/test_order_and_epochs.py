"""Trainer(shuffle=False) reads the dataset in its own order whatever the device count; the epoch hooks come at
the epoch's edges; a callback's info.model is the prepared model, whose forward every rank calls."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

import shardwise as sw

pytestmark = [pytest.mark.timeout(180), pytest.mark.float64]
SGD = functools.partial(torch.optim.SGD, lr=0.1)
N, BATCH, EPOCHS = 24, 8, 2


def points() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(N, 4, generator=g, dtype=torch.float64),
                                          torch.randn(N, 1, generator=g, dtype=torch.float64))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


class Edges(sw.Callback):
    """Writes, on rank 0, each epoch and validation hook and, at an epoch's end, the prepared model's output."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, info: sw.fit.callbacks.CallbackInfo, what: str, **extra: object) -> None:
        if info.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"hook": what, "step": info.step, "epoch": info.epoch, **extra}) + "\n")

    def on_train_epoch_start(self, info) -> None:
        self._write(info, "start")

    def on_train_epoch_end(self, info) -> None:
        with torch.no_grad():
            out = info.model(torch.ones(2, 4, dtype=torch.float64))  # on every rank: ddp's forward alike
        self._write(info, "end", out=out.flatten().tolist())

    def on_validation_epoch_end(self, info) -> None:
        self._write(info, "validation", val_loss=info.metrics["val_loss"])


def in_order() -> list[float]:
    """The plain loop over the dataset in its order: batches 0..7, 8..15, 16..23, twice."""
    net, data = model(), points()
    opt = SGD(net.parameters())
    losses = []
    for step in range(EPOCHS * N // BATCH):
        w = step % (N // BATCH)
        x, y = data.tensors[0][w * BATCH:(w + 1) * BATCH], data.tensors[1][w * BATCH:(w + 1) * BATCH]
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("ddp", 2)])
def test_shuffle_false_keeps_the_dataset_order_and_the_epoch_hooks_see_the_model(strategy, devices, tmp_path):
    log = str(tmp_path / "hooks.jsonl")
    net = model()
    result = sw.Trainer(strategy, devices, accelerator="cpu", progress=False, shuffle=False, max_epochs=EPOCHS,
                        callbacks=[Edges(log)]).fit(net, points(), nn.functional.mse_loss, SGD, batch_size=BATCH,
                                                    val_dataset=points(), val_every=3)
    assert result.losses == pytest.approx(in_order(), rel=1e-9)
    with open(log) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["hook"], r["step"], r["epoch"]) for r in rows] == [
        ("start", 0, 0), ("validation", 3, None), ("end", 3, 0), ("start", 3, 1), ("validation", 6, None),
        ("end", 6, 1)]
    with torch.no_grad():
        final = net(torch.ones(2, 4, dtype=torch.float64)).flatten().tolist()
    assert rows[-1]["out"] == pytest.approx(final, rel=1e-9)  # the last epoch's end sees the trained model
    assert rows[1]["val_loss"] == result.val_metrics[0]["val_loss"]


def test_dataloader_shuffle_names_the_trainer_option(no_spawn):
    with pytest.raises(ValueError, match=r"cannot be set: .*; Trainer\(shuffle=False\) keeps the dataset's order$"):
        sw.Trainer("single", accelerator="cpu", dataloader_kwargs={"shuffle": False})
