"""What surrounds the engine under engine="torch", the same as under ours: validation during fit and its
callbacks and logger, `Trainer.predict` and `Trainer.validate`, and `on_nonfinite="skip"`, under torch's FSDP2,
DDP and pipelining, each equal to our engine's run (float64), in one 2-rank launch."""
from __future__ import annotations

import json
import os

import pytest
import torch
from test_torch_engine import ADAMW, gpt

import shardwise as sw
from shardwise import launch
from shardwise.models import lm_loss
from shardwise.workloads import CharText, digits, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]


class Seen(sw.Callback):
    """The steps that ended and the validations' metrics, as the callbacks see them."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.vals: list[dict[str, float]] = []

    def on_step_end(self, info) -> None:  # noqa: D102
        self.steps.append(info.step)

    def on_validation_end(self, info) -> None:  # noqa: D102
        self.vals.append(dict(info.metrics))


def _fit_with_validation(strategy: sw.Strategy, folder: str) -> dict:
    """2 steps with validation after every step, a callback and a JSONL logger; then predict and validate."""
    text = CharText(stdlib_text(6_000), 16)
    val = CharText(stdlib_text(2_000), 16)
    seen = Seen()
    trainer = sw.Trainer(strategy, 2, accelerator="cpu", progress=False, callbacks=[seen],
                         logger=sw.loggers.JSONL(os.path.join(folder, "log.jsonl")), log_every_n_steps=1)
    model = gpt()
    run = trainer.fit(model, text, lm_loss, ADAMW, batch_size=8, max_steps=2, val_dataset=val, val_every=1)
    logged = [json.loads(line) for line in open(os.path.join(folder, "log.jsonl"))] if \
        torch.distributed.get_rank() == 0 else []
    return {"losses": run.losses, "val_metrics": run.val_metrics, "steps": seen.steps, "vals": seen.vals,
            # What the logger wrote of the optimisation (not the timings or our engine's byte counts).
            "logged": [{k: v for k, v in r.items() if k in ("step", "loss", "val_loss", "lr")} for r in logged],
            "predict": trainer.predict(model, val, batch_size=4),
            "validate": trainer.validate(model, val, lm_loss, batch_size=4)}


def _nan_skipped(strategy: sw.Strategy) -> list[float]:
    work = digits()
    x, y = (t[:128].clone() for t in work.train.tensors)
    x[0] = float("nan")  # two global batches an epoch: one step of each epoch is skipped on every rank
    return sw.Trainer(strategy, 2, accelerator="cpu", progress=False, on_nonfinite="skip").fit(
        work.make_model(), torch.utils.data.TensorDataset(x, y), work.loss_fn, ADAMW, batch_size=64,
        max_steps=4).losses


def _runs(rank: int, device: torch.device, folder: str) -> None:
    out = {}
    for name, make in (("fsdp", sw.FSDP), ("pp", sw.PP)):
        for engine in ("shardwise", "torch"):
            sub = os.path.join(folder, f"{name}-{engine}")
            os.makedirs(sub, exist_ok=True)
            out[name, engine] = _fit_with_validation(make(engine=engine), sub)
    for name, make in (("ddp", sw.DDP), ("fsdp", sw.FSDP)):
        for engine in ("shardwise", "torch"):
            out["nan", name, engine] = _nan_skipped(make(engine=engine))
    if rank == 0:
        torch.save(out, os.path.join(folder, "runs.pt"))


def _close(a, b) -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=0)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-9, nan_ok=True)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y)
    else:
        assert a == b


def test_validation_callbacks_logger_predict_and_nonfinite_under_torch_equal_ours(tmp_path):
    launch.spawn(_runs, 2, args=(str(tmp_path),))
    runs = torch.load(tmp_path / "runs.pt", weights_only=False)
    for name in ("fsdp", "pp"):
        ours, theirs = runs[name, "shardwise"], runs[name, "torch"]
        assert theirs["steps"] == [1, 2]  # the callbacks saw every step and each validation's metrics
        assert theirs["vals"] == [{k: v for k, v in m.items() if k != "step"} for m in theirs["val_metrics"]]
        assert {"val_loss"} <= set(theirs["val_metrics"][0]) and len(theirs["logged"]) >= 2
        assert theirs["predict"].shape[0] == len(CharText(stdlib_text(2_000), 16))
        _close(ours, theirs)
    for name in ("ddp", "fsdp"):
        ours, theirs = runs["nan", name, "shardwise"], runs["nan", name, "torch"]
        assert sum(v != v for v in theirs) == 2  # one step an epoch skipped, the rest trained
        _close(ours, theirs)
