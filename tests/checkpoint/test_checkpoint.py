"""Checkpoints: atomic, resumable with exact losses, across world size and strategy, exportable, verified."""
from __future__ import annotations

import functools
import hashlib
import json
import os

import pytest
import torch

import shardwise as sw
from shardwise.checkpoint import store as checkpoint
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(240), pytest.mark.float64]

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


def test_the_fp16_loss_scale_resumes_where_it_was(tmp_path):
    """A loss 1000x too large overflows fp16 at scale 2**16: the scaler halves it over the first steps.

    Checkpointed at step 3 (mid-way through the halving) and resumed, the run
    must skip exactly the steps the uninterrupted run skipped: a scaler reset
    to 2**16 would skip three more, and every later loss would differ.
    """
    work = digits()

    def loss(out, y):
        return work.loss_fn(out, y) * 1000.0

    def run(steps, ckpt=None):
        return sw.Trainer("single", 1, accelerator="cpu", progress=False, precision="16-mixed",
                          checkpoint_dir=ckpt, checkpoint_every=3 if ckpt else None).fit(
            work.make_model(), work.train, loss, ADAMW, batch_size=64, max_steps=steps)

    whole = run(8)
    ckpt = str(tmp_path / "ck")
    run(3, ckpt)
    with open(os.path.join(checkpoint.checkpoints(ckpt)[-1], checkpoint.MANIFEST)) as f:
        assert json.load(f)["extra"] == {"scaler": [[2], "float64"]}
    resumed = run(8, ckpt)
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-6)
    for k, v in whole.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[k], v, rtol=0, atol=0)


# ---- refused (or warned about) before any process starts ------------------------------
def trainer(ckpt, **kw):
    return sw.Trainer("ddp", 2, accelerator="cpu", progress=False, checkpoint_dir=ckpt, **kw)


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_spawning(tmp_path, no_spawn):
    work = digits()
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ValueError, match=f"^checkpoint_dir='{f}' is a file, not a directory$"):
        trainer(str(f)).fit(work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=2)
    with pytest.raises(ValueError, match=f"^checkpoint_dir='{f}/sub' cannot be created: '{f}' is a file$"):
        trainer(str(f / "sub")).fit(work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=2)


def test_resuming_another_run_is_refused_before_spawning(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ck")
    fit("single", 1, 4, ckpt=ckpt, every=2)
    work = digits()
    from conftest import Spawned

    def spawn(*a, **k):
        raise Spawned("processes were started")

    monkeypatch.setattr("shardwise.launch.spawn", spawn)
    path = checkpoint.checkpoints(ckpt)[-1]
    with pytest.raises(ValueError, match=f"^the newest checkpoint {path} is at step 4, past max_steps=3: its "
                                         "weights are those of a longer run; raise max_steps to at least 4"):
        trainer(ckpt).fit(work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=3)
    with pytest.raises(ValueError, match=f"^checkpoint {path} was written with batch_size=64, this run has "
                                         "batch_size=32: the global batch fixes the data order"):
        trainer(ckpt).fit(work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=32, max_steps=8)
    with pytest.raises(ValueError, match=f"^checkpoint {path} was written with optimizer torch.optim.adamw.AdamW, "
                                         "this run uses torch.optim.sgd.SGD: the optimizer states"):
        trainer(ckpt).fit(work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.SGD, lr=0.1),
                          batch_size=64, max_steps=8)
    with pytest.raises(ValueError) as e:
        trainer(ckpt).fit(work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=2e-3),
                          batch_size=64, max_steps=8)
    assert str(e.value) == (
        f"checkpoint {path} was written by another configuration (lr 0.001 -> 0.002): resume='auto' continues only "
        "the same run; pass resume='never' (or another checkpoint_dir) to train from scratch, or resume='must' to "
        "continue this run with the new values")
    with pytest.warns(UserWarning, match=r"other optimizer settings \(lr 0\.001 -> 0\.002\): the steps after 4 use") \
            as w, pytest.raises(Spawned):
        trainer(ckpt, resume="must").fit(work.make_model(), work.train, work.loss_fn,
                                         functools.partial(torch.optim.AdamW, lr=2e-3), batch_size=64, max_steps=8)
    assert w[0].filename == __file__  # the warning points at the user's line


def test_a_rerun_after_changing_lr_is_refused_and_each_way_out_works(tmp_path, capfd):
    """A finished run, rerun with another lr: refused under "auto" (never its old result); "never" trains from
    scratch in the same directory, a path resumes that checkpoint, "must" needs one."""
    ck, work = str(tmp_path / "ck"), digits()

    def run(lr, **kw):
        return sw.Trainer("single", 1, accelerator="cpu", progress=False, checkpoint_dir=ck, checkpoint_every=2,
                          **kw).fit(work.make_model(), work.train, work.loss_fn,
                                    functools.partial(torch.optim.AdamW, lr=lr), batch_size=64, max_steps=4)

    first = run(1e-3)
    again = run(1e-3)  # the same configuration, finished: its result, said in one line
    assert again.losses == first.losses
    assert f"shardwise: already complete: {ck}/step_00000004 is at step 4 of max_steps=4, 0 steps to run\n" \
        in capfd.readouterr().err
    with pytest.raises(ValueError, match=r"^checkpoint .*step_00000004 was written by another configuration "
                                         r"\(lr 0\.001 -> 0\.01\): resume='auto' continues only the same run"):
        run(1e-2)
    fresh = run(1e-2, resume="never")
    assert fresh.losses[0] == first.losses[0] and fresh.losses[1:] != first.losses[1:]
    assert "shardwise: resume='never': removing 2 checkpoint(s) of an earlier run in" in capfd.readouterr().err
    assert run(1e-2).losses == fresh.losses  # the directory now holds the new run alone
    with pytest.warns(UserWarning, match="other optimizer settings"):
        branch = run(1e-3, resume=os.path.join(ck, "step_00000002"))
    assert branch.losses[:2] == fresh.losses[:2] and branch.losses[2:] != fresh.losses[2:]
    with pytest.raises(ValueError, match="^resume='must' but checkpoint_dir=.* holds no checkpoint to resume; pass "
                                         "resume='auto' to start when there is none$"):
        sw.Trainer("single", 1, accelerator="cpu", checkpoint_dir=str(tmp_path / "empty"), resume="must").fit(
            work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=4)
    with pytest.raises(ValueError, match="^resume='elsewhere' is neither 'auto', 'never', 'must' nor a checkpoint"):
        sw.Trainer("single", 1, accelerator="cpu", resume="elsewhere")


def test_every_file_is_checksummed_each_rank_hashing_its_own(tmp_path):
    """Each rank hashes the files it wrote (in parallel), rank 0 the rest: the manifest holds every file's SHA-256."""
    work = digits()
    ck = str(tmp_path / "ck")
    sw.Trainer("ddp", 2, accelerator="cpu", progress=False, checkpoint_dir=ck).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=1)
    path = checkpoint.latest_valid(ck)
    files = checkpoint.read_manifest(path)["files"]
    on_disk = sorted(f for f in os.listdir(path) if f != checkpoint.MANIFEST)
    assert sorted(files) == on_disk and {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)
    for name, digest in files.items():
        with open(os.path.join(path, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest
