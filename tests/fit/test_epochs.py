"""Trainer(max_epochs=) beside fit(max_steps=): Lightning's habit, with a defined meaning for the last
partial global batch (dropped), an iterable dataset (its __len__), both limits (the first reached) and a resume in
the middle of an epoch (the same order as the uninterrupted run)."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import shardwise as sw

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64]
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def samples(n: int = 70) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def fit(trainer_kw: dict | None = None, **fit_kw) -> sw.FitResult:
    trainer = sw.Trainer("single", accelerator="cpu", progress=False, **(trainer_kw or {}))
    return trainer.fit(model(), fit_kw.pop("data", samples()), nn.functional.cross_entropy, SGD, batch_size=16,
                       **fit_kw)


def test_epochs_are_whole_global_batches_and_the_same_steps_as_max_steps(same_run):
    """70 samples in global batches of 16: 4 steps an epoch (6 samples dropped, another 6 each epoch)."""
    epochs = fit({"max_epochs": 3})
    assert len(epochs.losses) == 12
    same_run(fit(max_steps=12), epochs)
    assert len(fit({"max_epochs": 3}, max_steps=5).losses) == 5  # whichever limit comes first
    assert len(fit({"max_epochs": 1}, max_steps=50).losses) == 4


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int, sized: bool) -> None:
        self.data, self.sized = samples(n), sized

    def __iter__(self):
        return iter(self.data)

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no length")
        return len(self.data)


def test_an_iterable_dataset_needs_its_length_for_epochs():
    assert len(fit({"max_epochs": 2}, data=Stream(70, sized=True)).losses) == 8
    with pytest.raises(ValueError) as e:
        fit({"max_epochs": 2}, data=Stream(70, sized=False))
    assert str(e.value) == ("Trainer(max_epochs=2) needs the dataset's length, and this Stream has no __len__: give "
                            "it one (its samples per pass), or train for fit(max_steps=N) optimizer steps")


def test_how_long_to_train_must_be_said():
    with pytest.raises(TypeError) as e:
        fit()
    assert str(e.value) == ("say how long to train: fit(..., max_steps=N) optimizer steps, or "
                            "Trainer(max_epochs=N) passes over the dataset")
    with pytest.raises(ValueError, match=r"^max_epochs must be a positive integer \(or None\), got 0$"):
        sw.Trainer("single", max_epochs=0)
    with pytest.raises(ValueError, match=r"^an epoch of 10 samples holds no whole global batch of batch_size=16; "):
        fit({"max_epochs": 1}, data=samples(10))


class Crash(sw.Callback):
    def on_step_end(self, info) -> None:  # noqa: D102
        if info.step == 6:
            raise RuntimeError("crashed in the middle of the second epoch")


def test_a_resume_in_the_middle_of_an_epoch_equals_the_uninterrupted_run(tmp_path, same_run):
    ck = {"checkpoint_dir": str(tmp_path), "checkpoint_every": 5, "max_epochs": 3}  # step 5: epoch 2's first
    with pytest.raises(RuntimeError, match="crashed in the middle"):
        fit({**ck, "callbacks": [Crash()]})
    same_run(fit({"max_epochs": 3}), fit(ck))
