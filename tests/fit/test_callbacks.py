"""Callbacks and early stopping: called on every rank, and every rank stops at the same step."""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from torch.utils.data import Subset

import shardwise as sw
from shardwise.checkpoint import store as checkpoint
from shardwise.fit.callbacks import Callback, EarlyStopping
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3)


def accuracy(out, y):
    return (out.argmax(-1) == y).float().mean()


def fit(strategy, devices, steps, callbacks=(), ckpt=None, val=True, **kw):
    work = digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, callbacks=list(callbacks),
                      checkpoint_dir=ckpt).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=steps,
        **({"val_dataset": Subset(work.test, range(100)), "val_every": 2, "val_metrics": {"accuracy": accuracy}}
           if val else {}), **kw)


# Never improves by 10 after the first validation: validations after steps 2, 4, 6, the third one stops the run.
STOPPER = EarlyStopping(monitor="val_loss", patience=2, min_delta=10.0)


class Record(Callback):
    """Writes what each hook saw to ``<folder>/rank<r>.jsonl`` (every rank its own file)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def _write(self, hook, info, **fields):
        with open(os.path.join(self.folder, f"rank{info.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"hook": hook, "step": info.step, **fields}) + "\n")

    def on_step_end(self, info):
        self._write("step", info, loss=info.loss)

    def on_validation_end(self, info):
        self._write("validation", info, metrics=info.metrics, seen=len(info.history))

    def on_checkpoint_saved(self, info):
        self._write("checkpoint", info, kind=info.kind, path=os.path.basename(info.path))

    def on_fit_end(self, info):
        self._write("end", info, losses=info.losses, reason=info.stop_reason)


class StopOnOneRank(Callback):
    """Asks to stop on rank 1 only, after step 3: a local decision the Trainer must make everyone's."""

    def on_step_end(self, info):
        if info.rank == 1 and info.step == 3:
            info.stop("rank 1 had enough")


def rows(folder, rank):
    with open(os.path.join(folder, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def single_six():
    return fit("single", 1, 6, val=False)


def test_early_stopping_stops_every_rank_at_the_same_step(tmp_path, single_six, same_run):
    folder = str(tmp_path)
    run = fit("ddp", 2, 20, callbacks=[STOPPER, Record(folder)])
    assert len(run.losses) == 6  # stopped after step 6 of 20
    assert [m["step"] for m in run.val_metrics] == [2, 4, 6]
    same_run(single_six, run)  # equal to a single-device run of 6 steps
    same_run(fit("single", 1, 20, callbacks=[STOPPER]), run)  # and to a single-device run stopped the same way
    r0, r1 = rows(folder, 0), rows(folder, 1)
    for r in (r0, r1):
        assert [x["step"] for x in r if x["hook"] == "step"] == [1, 2, 3, 4, 5, 6]
        assert [x["seen"] for x in r if x["hook"] == "validation"] == [1, 2, 3]
        end = r[-1]
        assert end["hook"] == "end" and end["step"] == 6 and end["losses"] == pytest.approx(run.losses)
        assert end["reason"].startswith("early stopping: val_loss did not improve by more than 10 in 2 validations")
    # The metrics are global: the same on both ranks; the losses are each rank's own half of the batch.
    assert [x["metrics"] for x in r0 if x["hook"] == "validation"] == \
        [x["metrics"] for x in r1 if x["hook"] == "validation"]
    assert [x["loss"] for x in r0 if x["hook"] == "step"] != [x["loss"] for x in r1 if x["hook"] == "step"]


def test_a_stop_asked_on_one_rank_stops_all(single_six, same_run):
    run = fit("ddp", 2, 20, callbacks=[StopOnOneRank()], val=False)
    assert run.losses == pytest.approx(single_six.losses[:3], rel=1e-5)


def test_a_run_stopped_early_saves_a_final_checkpoint_and_stays_stopped(tmp_path):
    folder, ckpt = str(tmp_path / "rec"), str(tmp_path / "ck")
    os.makedirs(folder)
    run = fit("ddp", 2, 20, callbacks=[STOPPER, Record(folder)], ckpt=ckpt, checkpoint_best="val_loss")
    assert [os.path.basename(p) for p in checkpoint.checkpoints(ckpt)] == ["step_00000006"]  # checkpoint_every unset
    saved = [(x["kind"], x["path"]) for x in rows(folder, 0) if x["hook"] == "checkpoint"]
    assert saved[-1] == ("final", "step_00000006")
    assert ("best", "step_00000002") in saved  # the first validation is the best one so far, always
    again = fit("ddp", 2, 20, callbacks=[STOPPER], ckpt=ckpt)  # says "already complete: ... stopped early at step 6"
    assert again.losses == pytest.approx(run.losses) and len(again.losses) == 6
    assert again.val_metrics == run.val_metrics  # kept in the checkpoint (float64: exactly)


class HoldsALambda(Callback):
    def __init__(self) -> None:
        self.fn = lambda info: None


def test_bad_callbacks_are_refused_before_any_process_starts(no_spawn):
    with pytest.raises(TypeError, match="^callback HoldsALambda cannot be sent to the rank processes"):
        fit("ddp", 2, 4, callbacks=[HoldsALambda()])
    with pytest.raises(ValueError, match="^EarlyStopping monitors 'val_loss', a validation metric, but fit has no "
                                         "val_dataset"):
        fit("ddp", 2, 4, callbacks=[EarlyStopping()], val=False)
    with pytest.raises(ValueError, match="^EarlyStopping monitors 'acc', which validation does not compute; it "
                                         "computes val_loss, accuracy$"):
        fit("ddp", 2, 4, callbacks=[EarlyStopping(monitor="acc", mode="max")])
    with pytest.raises(TypeError, match="^callbacks holds the class EarlyStopping, not an instance"):
        sw.Trainer("ddp", 2, callbacks=[EarlyStopping])
    with pytest.raises(ValueError, match="^EarlyStopping mode must be 'min' or 'max'"):
        EarlyStopping(mode="best")


def test_early_stopping_decides_from_the_history():
    from shardwise.fit.callbacks import CallbackInfo, Control

    es = EarlyStopping(monitor="acc", mode="max", patience=2, min_delta=0.01)
    history = [{"step": 1, "acc": 0.5}, {"step": 2, "acc": 0.6}, {"step": 3, "acc": 0.605}, {"step": 4, "acc": 0.59}]
    assert es.best(history) == (0.6, 2, 2)
    control = Control()
    es.on_validation_end(CallbackInfo(4, 10, 0, 1, history=history, control=control))
    assert control.reason == ("early stopping: acc did not improve by more than 0.01 in 2 validations "
                              "(best 0.6 after step 2)")
    control = Control()
    es.on_validation_end(CallbackInfo(3, 10, 0, 1, history=history[:3], control=control))
    assert control.reason is None
