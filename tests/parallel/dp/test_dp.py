"""Single-process data parallel: equal to single-device training; scatter/replicate/gather behave."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardwise as sw
from shardwise.parallel.dp.threaded import DataParallelModule, gather, replicate, scatter
from shardwise.strategies.dp.threaded import DP
from shardwise.workloads import digits, gpt

pytestmark = [pytest.mark.timeout(180), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CPU = torch.device("cpu")


def fit(strategy, devices, work=None, steps=6, **kw):
    work = work or digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, **kw).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=48, max_steps=steps)


@pytest.mark.parametrize("devices", [2, 3])
def test_dp_equals_single(same_run, devices):
    same_run(fit("single", 1), fit("dp", devices))


def test_dp_with_accumulation_and_clipping_equals_single(same_run):
    same_run(fit("single", 1, gradient_clip_val=0.05),
             fit(DP(), 4, accumulate_grad_batches=2, gradient_clip_val=0.05))


def test_dp_on_tiny_gpt_equals_single(same_run):
    work = gpt(n_layer=1, n_embd=32, n_head=2, block=16, max_chars=20_000)
    same_run(fit("single", 1, work=work, steps=3), fit("dp", 2, work=work, steps=3))


def test_one_process_whatever_the_device_count():
    s = DP()
    assert s.processes(8) == 1
    assert s.sizes(8) == {"dp": 1, "tp": 1, "pp": 1}
    assert s.device_list(CPU) == [CPU] * 8
    assert DP(device_ids=["cpu", "cpu"]).device_list(CPU) == [CPU, CPU]
    with pytest.raises(ValueError, match="devices=3 but device_ids names 2 devices"):
        DP(device_ids=["cpu", "cpu"]).sizes(3)


def test_gradients_are_summed_on_the_primary_device():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(10, 5), torch.randn(10, 3)
    F.mse_loss(ref(x), y).backward()
    dp = DataParallelModule(model, [CPU] * 3)
    out = dp(x)
    assert out.shape == (10, 3)
    F.mse_loss(out, y).backward()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=n)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.again = self.inner  # the same module twice
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.bn(self.again(torch.relu(self.inner(x))))
        return {"out": h, "norm": h.pow(2).mean()}


def test_replicas_keep_ties_and_replica_zero_updates_buffers():
    torch.manual_seed(0)
    m = Tied()
    reps = replicate(m, [CPU, CPU])
    for r in reps:
        assert r.inner is r.again and r.inner.weight is not m.inner.weight
        assert not isinstance(r.inner.weight, nn.Parameter) and r.inner.weight.requires_grad
    assert reps[0].bn.running_mean is m.bn.running_mean  # first replica: the original buffers
    assert reps[1].bn.running_mean is not m.bn.running_mean
    before = m.bn.running_mean.clone()
    out = DataParallelModule(m, [CPU, CPU])(torch.randn(6, 4))
    assert out["out"].shape == (6, 4) and out["norm"].shape == (2,)  # scalars are stacked
    assert not torch.equal(m.bn.running_mean, before)
    out["norm"].sum().backward()
    assert m.inner.weight.grad is not None and len(list(m.parameters())) == 4


def test_scatter_and_gather():
    x = torch.arange(10).view(5, 2)
    parts = scatter((x, {"mask": x > 3}, "tag"), [CPU] * 3)
    assert [p[0].shape[0] for p in parts] == [2, 2, 1]
    assert [p[2] for p in parts] == ["tag"] * 3
    assert torch.equal(gather([p[0] for p in parts], CPU), x)
    # Fewer rows than devices: only as many replicas as rows.
    assert len(scatter(torch.ones(2, 3), [CPU] * 4)) == 2
    out = DataParallelModule(nn.Linear(3, 1), [CPU] * 4)(torch.ones(2, 3))
    assert out.shape == (2, 1)


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] > 0:
            raise ValueError("boom")
        return self.lin(x)


def test_error_in_a_replica_names_it():
    x = torch.tensor([[-1.0, 0.0], [1.0, 0.0]])
    with pytest.raises(RuntimeError, match=r"DP replica 1 on cpu failed: ValueError: boom"):
        DataParallelModule(Fails(), [CPU, CPU])(x)


def test_grad_mode_reaches_the_threads():
    m = DataParallelModule(nn.Linear(2, 2), [CPU, CPU])
    with torch.no_grad():
        assert not m(torch.ones(4, 2)).requires_grad
    assert m(torch.ones(4, 2)).requires_grad
