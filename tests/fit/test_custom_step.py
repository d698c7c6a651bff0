"""fit(training_step=), and trainer.predict / validate / test after training, under every strategy.

Each layout is ONE 2-rank job (the session's worker pool) that trains Hugging Face Mixtral (4 experts, top-2)
with a training_step returning cross-entropy plus a weighted router z-loss (ST-MoE, Zoph et al. 2022: the
mean over tokens of logsumexp(router logits)^2, an auxiliary term of the MoE's own routers), then predicts a
set whose last batch is partial, and must equal the single-device run and predictions (float64), and
validates with a torchmetrics macro F1 over tokens, which must equal the same metric on one device (its
states synced over the ranks that hold other samples or tokens, not over tp or pp peers). The data-parallel
jobs also validate a classifier with torchmetrics' F1, which must equal scikit-learn's F1 of the
single-device predictions, and test a checkpoint written under ddp from an fsdp layout.
"""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from sklearn.metrics import f1_score
from tiny_hf import mixtral
from torch import nn
from torchmetrics.classification import MulticlassF1Score

import shardwise as sw
from shardwise import launch
from shardwise.models import lm_loss
from shardwise.step import TrainingStep
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(600), pytest.mark.float64]

SEQ, BATCH, STEPS, ACC = 8, 4, 2, 2
PREDICT_BATCH = 4  # over 5 sequences: batches of 4 and 1 (under dp=2 the second rank has none of the last)
CLASSES, FEATURES = 3, 5


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    x, y = batch
    out = model(x, output_router_logits=True)
    ce = lm_loss(out.logits, y)
    z = torch.stack([torch.logsumexp(r, dim=-1).pow(2).mean() for r in out.router_logits]).mean()
    return {"loss": ce + 0.01 * z, "z_loss": z}


def text() -> CharText:
    return CharText(stdlib_text(4_000), SEQ)


class Held(torch.utils.data.Dataset):
    """The first ``n`` sequences of the text, in order (predict's set)."""

    def __init__(self, n: int) -> None:
        self.data, self.n = text(), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.data[i]


class Points(torch.utils.data.Dataset):
    """21 labelled points for a 3-class classifier (21 = 2 x 8 + 5: the last batch of 8 is partial)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(21, FEATURES, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, CLASSES, (21,), generator=g)

    def __len__(self) -> int:
        return 21

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class TokenF1(MulticlassF1Score):
    """Macro F1 of next-token predictions: a metric that is not a mean, over (B, S, V) logits."""

    def __init__(self) -> None:
        super().__init__(num_classes=128, average="macro")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(preds.argmax(-1), target)


def targets(n: int) -> torch.Tensor:
    return torch.stack([Held(n)[i][1] for i in range(n)])


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


ADAM = functools.partial(torch.optim.AdamW, lr=1e-3)
LAYOUTS = {
    "ddp": (lambda: "ddp", lambda: sw.Parallel(pp=2)),  # predict under pp on an untrained model
    "zero3": (lambda: "zero3", lambda: "fsdp"),
    "tp": (lambda: "tp", lambda: "tp"),
    "cp2": (lambda: sw.Parallel(cp=2), lambda: sw.Parallel(cp=2)),
    "ep2": (lambda: sw.Parallel(ep=2), lambda: sw.Parallel(ep=2)),
}


def train(strategy: object, devices: int, **kw: object) -> tuple[sw.FitResult, nn.Module]:
    model = mixtral()
    trainer = sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=ACC,
                         log_every_n_steps=1, **kw)
    return trainer.fit(model, text(), optimizer=ADAM, batch_size=BATCH, max_steps=STEPS, training_step=step), model


def _job(rank: int, device: torch.device, name: str, out: str) -> None:
    """One layout's whole check, in its ranks: train with training_step, predict, and (ddp, zero3) evaluate."""
    make_train, make_predict = LAYOUTS[name]
    got: dict[str, object] = {}
    log = os.path.join(out, "steps.jsonl")
    result, model = train(make_train(), 2, metrics_path=log if name == "ddp" else None)
    got["losses"], got["state_dict"] = result.losses, result.state_dict
    predictor = sw.Trainer(make_predict(), 2, accelerator="cpu", progress=False)
    predicted = mixtral() if name == "ddp" else model
    got["predict"] = predictor.predict(predicted, Held(5), batch_size=PREDICT_BATCH)
    # synced over the ranks holding other samples or tokens (dp x cp), never over tp or pp peers (same samples)
    got["token_f1"] = predictor.validate(predicted, Held(5), metrics={"f1": TokenF1()}, batch_size=PREDICT_BATCH)["f1"]
    if name in ("ddp", "zero3"):
        f1 = {"f1": MulticlassF1Score(num_classes=CLASSES, average="macro")}
        evaluator = sw.Trainer("ddp" if name == "ddp" else "fsdp", 2, accelerator="cpu", progress=False)
        got["validate"] = evaluator.validate(classifier(), Points(), ce, f1, batch_size=8)
    if name == "ddp":
        ckpts = os.path.join(out, "ckpt")
        net = classifier()
        fitted = sw.Trainer("ddp", 2, accelerator="cpu", progress=False, checkpoint_dir=ckpts).fit(
            net, Points(), ce, ADAM, batch_size=8, max_steps=2, val_dataset=Points(), val_batch_size=8,
            val_metrics={"f1": MulticlassF1Score(num_classes=CLASSES, average="macro")})
        got["fit_val"], got["fit_state"] = fitted.val_metrics[-1], fitted.state_dict
        f1 = {"f1": MulticlassF1Score(num_classes=CLASSES, average="macro")}
        got["test_trained"] = sw.Trainer("ddp", 2, accelerator="cpu", progress=False).test(
            net, Points(), ce, f1, batch_size=8)
        got["test_ckpt"] = sw.Trainer("fsdp", 2, accelerator="cpu", progress=False).test(
            classifier(), Points(), ce, f1, batch_size=8, ckpt_path=ckpts)
    if rank == 0:
        if name == "ddp":
            with open(log) as f:
                got["logged"] = [json.loads(line)["z_loss"] for line in f]
        torch.save(got, os.path.join(out, "got.pt"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("reference") / "steps.jsonl")
    result, model = train("single", 1, metrics_path=log)
    trainer = sw.Trainer("single", 1, accelerator="cpu", progress=False)
    logits = classifier()(Points().x).detach()
    with open(log) as f:
        logged = [json.loads(line)["z_loss"] for line in f]
    predict = trainer.predict(model, Held(5), batch_size=PREDICT_BATCH)
    untrained = trainer.predict(mixtral(), Held(5), batch_size=PREDICT_BATCH)
    f1 = {}
    for key, out in (("trained", predict), ("untrained", untrained)):
        metric = TokenF1()
        metric.update(out, targets(5))
        f1[key] = float(metric.compute())
    return {"result": result, "logged": logged, "predict": predict, "predict_untrained": untrained, "token_f1": f1,
            "f1": f1_score(Points().y.numpy(), logits.argmax(-1).numpy(), average="macro"),
            "ce": float(ce(logits, Points().y).detach())}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_step_and_predict_equal_one_device(name, reference, tmp_path, same_run):
    launch.spawn(_job, 2, args=(name, str(tmp_path)))
    got = torch.load(tmp_path / "got.pt", weights_only=False)
    same_run(reference["result"], sw.FitResult(losses=got["losses"], state_dict=got["state_dict"]))
    want = reference["predict_untrained" if name == "ddp" else "predict"]
    assert got["predict"].shape == (5, SEQ, 128)
    torch.testing.assert_close(got["predict"], want, rtol=1e-9, atol=1e-12)
    assert got["token_f1"] == pytest.approx(reference["token_f1"]["untrained" if name == "ddp" else "trained"],
                                            rel=1e-12)
    if "validate" in got:  # torchmetrics' F1, synced over the data-parallel ranks, is scikit-learn's on the whole set
        assert got["validate"]["f1"] == pytest.approx(reference["f1"], rel=1e-12)
        assert got["validate"]["val_loss"] == pytest.approx(reference["ce"], rel=1e-9)
    if name == "ddp":
        assert got["test_ckpt"] == pytest.approx(got["test_trained"], rel=1e-9)
        assert set(got["test_ckpt"]) == {"test_loss", "f1"}
        # fit's validation: the metric object over the whole set, computed once, as validate does (and sklearn)
        net = classifier()
        net.load_state_dict(got["fit_state"])
        predicted = net(Points().x).argmax(-1).numpy()
        assert got["fit_val"]["f1"] == pytest.approx(got["test_trained"]["f1"], rel=1e-12)
        assert got["fit_val"]["f1"] == pytest.approx(f1_score(Points().y.numpy(), predicted, average="macro"),
                                                     rel=1e-12)
        # the training_step's other scalar, logged as its mean over the data-parallel ranks: one device's value
        assert got["logged"] == pytest.approx(reference["logged"], rel=1e-9)


def test_training_step_under_a_pipeline_is_refused(no_spawn):
    with pytest.raises(ValueError) as e:
        sw.Trainer(sw.Parallel(pp=2), 2, accelerator="cpu", progress=False).fit(
            mixtral(), text(), optimizer=ADAM, batch_size=BATCH, max_steps=1, training_step=step)
    assert str(e.value) == (
        "training_step is not supported by strategy 'parallel' with pp=2: the model is cut into stages that run "
        "one after another, so no call of the model runs the whole of it, and the loss is computed on the last "
        "stage from that stage's output alone; pass loss_fn(output, target) instead (with dict samples it gets "
        "the whole batch as target), or use a layout without pipeline stages (pp=1) for training_step")


def test_what_is_refused_says_what_to_do_instead(no_spawn):
    trainer = sw.Trainer("ddp", 2, accelerator="cpu", progress=False)
    with pytest.raises(TypeError, match=r"^fit\(\) needs the loss: loss_fn\(output, target\), or training_step"):
        trainer.fit(classifier(), Points(), optimizer=ADAM, batch_size=8, max_steps=1)
    with pytest.raises(ValueError, match="^val_dataset with training_step needs loss_fn too"):
        trainer.fit(classifier(), Points(), optimizer=ADAM, batch_size=8, max_steps=1, val_dataset=Points(),
                    training_step=step)
    with pytest.raises(ValueError, match=r"^validate computes loss_fn and metrics; pass loss_fn= or metrics="):
        trainer.validate(classifier(), Points(), batch_size=8)
    with pytest.raises(TypeError) as e:  # what a rank raises when the step returns a dict without its loss
        TrainingStep(lambda model, batch: {"ce": torch.ones(())})(classifier(), None)
    assert str(e.value) == ("training_step must return the loss tensor or a dict with a 'loss' tensor (and other "
                            "scalars to log), got dict with keys ['ce']")
