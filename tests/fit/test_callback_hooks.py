"""Callbacks that see a whole run: fit start, step start, before the optimizer step with the
global gradient, the exception that ends a run, and state kept in checkpoints."""
from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise import checkpoint

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64]
SGD = functools.partial(torch.optim.SGD, lr=0.1)
STEPS = 3


def samples() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


class Recorder(sw.Callback):
    """Every hook in order, and the squared norm of the global gradient before each optimizer step (each rank's
    part of it, summed over the ranks whose parts are disjoint): written by rank 0 at the end."""

    def __init__(self, out: str, sharded: bool) -> None:
        self.out, self.sharded, self.seen, self.norms = out, sharded, [], []

    def on_fit_start(self, info) -> None:  # noqa: D102
        self.seen.append(f"fit_start {info.step}")

    def on_step_start(self, info) -> None:  # noqa: D102
        self.seen.append(f"step_start {info.step}")

    def on_before_optimizer_step(self, info) -> None:  # noqa: D102
        self.seen.append(f"before_optimizer_step {info.step}")
        grads = [p.grad for g in info.optimizer.param_groups for p in g["params"] if p.grad is not None]
        sq = torch.stack([g.double().pow(2).sum() for g in grads]).sum()
        if self.sharded:
            dist.all_reduce(sq)
        self.norms.append(float(sq))

    def on_step_end(self, info) -> None:  # noqa: D102
        self.seen.append(f"step_end {info.step}")

    def on_fit_end(self, info) -> None:  # noqa: D102
        self.seen.append(f"fit_end {info.step}")
        if info.rank == 0:
            with open(self.out, "w") as f:
                json.dump({"seen": self.seen, "norms": self.norms}, f)


def run(strategy: str, devices: int, callbacks: list, **kw) -> sw.FitResult:
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, callbacks=callbacks, **kw).fit(
        model(), samples(), nn.functional.cross_entropy, SGD, batch_size=16, max_steps=STEPS)


def test_hooks_come_in_order_and_see_the_global_gradient_before_the_step(tmp_path):
    records = {}
    for strategy, devices, sharded in [("single", 1, False), ("zero2", 2, True), ("ddp", 2, False)]:
        out = str(tmp_path / f"{strategy}.json")
        run(strategy, devices, [Recorder(out, sharded)])
        with open(out) as f:
            records[strategy] = json.load(f)
    want = ["fit_start 0"] + [x for s in range(STEPS) for x in (f"step_start {s}", f"before_optimizer_step {s}",
                                                                 f"step_end {s + 1}")] + [f"fit_end {STEPS}"]
    assert all(r["seen"] == want for r in records.values())
    for strategy in ("zero2", "ddp"):  # zero2: disjoint shards summed; ddp: the averaged gradient on each rank
        assert records[strategy]["norms"] == pytest.approx(records["single"]["norms"], rel=1e-9)


class Fails(sw.Callback):
    def __init__(self) -> None:
        self.caught: BaseException | None = None

    def on_step_end(self, info) -> None:  # noqa: D102
        if info.step == 2:
            raise RuntimeError("broken after step 2")

    def on_exception(self, info) -> None:  # noqa: D102
        self.caught = info.exception


def test_on_exception_sees_what_ended_the_run():
    cb = Fails()
    with pytest.raises(RuntimeError, match="broken after step 2"):
        run("single", 1, [cb])
    assert isinstance(cb.caught, RuntimeError) and str(cb.caught) == "broken after step 2"


class FailsToo(sw.Callback):
    """An on_exception with a bug of its own."""

    def on_exception(self, info) -> None:  # noqa: D102
        raise KeyError("no such run")


class Notes(sw.Callback):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_exception(self, info) -> None:  # noqa: D102
        self.seen.append(str(info.exception))


def test_a_failing_on_exception_never_hides_the_runs_error():
    later = Notes()
    with pytest.raises(RuntimeError) as e:
        run("single", 1, [Fails(), FailsToo(), later])
    assert str(e.value) == "broken after step 2"  # the run's error, not the callback's
    assert e.value.__notes__ == ["callback FailsToo's on_exception(info) failed while handling this error: "
                                 "KeyError: 'no such run'"]
    assert later.seen == ["broken after step 2"]  # the callbacks after it were still told


class Counter(sw.Callback):
    """Counts the steps it saw, across restarts: its count is kept in every checkpoint."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.count, self.crash_at = 0, crash_at

    def on_step_end(self, info) -> None:  # noqa: D102
        self.count += 1
        if info.step == self.crash_at:
            raise RuntimeError("crashed")

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def test_a_callbacks_state_is_kept_in_checkpoints_and_restored_on_resume(tmp_path):
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(RuntimeError, match="crashed"):
        run("single", 1, [Counter(crash_at=STEPS)], **ck)
    manifest = checkpoint.read_manifest(checkpoint.latest_valid(str(tmp_path)))
    assert manifest["callbacks"] == {"0": {"class": "Counter", "state": {"count": 2}}}
    resumed = Counter()
    run("single", 1, [resumed], **ck)
    assert resumed.count == STEPS  # 2 restored, then the one step the resumed run took


class Unsaveable(sw.Callback):
    def on_step_end(self, info) -> None:  # noqa: D102
        pass

    def state_dict(self) -> dict:
        return {"when": object()}


def test_a_state_that_is_not_json_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match=r"^callback Unsaveable's state_dict\(\) must hold JSON values \(numbers, "
                                        r"strings, lists, dicts\), to be kept in a checkpoint's manifest: "):
        run("single", 1, [Unsaveable()], checkpoint_dir=str(tmp_path), checkpoint_every=2)
