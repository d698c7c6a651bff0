"""Schedules that step on something other than the step count: ReduceLROnPlateau on a validation metric (lowered on
a plateau, equal under ddp, resumed exactly), and Lightning's per-epoch intervals and frequencies."""
from __future__ import annotations

import json

import pytest
import torch
from test_debug_runs import SGD, model, points
from torch import nn
from torch.optim import lr_scheduler

import shardwise as sw

pytestmark = [pytest.mark.timeout(180), pytest.mark.float64]


def plateau(opt: torch.optim.Optimizer) -> lr_scheduler.ReduceLROnPlateau:
    """A plateau unless val_loss drops by 1e9: the lr halves at every validation after the first."""
    return lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=1e9, threshold_mode="abs")


def lrs_of(path) -> list[float]:
    with open(path) as f:
        return [r["lr/0"] for r in map(json.loads, f) if "loss" in r]


def fit(strategy: str, devices: int, log, steps: int = 8, ckpt=None, schedule=plateau, **kw) -> sw.FitResult:
    trainer = sw.Trainer(strategy, devices, accelerator="cpu", progress=False, metrics_path=log, log_every_n_steps=1,
                         checkpoint_dir=ckpt, **kw)
    return trainer.fit(model(), points(), nn.functional.mse_loss, SGD, batch_size=8, max_steps=steps,
                       lr_scheduler=schedule, val_dataset=points(16), val_every=2)


def test_reduce_on_plateau_lowers_the_lr_equal_under_ddp_and_resumed(tmp_path, same_run):
    one = fit("single", 1, tmp_path / "one.jsonl")
    # Validations after steps 2, 4, 6: the first sets the best, each later one is a plateau.
    assert lrs_of(tmp_path / "one.jsonl") == [0.1] * 4 + [0.05] * 2 + [0.025] * 2
    assert fit("single", 1, None, schedule=None).losses[5] != pytest.approx(one.losses[5], rel=1e-6)
    ckpt = tmp_path / "ck"
    fit("single", 1, None, steps=4, ckpt=ckpt)  # interrupted after the lr was lowered once
    resumed = fit("ddp", 2, tmp_path / "resumed.jsonl", ckpt=ckpt)  # (one launch: ddp and the resume together)
    same_run(one, resumed)
    assert lrs_of(tmp_path / "resumed.jsonl") == [0.05] * 2 + [0.025] * 2  # not a fresh plateau count


def per_epoch(opt: torch.optim.Optimizer) -> dict:
    return {"scheduler": lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "interval": "epoch"}


def every_third_step(opt: torch.optim.Optimizer) -> dict:
    return {"scheduler": lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "frequency": 3}


def test_per_epoch_and_frequency_intervals(tmp_path):
    log = tmp_path / "m.jsonl"
    sw.Trainer("single", accelerator="cpu", progress=False, metrics_path=log, log_every_n_steps=1, max_epochs=2).fit(
        model(), points(), nn.functional.mse_loss, SGD, batch_size=8, lr_scheduler=per_epoch)
    assert lrs_of(log) == [0.1] * 5 + [0.05] * 5  # 40 samples: 5 steps an epoch
    log.unlink()
    fit("single", 1, log, steps=7, schedule=every_third_step)
    assert lrs_of(log) == [0.1] * 3 + [0.05] * 3 + [0.025]


def dict_of(**kw):
    return lambda opt: {"scheduler": plateau(opt), **kw}


def test_bad_schedules_are_refused_with_the_fix(no_spawn):
    cases = [
        (dict_of(monitor="acc"), ValueError, "lr_scheduler's monitor names 'acc', which validation does not compute; "
                                             "it computes val_loss"),
        (dict_of(frequency=2), ValueError, "lr_scheduler's frequency=2 does not apply to ReduceLROnPlateau: it steps "
                                           "after every validation (set how often with fit(val_every=))"),
        (dict_of(interval="batch"), ValueError, "lr_scheduler's interval must be 'step' or 'epoch', got 'batch'"),
        (dict_of(name="x"), ValueError, "lr_scheduler's dict takes the keys 'scheduler', 'interval', 'frequency', "
                                        "'monitor' ('scheduler' needed), got 'scheduler', 'name'"),
        (lambda opt: {"scheduler": lr_scheduler.StepLR(opt, 1), "monitor": "val_loss"}, ValueError,
         "lr_scheduler's monitor='val_loss' is for ReduceLROnPlateau, which steps on a validation metric; StepLR "
         "steps by the count of steps"),
        (lambda opt: opt, TypeError, "lr_scheduler must build a torch.optim.lr_scheduler.LRScheduler or "
                                     "ReduceLROnPlateau (or Lightning's dict holding one), got SGD"),
    ]
    for schedule, kind, text in cases:
        with pytest.raises(kind) as e:
            fit("single", 1, None, schedule=schedule)
        assert str(e.value) == text
    with pytest.raises(ValueError) as e:
        sw.Trainer("single", accelerator="cpu").fit(model(), points(), nn.functional.mse_loss, SGD, batch_size=8,
                                                   max_steps=2, lr_scheduler=plateau)
    assert str(e.value) == ("lr_scheduler ReduceLROnPlateau steps on a validation metric (monitor='val_loss'): pass "
                            "val_dataset= (and val_every= to validate during training)")
