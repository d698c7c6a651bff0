"""Resharding checkpoints: written under one sharded strategy and world size, resumed under another, exactly."""
from __future__ import annotations

import functools
import os

import pytest
import torch

import shardwise as sw
from shardwise.checkpoint import store as checkpoint
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
K = 3  # steps before the checkpoint; the resumed run goes to 2K


def fit(strategy, devices, steps, ckpt, every=None):
    work = digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, checkpoint_dir=ckpt,
                      checkpoint_every=every, resume=True).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=steps)


@pytest.fixture(scope="module")
def uninterrupted():
    return fit("single", 1, 2 * K, None)


@pytest.mark.parametrize("first,second", [
    (("zero3", 4), ("ddp", 2)),   # 4 padded shards (the bias of 10 splits 3,3,3,1) -> replicas
    (("ddp", 2), ("zero3", 4)),   # and back
    (("zero1", 2), ("fsdp", 4)),  # optimizer states sharded over 2 -> everything sharded over 4
    (("fsdp", 2), ("hsdp", 4)),   # fully sharded over 2 -> 2 replicas of 2 shards
    # One process driving several devices: single-process DataParallel and naive model parallelism.
    ((sw.NaiveMP(), 2), ("zero3", 4)),
    (("zero1", 2), (sw.NaiveMP(), 2)),
    (("dp", 2), ("ddp", 4)),
    (("fsdp", 4), ("dp", 2)),
], ids=["zero3-ddp", "ddp-zero3", "zero1-fsdp", "fsdp-hsdp", "naive_mp-zero3", "zero1-naive_mp", "dp-ddp", "fsdp-dp"])
def test_resume_under_another_strategy_and_world_size(tmp_path, uninterrupted, same_run, first, second):
    ckpt = str(tmp_path / "ck")
    part = fit(*first, steps=K, ckpt=ckpt, every=K)
    assert [os.path.basename(p) for p in checkpoint.checkpoints(ckpt)] == [f"step_{K:08d}"]
    assert part.losses == pytest.approx(uninterrupted.losses[:K], rel=1e-5)
    resumed = fit(*second, steps=2 * K, ckpt=ckpt)
    assert len(resumed.losses) == 2 * K
    same_run(uninterrupted, resumed)


def test_export_of_a_sharded_checkpoint_is_the_full_model(tmp_path, uninterrupted):
    """A zero3 checkpoint (flattened Shard(0) pieces) exports to the plain state dict of the bare model."""
    ckpt = str(tmp_path / "ck")
    run = fit("zero3", 2, steps=K, ckpt=ckpt)
    sd = checkpoint.export(checkpoint.checkpoints(ckpt)[-1], str(tmp_path / "model.pt"))
    model = digits().make_model()
    model.load_state_dict(sd)  # strict: every key, every shape
    for k, v in run.state_dict.items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)
