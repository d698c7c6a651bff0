"""Experiment loggers read back by their own tools: MLflow's client, TensorBoard's event reader,
the csv module and a W&B offline run directory.

One launch per layout writes to all four loggers at once. The logged loss must equal ``fit``'s losses, each
group's lr the schedule's lr of that step, the gradient norm the single-device run's norm before clipping (float64;
TensorBoard keeps float32 scalars), and the validation metrics ``result.val_metrics`` at their steps. A resumed run
logs into the MLflow run its checkpoint names: one run, continuous steps.
"""
from __future__ import annotations

import csv
import functools
import os
import shutil

import pytest
import torch
from conftest import mlflow_db
from torch.utils.data import Subset

import shardwise as sw
from shardwise import checkpoint
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.workloads import CharText, stdlib_text

mlflow_client = pytest.importorskip("mlflow.tracking")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
pytest.importorskip("wandb")

# MLflow 3.17's SQL store uses a loader strategy SQLAlchemy 2.1 deprecates (MLflow's to change, not ours).
pytestmark = [pytest.mark.timeout(300), pytest.mark.float64,
              pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")]

SEQ, BATCH, STEPS, CLIP = 8, 8, 3, 0.5
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
SCHEDULE = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)


def gpt() -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=128, block_size=SEQ, n_layer=1, n_head=2, n_embd=16))
    m.blocks[0].attn.k.bias.requires_grad_(False)  # its gradient is identically zero (tests/parallel/test_compose.py)
    return m


def groups(model: torch.nn.Module) -> list[dict]:
    """Two groups with their own lr: the embeddings at twice the rest."""
    emb = [p for n, p in model.named_parameters() if "emb" in n]
    return [{"params": emb, "lr": 2e-3}, {"params": [p for n, p in model.named_parameters() if "emb" not in n]}]


def fit(strategy: object, devices: int, logger: object, steps: int = STEPS, **kw: object) -> sw.FitResult:
    text = stdlib_text(6_000)
    kw.setdefault("log_every_n_steps", 1)
    hparams = kw.pop("hparams", None)
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, gradient_clip_val=CLIP, logger=logger,
                      **kw).fit(
        gpt(), CharText(text[:5_000], SEQ), lm_loss, ADAMW, batch_size=BATCH, max_steps=steps,
        lr_scheduler=SCHEDULE, param_groups=groups, val_dataset=Subset(CharText(text[5_000:], SEQ), range(12)),
        val_every=2, hparams=hparams)


def scheduled_lrs(steps: int) -> list[list[float]]:
    """Each group's lr at each step, from torch's own optimizer and schedule."""
    opt = ADAMW(groups(gpt()))
    sched, out = SCHEDULE(opt), []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def mlflow_history(ref: dict, name: str) -> tuple[list[int], list[float]]:
    points = mlflow_client.MlflowClient(ref["tracking_uri"]).get_metric_history(ref["run_id"], name)
    points = sorted(points, key=lambda m: m.step)
    return [m.step for m in points], [m.value for m in points]


def tensorboard_history(directory: str, name: str) -> tuple[list[int], list[float]]:
    acc = event_accumulator.EventAccumulator(directory)
    acc.Reload()
    events = acc.Scalars(name)
    return [e.step for e in events], [e.value for e in events]


def csv_history(path: str, name: str) -> tuple[list[int], list[float]]:
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r[name] != ""]
    return [int(r["step"]) for r in rows], [float(r[name]) for r in rows]


def check_logged(run: sw.FitResult, single: sw.FitResult, tmp: str) -> None:
    """Every logged series, read by each tool's reader, against the run's result and the single-device norms."""
    steps, lrs = list(range(STEPS)), scheduled_lrs(STEPS)
    norms = csv_history(single.loggers["csv"]["path"], "train/grad_norm")[1]
    val_steps = [m["step"] - 1 for m in run.val_metrics]  # the index of the step whose weights were evaluated
    readers = {"mlflow": (functools.partial(mlflow_history, run.loggers["mlflow"]), 0.0),
               "csv": (functools.partial(csv_history, run.loggers["csv"]["path"]), 0.0),
               "tensorboard": (functools.partial(tensorboard_history, run.loggers["tensorboard"]["dir"]), 1e-6)}
    for tool, (read, rel) in readers.items():
        assert read("train/loss") == (steps, pytest.approx(run.losses, rel=rel)), tool
        for g in range(2):
            assert read(f"train/lr/{g}") == (steps, pytest.approx([lr[g] for lr in lrs], rel=rel)), tool
        assert read("train/grad_norm") == (steps, pytest.approx(norms, rel=max(rel, 1e-9))), tool
        assert read("val/val_loss") == (val_steps, pytest.approx([m["val_loss"] for m in run.val_metrics],
                                                                 rel=rel)), tool
    wandb = run.loggers["wandb"]
    assert os.path.isfile(os.path.join(wandb["dir"], f"run-{wandb['run_id']}.wandb"))
    assert wandb["dir"].startswith(tmp)


LAYOUTS = {"ddp": ("ddp", 2), "fsdp": ("fsdp", 2), "dp2-tp2-zero3": (sw.Parallel(dp=2, tp=2, zero=3), 4)}


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    """One MLflow database for the module's runs (tests/conftest.py's mlflow_db)."""
    return mlflow_db(tmp_path_factory, tmp_path_factory.mktemp("mlflow"))


def test_every_logger_reads_back_with_its_own_tool(tmp_path, db):
    single = fit("single", 1, sw.loggers.CSV(tmp_path / "single"))
    assert single.loggers["csv"]["path"] == str(tmp_path / "single" / "metrics.csv")
    for name, (strategy, devices) in LAYOUTS.items():
        out = tmp_path / name
        loggers = [sw.loggers.MLflow(tracking_uri=db, experiment=name), sw.loggers.TensorBoard(out / "tb"),
                   sw.loggers.CSV(out / "csv"), sw.loggers.WandB(mode="offline", dir=out)]
        run = fit(strategy, devices, loggers)
        check_logged(run, single, str(out))
        params = mlflow_client.MlflowClient(db).get_run(run.loggers["mlflow"]["run_id"]).data.params
        assert {k: params[k] for k in ("batch_size", "max_steps", "seed", "optimizer/groups/0/lr",
                                       "optimizer/groups/1/lr")} == {
            "batch_size": str(BATCH), "max_steps": str(STEPS), "seed": "0", "optimizer/groups/0/lr": "0.002",
            "optimizer/groups/1/lr": "0.001"}, name
        assert params["processes"] == str(devices) and params["strategy"] == sw.resolve(strategy).name


def test_a_resumed_run_logs_into_the_same_mlflow_run(tmp_path, db):
    """Also: fit(hparams=) and the logger's tags reach the run, and log_checkpoints copies each checkpoint into
    its artifacts."""
    ck = dict(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2, hparams={"data": {"name": "stdlib"}})

    def mlflow() -> sw.loggers.MLflow:
        return sw.loggers.MLflow(tracking_uri=db, experiment="resumed", tags={"team": "a"}, log_checkpoints=True)
    first = fit("ddp", 2, mlflow(), steps=2, **ck)
    run = fit("ddp", 2, mlflow(), steps=4, **ck)  # from step 2
    ref = run.loggers["mlflow"]
    assert ref["run_id"] == first.loggers["mlflow"]["run_id"]
    client = mlflow_client.MlflowClient(db)
    runs = client.search_runs([client.get_experiment_by_name("resumed").experiment_id])
    assert [(r.info.run_id, r.info.status) for r in runs] == [(ref["run_id"], "FINISHED")]
    assert mlflow_history(ref, "train/loss") == ([0, 1, 2, 3], run.losses)
    data = client.get_run(ref["run_id"]).data
    assert data.params["data/name"] == "stdlib" and data.tags["team"] == "a"
    kept = [os.path.basename(p) for p in checkpoint.checkpoints(ck["checkpoint_dir"])]
    assert sorted(a.path for a in client.list_artifacts(ref["run_id"], "checkpoints")) == sorted(
        f"checkpoints/{name}" for name in kept)


def test_names_repeats_every_n_steps_and_a_resume_after_a_kill(tmp_path):
    """Names write under <checkpoint_dir>/logs, a second logger of a kind gets its own key, log_every_n_steps=2
    logs steps 1, 3 and the last; a run resumed from step 2 replaces the rows its killed attempt wrote past it.
    One process."""
    assert sw.Trainer("single", accelerator="cpu", logger=False).loggers == ()  # Lightning's spelling of none
    ck = tmp_path / "ck"
    trainer = sw.Trainer("single", accelerator="cpu", progress=False, checkpoint_dir=ck, checkpoint_every=2,
                         logger=["csv", sw.loggers.CSV(tmp_path / "two")], log_every_n_steps=2)

    def fit5() -> sw.FitResult:
        return trainer.fit(gpt(), CharText(stdlib_text(5_000), SEQ), lm_loss, ADAMW, batch_size=BATCH, max_steps=5)
    first = fit5()
    assert first.loggers == {"csv": {"path": str(ck / "logs" / "csv" / "metrics.csv")},
                             "csv.1": {"path": str(tmp_path / "two" / "metrics.csv")}}
    for ref in first.loggers.values():
        assert csv_history(ref["path"], "train/loss") == ([1, 3, 4], [first.losses[i] for i in (1, 3, 4)])
    for later in checkpoint.checkpoints(str(ck))[1:]:  # as if killed after step 4, its checkpoint unfinished
        shutil.rmtree(later)
    with open(first.loggers["csv"]["path"], "a") as f:
        f.write("3,9.0\n")  # and a row a killed attempt wrote after its last checkpoint
    again = fit5()
    assert again.loggers == first.loggers
    for ref in again.loggers.values():
        assert csv_history(ref["path"], "train/loss") == ([1, 3, 4], [again.losses[i] for i in (1, 3, 4)])


@pytest.mark.parametrize(("kw", "error"), [
    (dict(logger="neptune"), "unknown logger 'neptune'; valid names: csv, tensorboard, mlflow, wandb (or a logger "
                             "object)"),
    (dict(logger=sw.loggers.CSV), "logger holds the class CSV, not an instance: pass CSV(...)"),
    (dict(logger=[object()]), "lacks log_hyperparams, log_metrics, finalize: a logger has the methods "),
    (dict(log_every_n_steps=0), "log_every_n_steps must be a positive integer, got 0"),
])
def test_a_wrong_logger_option_is_refused_by_the_trainer(kw, error):
    with pytest.raises((ValueError, TypeError)) as e:
        sw.Trainer("single", accelerator="cpu", **kw)
    assert error in str(e.value)
