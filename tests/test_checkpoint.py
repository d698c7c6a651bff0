"""Checkpoints: atomic, resumable with exact losses, across world size and strategy, exportable, verified."""
from __future__ import annotations

import functools
import os

import pytest
import torch

import shardwise as sw
from shardwise import checkpoint
from shardwise.workloads import digits

pytestmark = pytest.mark.timeout(240)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def fit(strategy, devices, steps, ckpt=None, every=None, resume=True):
    work = digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, checkpoint_dir=ckpt,
                      checkpoint_every=every, resume=resume).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=steps)


@pytest.fixture(scope="module")
def uninterrupted():
    return fit("single", 1, 8)


@pytest.mark.parametrize("first,second", [(("ddp", 2), ("single", 1)), (("single", 1), ("ddp", 4)),
                                          (("ddp", 4), ("ddp", 2))])
def test_resume_continues_exactly(tmp_path, uninterrupted, same_run, first, second):
    ckpt = str(tmp_path / "ck")
    part = fit(*first, steps=4, ckpt=ckpt, every=2)
    assert [os.path.basename(p) for p in checkpoint.checkpoints(ckpt)] == ["step_00000002", "step_00000004"]
    assert part.losses == pytest.approx(uninterrupted.losses[:4], rel=1e-5)
    resumed = fit(*second, steps=8, ckpt=ckpt, every=2)
    same_run(uninterrupted, resumed)
    assert len(resumed.losses) == 8


def test_crash_while_saving_leaves_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ck")
    fit("single", 1, 2, ckpt=ckpt)
    # A save that died half-way leaves only a .tmp directory behind.
    os.makedirs(os.path.join(ckpt, "step_00000004.tmp"))
    with open(os.path.join(ckpt, "step_00000004.tmp", "__0_0.distcp"), "wb") as f:
        f.write(b"partial")
    assert checkpoint.latest_valid(ckpt).endswith("step_00000002")


def test_corrupted_latest_falls_back_with_warning(tmp_path, uninterrupted, same_run):
    ckpt = str(tmp_path / "ck")
    fit("ddp", 2, 4, ckpt=ckpt, every=2)
    latest = checkpoint.checkpoints(ckpt)[-1]
    victim = sorted(f for f in os.listdir(latest) if f.endswith(".distcp"))[0]
    with open(os.path.join(latest, victim), "r+b") as f:
        f.truncate(10)
    with pytest.warns(UserWarning, match=f"{victim} is corrupted \\(checksum mismatch\\); falling back"):
        assert checkpoint.latest_valid(ckpt).endswith("step_00000002")
    resumed = fit("single", 1, 8, ckpt=ckpt, every=100)
    same_run(uninterrupted, resumed)


def test_export_loads_into_bare_model(tmp_path, uninterrupted):
    ckpt = str(tmp_path / "ck")
    fit("ddp", 2, 8, ckpt=ckpt)
    out = str(tmp_path / "model.pt")
    checkpoint.export(checkpoint.checkpoints(ckpt)[-1], out)
    model = digits().make_model()
    model.load_state_dict(torch.load(out, weights_only=True))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, uninterrupted.state_dict[k], rtol=1e-5, atol=1e-5)


def test_different_model_is_rejected_with_keys_and_shapes(tmp_path):
    ckpt = str(tmp_path / "ck")
    fit("single", 1, 2, ckpt=ckpt)
    work = digits(hidden=96)
    with pytest.raises(ValueError) as e:
        sw.Trainer("single", 1, accelerator="cpu", progress=False, checkpoint_dir=ckpt).fit(
            work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=4)
    msg = str(e.value)
    assert "was written for a different model; mismatched keys and shapes:" in msg
    assert "net.0.weight: checkpoint [128, 64] vs model [96, 64]" in msg


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    ckpt = str(tmp_path / "ck")
    sw.Trainer("single", 1, accelerator="cpu", progress=False, checkpoint_dir=ckpt, checkpoint_every=1,
               checkpoint_keep=2).fit(digits().make_model(), digits().train, digits().loss_fn, ADAMW, 64, 5)
    assert [os.path.basename(p) for p in checkpoint.checkpoints(ckpt)] == ["step_00000004", "step_00000005"]
