"""What a new user meets first: one semantics of fit, devices="auto", the
errors of the spawned launch, and a resume that says what it does."""
from __future__ import annotations

import functools
import json
import re
import warnings

import pytest
import torch
from conftest import section

import shardwise as sw
from shardwise.workloads import digits

pytestmark = pytest.mark.timeout(200)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def train(trainer, model=None, steps=3):
    work = digits()
    model = model if model is not None else work.make_model()
    return model, trainer.fit(model, work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=steps)


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("ddp", 2), ("zero3", 2)])
def test_the_model_passed_in_ends_trained(strategy, devices):
    model = digits().make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, result = train(sw.Trainer(strategy, devices, accelerator="cpu", progress=False), model)
    after = model.state_dict()
    assert set(after) == set(result.state_dict)
    for k, v in after.items():
        assert torch.equal(v, result.state_dict[k]), k
    assert any(not torch.equal(before[k], after[k]) for k in before)




@pytest.mark.fresh_processes
def test_under_shardwise_run_devices_default_to_the_world_the_model_ends_trained_and_fit_runs_twice(under_run):
    # tests/scripts/fit_auto.py, in the session's shared `shardwise run --nproc 2` (tests/conftest.py).
    r, _ = under_run
    section(r, "tests/scripts/fit_auto.py")
    lines = sorted(re.findall(r"rank \S+ \w+ devices=\d+ trained=\w+", r.stdout))  # two ranks share stdout
    # The trainer leaves the group it created, so the rank is read before teardown would hide it: "x" here.
    assert lines == ["rank x ddp devices=2 trained=True"] * 2 + ["rank x zero3 devices=2 trained=True"] * 2, r.stdout


def test_devices_auto_takes_the_size_a_fixed_layout_needs():
    assert sw.Trainer(sw.Parallel(dp=2, tp=2), accelerator="cpu").devices == 4
    assert sw.Trainer(sw.Parallel(tp=2, pp=2), accelerator="cpu").devices == 4
    assert sw.Trainer("single", accelerator="cpu").devices == 1


def test_a_distributed_strategy_on_one_device_warns():
    with pytest.warns(UserWarning) as caught:
        sw.Trainer("ddp", accelerator="cpu")
    assert [str(w.message) for w in caught] == [
        "strategy 'ddp' with devices=1 runs one process on one device: nothing is split or communicated; pass "
        "devices=N (devices='auto' takes the world size under `shardwise run`, or every GPU)"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sw.Trainer("single", accelerator="cpu")
        sw.Trainer("ddp", 2, accelerator="cpu")


@pytest.mark.parametrize("bad", ["loss_fn", "optimizer"])
def test_a_lambda_is_named_before_any_process_starts(bad, no_spawn):
    work = digits()
    loss_fn = (lambda out, y: work.loss_fn(out, y)) if bad == "loss_fn" else work.loss_fn
    opt = (lambda params: torch.optim.AdamW(params, lr=1e-3)) if bad == "optimizer" else ADAMW
    with pytest.raises(TypeError, match=rf"^fit's {bad} cannot be sent to the rank processes \(.*\): each rank is a "
                                        r"fresh process that receives it pickled, so it must be defined at the top "
                                        r"level of a module \(a `def`, a class, or functools.partial of one\), not "
                                        r"a lambda"):
        sw.Trainer("ddp", 2, accelerator="cpu", progress=False).fit(
            work.make_model(), work.train, loss_fn, opt, batch_size=64, max_steps=2)


def test_resume_says_what_it_does_and_keeps_the_metrics(tmp_path, capfd):
    ck, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"

    def run(steps):
        t = sw.Trainer("single", accelerator="cpu", progress=False, checkpoint_dir=ck, checkpoint_every=2,
                       metrics_path=metrics, log_every_n_steps=1)
        result = train(t, steps=steps)[1]
        return result, capfd.readouterr().err

    first, err = run(4)
    assert "shardwise: no checkpoint to resume from: training steps 0 to 4\n" in err
    rows = metrics.read_text()
    assert [json.loads(line)["step"] for line in rows.splitlines()] == [0, 1, 2, 3]

    again, err = run(4)  # the finished script run again: nothing trains, and it says so
    assert f"shardwise: already complete: {ck}/step_00000004 is at step 4 of max_steps=4, 0 steps to run\n" in err
    assert again.losses == first.losses
    assert all(torch.equal(again.state_dict[k], v) for k, v in first.state_dict.items())
    assert metrics.read_text() == rows

    longer, err = run(6)
    assert f"shardwise: resuming from step 4 of {ck}/step_00000004: 2 steps to run\n" in err
    assert longer.losses[:4] == first.losses and len(longer.losses) == 6
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2, 3, 4, 5]
