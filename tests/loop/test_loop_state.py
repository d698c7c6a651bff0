"""A hand-written loop keeps what Accelerate's keeps: a loop killed (SIGKILL) between saves and resumed with
``sw.load`` equals the uninterrupted loop, under ddp and fsdp and from one to the other and back, with a StepLR
schedule, dropout, numpy and Python noise and a shuffled loader's position all mattering; ``sw.log`` in the loop
reads back from the CSV file and MLflow's own client as the global means; Accelerate's names on ``sw.setup``
are taken or refused with our messages; ``sw.is_main_process``, ``sw.print`` and ``sw.main_process_first``.

Three launches of two ranks, each running several named scenarios: the reference and a ddp loop killed after
its save at step 3; that checkpoint resumed under ddp, and under fsdp (saving at step 7, killed at 8); the fsdp
checkpoint resumed under fsdp and under ddp, then the names and helpers.
"""
from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import os
import random
import signal
import time
import types

import numpy as np
import pytest
import torch
from conftest import assert_same_run, mlflow_db
from torch.utils.data import TensorDataset

import shardwise as sw
from shardwise import launch
from shardwise.loop import names as loop_names

mlflow_client = pytest.importorskip("mlflow.tracking")

pytestmark = [pytest.mark.timeout(240), pytest.mark.float64,
              pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")]

EPOCHS, BATCH, SAMPLES = 2, 16, 80  # 5 steps an epoch: the saves at 3 and 7 fall inside an epoch
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


class History:
    """The global loss of every step: a registered object of the loop's own (its state is JSON)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def state_dict(self) -> dict:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.losses = list(state["losses"])


def loop(rank: int, strategy: str, ckpt: str, out: str | None, save_at=(), kill_at=None, resume=None,
         logger=None) -> None:
    """The loop a port of an Accelerate script writes: seeded per rank, resumed from ``resume`` (every RNG
    scrambled first, so that only what sw.load restores can make it equal), saving at ``save_at``, killed by
    SIGKILL on every rank after step ``kill_at``."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    model, opt = sw.setup(net, ADAMW, strategy, accelerator="cpu", logger=logger)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    history = History()
    sw.register_for_checkpointing(sched, history)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g))
    loader = sw.prepare_dataloader(data, BATCH, model=model, seed=3)
    random.seed(10 + rank), np.random.seed(10 + rank), torch.manual_seed(10 + rank)
    step = 0
    if resume is not None:
        random.seed(99), np.random.seed(99), torch.manual_seed(99)
        step = sw.load(model, opt, resume)
    for epoch in range(loader.sampler.epoch, EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x = x + 0.1 * torch.from_numpy(np.random.randn(*x.shape)) + 0.1 * random.random()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            sw.log("loss", loss.detach())  # this rank's: the row holds the mean over the ranks
            history.losses.append(float(sw.all_reduce_mean(loss.detach(), model)))
            opt.step()
            opt.zero_grad()
            sched.step()
            step += 1
            if step in save_at:
                sw.save(model, opt, ckpt, step)
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    sw.end_training(model)
    state = model.state_dict()
    if rank == 0 and out is not None:
        torch.save({"losses": history.losses, "state": state, "lr": sched.get_last_lr()}, out)


def names_and_helpers(rank: int, tmp: str) -> None:
    """Accelerate's names taken with their meaning, and the rank-0 helpers."""
    model, _ = sw.setup(torch.nn.Linear(2, 2), ADAMW, "ddp", mixed_precision="bf16", split_batches=True,
                        even_batches=True, cpu=True)
    assert model.precision == "bf16-mixed" and model.topo.device.type == "cpu"
    assert sw.is_main_process() == (rank == 0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        sw.print("from", "rank", rank)
    assert printed.getvalue() == ("from rank 0\n" if rank == 0 else "")
    marker = os.path.join(tmp, "made-by-rank-0")
    with sw.main_process_first():
        if rank == 0:
            time.sleep(0.3)  # the others would see no file yet, were they not waiting
            open(marker, "w").close()
        else:
            assert os.path.exists(marker)


def job(rank: int, device: torch.device, scenarios: list) -> None:
    for name, kwargs in scenarios:
        print(f"scenario {name} (rank {rank})", flush=True)
        names_and_helpers(rank, **kwargs) if name == "names" else loop(rank, **kwargs)


def result(path: str) -> types.SimpleNamespace:
    got = torch.load(path)
    return types.SimpleNamespace(losses=got["losses"], state_dict=got["state"], lr=got["lr"])


def test_a_loop_killed_between_saves_resumes_as_the_uninterrupted_loop(tmp_path, tmp_path_factory):
    t = str(tmp_path)
    ddp_ck, fsdp_ck, db = f"{t}/ddp_ck", f"{t}/fsdp_ck", mlflow_db(tmp_path_factory, t)
    loggers = [sw.loggers.CSV(f"{t}/csv"), sw.loggers.MLflow(tracking_uri=db, experiment="loop")]
    with pytest.raises(Exception, match="died"):
        launch.spawn(job, 2, args=([
            ("reference ddp", dict(strategy="ddp", ckpt="", out=f"{t}/ref.pt", logger=loggers)),
            ("ddp killed at 5", dict(strategy="ddp", ckpt=ddp_ck, out=None, save_at=(3,), kill_at=5,
                                     logger=sw.loggers.CSV(f"{t}/resumed_csv")))],), accelerator="cpu")
    ddp_3 = f"{ddp_ck}/step_00000003"
    with pytest.raises(Exception, match="died"):
        launch.spawn(job, 2, args=([
            ("ddp <- ddp", dict(strategy="ddp", ckpt="", out=f"{t}/ddp_ddp.pt", resume=ddp_3,
                                logger=sw.loggers.CSV(f"{t}/resumed_csv"))),
            ("fsdp <- ddp, killed at 8", dict(strategy="fsdp", ckpt=fsdp_ck, out=None, resume=ddp_3, save_at=(7,),
                                              kill_at=8))],), accelerator="cpu")
    fsdp_7 = f"{fsdp_ck}/step_00000007"
    launch.spawn(job, 2, args=([
        ("fsdp <- fsdp", dict(strategy="fsdp", ckpt="", out=f"{t}/fsdp_fsdp.pt", resume=fsdp_7)),
        ("ddp <- fsdp", dict(strategy="ddp", ckpt="", out=f"{t}/fsdp_ddp.pt", resume=fsdp_7)),
        ("names", dict(tmp=t))],), accelerator="cpu")
    ref = result(f"{t}/ref.pt")
    assert len(ref.losses) == EPOCHS * SAMPLES // BATCH
    for name in ("ddp_ddp", "fsdp_fsdp", "fsdp_ddp"):
        run = result(f"{t}/{name}.pt")
        assert_same_run(ref, run)
        assert run.lr == pytest.approx(ref.lr, rel=1e-12)  # the schedule went on from the checkpoint's step
    # sw.log's "loss" of each step is the mean of the ranks' losses: the global loss.
    with open(f"{t}/csv/metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(len(ref.losses)))
    torch.testing.assert_close(torch.tensor([float(r["train/loss"]) for r in rows]), torch.tensor(ref.losses),
                               rtol=1e-12, atol=0)
    client = mlflow_client.MlflowClient(db)
    (run,) = client.search_runs([client.get_experiment_by_name("loop").experiment_id])
    points = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in points] == list(range(len(ref.losses))) and run.info.status == "FINISHED"
    torch.testing.assert_close(torch.tensor([m.value for m in points]), torch.tensor(ref.losses), rtol=1e-12, atol=0)
    # The killed loop's rows past its checkpoint were dropped by the resume, which wrote them again.
    with open(f"{t}/resumed_csv/metrics.csv", newline="") as f:
        resumed = [float(r["train/loss"]) for r in csv.DictReader(f)]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(ref.losses), rtol=1e-9, atol=0)


def test_accelerate_names_are_refused_with_ours():
    bare = torch.nn.Linear(2, 2)
    for given, message in [
        (dict(gradient_accumulation_steps=2), loop_names.GRADIENT_ACCUMULATION),
        (dict(split_batches=False), loop_names.SPLIT_BATCHES),
        (dict(even_batches=False), loop_names.EVEN_BATCHES),
        (dict(dispatch_batches=True), loop_names.DISPATCH_BATCHES),
        (dict(mixed_precision="fp8"), "mixed_precision='fp8' has no shardwise precision; use "
                                      "precision='bf16-mixed' (or 'bf16-true')"),
        (dict(mixed_precision="fp16", precision="bf16-mixed"),
         "sw.setup got both precision='bf16-mixed' and mixed_precision='fp16'; pass one "
         "(mixed_precision='fp16' is precision='16-mixed')"),
        (dict(mixed_precision="half"), "mixed_precision='half': Accelerate's values are 'no', 'bf16', 'fp16', "
                                       "'fp8' (shardwise's precision= takes '32', 'bf16-mixed', 'bf16-true' and "
                                       "'16-mixed')"),
        (dict(log_with="csv", logger="mlflow"), "sw.setup got both logger= and log_with=; pass one (log_with is "
                                                "logger=)"),
    ]:
        with pytest.raises(ValueError) as e:
            sw.setup(bare, ADAMW, **given)
        assert str(e.value) == message
    with pytest.raises(TypeError) as e:
        sw.setup(bare, ADAMW, project_dir="runs")
    assert str(e.value) == "setup() got an unexpected keyword argument 'project_dir'"
    assert loop_names.GRADIENT_ACCUMULATION == (
        "sw.setup takes no gradient_accumulation_steps: the loop accumulates itself. Cut each rank's batch into k "
        "micro-batches, run the first k-1 forwards and backwards under `with sw.no_sync(model):` and the last "
        "without it, then optimizer.step() once (or loss = model.train_step(x, y, loss_fn, accumulate=k))")


def test_a_state_dict_is_kept_as_tensors_and_json_or_refused():
    from shardwise.loop.state import decode, encode

    state = {"a": (1, 2.5), "b": {3: "x"}, "t": torch.arange(3), "n": None, "l": [True, float("inf")]}
    tensors: dict = {}
    text = json.dumps(encode(state, tensors, "loop.object0"))
    assert list(tensors) == ["loop.object0.t"]
    back = decode(json.loads(text), tensors)
    assert back["a"] == (1, 2.5) and back["b"] == {3: "x"} and torch.equal(back["t"], torch.arange(3))
    assert back["n"] is None and back["l"] == [True, float("inf")]
    with pytest.raises(TypeError) as e:
        encode({"f": len}, {}, "loop.object1")
    assert str(e.value) == ("sw.save: loop.object1.f is a builtin_function_or_method, which a checkpoint keeps only "
                            "by pickling; a state_dict() that sw.save keeps holds tensors, numbers, strings, None, "
                            "and lists, tuples and dicts of them")
