"""Learning-rate schedules: stepped per optimizer step, equal under every strategy, resumed exactly."""
from __future__ import annotations

import functools

import pytest
import torch

import shardwise as sw
from shardwise.strategies.parallel import Parallel
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(240), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
# Warm up over 2 steps to 1e-2, then anneal: a schedule whose every step changes the update.
ONECYCLE = functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=1e-2, total_steps=8, pct_start=0.25)


def fit(strategy, devices, steps=8, ckpt=None, schedule=ONECYCLE):
    work = digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, checkpoint_dir=ckpt,
                      checkpoint_every=3 if ckpt else None).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=steps, lr_scheduler=schedule)


@pytest.fixture(scope="module")
def reference():
    return fit("single", 1)


def test_the_schedule_changes_the_run(reference):
    plain = fit("single", 1, schedule=None)
    assert plain.losses[:1] == reference.losses[:1]  # the first step's loss is computed before any update
    assert plain.losses[2] != pytest.approx(reference.losses[2], rel=1e-3)


@pytest.mark.parametrize("strategy,devices", [("ddp", 2), ("zero2", 2), ("zero3", 4),
                                              (Parallel(dp=2, pp=2, zero=1), 4)],
                         ids=["ddp", "zero2", "zero3", "dp2-pp2-zero1"])
def test_equal_under_every_strategy(reference, same_run, strategy, devices):
    same_run(reference, fit(strategy, devices))


def test_resumes_exactly_under_another_layout(tmp_path, reference, same_run):
    ckpt = str(tmp_path / "ck")
    fit("ddp", 2, steps=3, ckpt=ckpt)
    same_run(reference, fit("zero3", 4, ckpt=ckpt))


def test_refused_before_spawning(no_spawn):
    with pytest.raises(TypeError, match=r"^lr_scheduler must build a torch.optim.lr_scheduler.LRScheduler .* got "
                                        r"AdamW$"):
        fit("ddp", 2, schedule=lambda opt: opt)
    with pytest.raises(ValueError, match="^strategy 'ps' does not support lr_scheduler: its optimizer runs on the "
                                         "server ranks"):
        fit(sw.ParameterServer(servers=1), 3)
