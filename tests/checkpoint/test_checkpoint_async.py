"""Checkpoints written beside training (``checkpoint_async``): the same bytes as a save in the foreground, though
the steps after it ran during the write, and a rank killed during a write resumes from the checkpoint before."""
from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise.checkpoint import store as checkpoint
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # reading a checkpoint alone

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
STEPS = 6


class HeldWrite(sw.Callback):
    """Holds every write in the background for ``delay`` seconds before it writes anything, so the steps after a
    save change the live tensors before the write reads its copies; with ``kill_step``, rank 1 is killed
    (SIGKILL) in the write of that step's checkpoint once its files are on disk (not its manifest). The patches
    are this rank's, for this fit."""

    def __init__(self, delay: float, kill_step: int | None = None) -> None:
        self.delay, self.kill_step = delay, kill_step

    def on_fit_start(self, info):
        self.originals = checkpoint._dcp, checkpoint._checksums
        dcp_modules, checksums = self.originals
        rank = info.rank

        def held_dcp():
            if threading.current_thread().name == "shardwise-checkpoint":
                time.sleep(self.delay)
            return dcp_modules()

        def killed(path, comm):
            if self.kill_step is not None and rank == 1 and path.endswith(f"step_{self.kill_step:08d}.tmp"):
                os.kill(os.getpid(), signal.SIGKILL)
            return checksums(path, comm)
        checkpoint._dcp, checkpoint._checksums = held_dcp, killed

    def on_fit_end(self, info):
        checkpoint._dcp, checkpoint._checksums = self.originals

    on_exception = on_fit_end


def fit(ckpt, asynchronous, callbacks=None):
    work = digits()
    return sw.Trainer("ddp", 2, accelerator="cpu", progress=False, checkpoint_dir=ckpt, checkpoint_every=2,
                      checkpoint_async=asynchronous, callbacks=callbacks).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=STEPS)


def tensors(path):
    """Every tensor of a checkpoint (model, optimizer states, run state), read whole."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("sync") / "ck")
    return ckpt, fit(ckpt, False)


def test_a_background_save_holds_the_bytes_of_a_foreground_save(tmp_path, synchronous):
    sync_dir, sync_run = synchronous
    ckpt = str(tmp_path / "ck")
    run = fit(ckpt, True, [HeldWrite(0.3)])
    names = [os.path.basename(p) for p in checkpoint.checkpoints(ckpt)]
    assert names == ["step_00000002", "step_00000004", "step_00000006"]
    for name in names:
        want, got = tensors(os.path.join(sync_dir, name)), tensors(os.path.join(ckpt, name))
        assert sorted(got) == sorted(want)
        for k, t in want.items():
            assert torch.equal(got[k], t), f"{name} {k}"
        assert checkpoint.verify(os.path.join(ckpt, name)) is None
    assert run.losses == sync_run.losses
    for stats in run.stats:  # each write was held 0.3 s before writing: the steps after 2 and 4 ran first
        assert stats["checkpoint_async"] and len(stats["checkpoint_blocked_s"]) == 3
        assert stats["checkpoint_steps_beside_write"] >= 2 and stats["checkpoint_staged_bytes"] > 0
    assert sync_run.stats[0]["checkpoint_steps_beside_write"] == 0


def test_a_rank_killed_during_a_background_write_resumes_from_the_checkpoint_before(tmp_path, synchronous, same_run):
    ckpt = str(tmp_path / "ck")
    with pytest.raises(Exception, match="rank 1 died"):
        fit(ckpt, True, [HeldWrite(0.0, kill_step=4)])
    assert os.path.isdir(os.path.join(ckpt, "step_00000004.tmp"))  # its files written, its manifest not
    assert checkpoint.latest_valid(ckpt).endswith("step_00000002")
    resumed = fit(ckpt, True)
    same_run(synchronous[1], resumed)


def test_checkpoint_async_needs_a_directory(no_spawn):
    with pytest.raises(ValueError, match="^checkpoint_async=True was given without checkpoint_dir: say where"):
        sw.Trainer("ddp", 2, accelerator="cpu", checkpoint_async=True)
