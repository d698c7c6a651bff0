"""Our DDP: equal to single-device training, equal to torch DDP, exact bytes, clear errors."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from conftest import assert_beside_torch, train_beside_torch
from torch import nn
from torch.nn import functional as F

import shardwise as sw
from shardwise import launch
from shardwise.comm.topology import Topology
from shardwise.parallel.dp.ddp import DDPModule
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(180), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def fit(strategy, devices, steps=8, accumulate=1, clip=None, work=None):
    work = work or digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=accumulate,
                      gradient_clip_val=clip).fit(work.make_model(), work.train, work.loss_fn, ADAMW,
                                                  batch_size=64, max_steps=steps)


@pytest.fixture(scope="module")
def reference():
    return {acc: fit("single", 1, accumulate=acc) for acc in (1, 2)}


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_ddp_equals_single(reference, same_run, devices, accumulate):
    run = fit("ddp", devices, accumulate=accumulate)
    same_run(reference[1], run)  # accumulation does not change the optimisation either
    same_run(reference[accumulate], run)


def test_ddp_with_clipping_equals_single(same_run):
    same_run(fit("single", 1, clip=0.05), fit("ddp", 2, clip=0.05))


@pytest.mark.parametrize("devices", [2, 4])
def test_bytes_sent_equal_ring_formula(devices):
    run = fit("ddp", devices, steps=3)
    model = digits().make_model()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in run.stats:
        assert s["comm_bytes_per_step"] == 2 * (devices - 1) * grad_bytes // devices
        # Exact model-state accounting: params, grads (the buckets) and two Adam states per parameter.
        assert s["params_bytes"] == grad_bytes
        assert s["grads_bytes"] == grad_bytes
        assert s["optimizer_bytes"] == 2 * grad_bytes
        assert s["model_state_bytes"] == 4 * grad_bytes


def test_no_sync_accumulation_sends_nothing_extra():
    one = fit("ddp", 2, steps=2, accumulate=1)
    four = fit("ddp", 2, steps=2, accumulate=4)
    assert [s["comm_bytes_per_step"] for s in four.stats] == [s["comm_bytes_per_step"] for s in one.stats]


# ---- against torch's DDP -------------------------------------------------
def _ours_vs_torch(rank, device, steps, path):
    topo = Topology.create(device)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    mine = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    theirs = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    mine.load_state_dict(base.state_dict())
    theirs.load_state_dict(base.state_dict())
    ours = DDPModule(mine, topo.comm("dp"), bucket_cap_mb=0.001)  # several buckets
    torch_ddp = nn.parallel.DistributedDataParallel(theirs, process_group=topo.group("dp"))
    train_beside_torch(rank, steps, 4, path, (ours, ADAMW(mine.parameters()), mine),
                       (torch_ddp, ADAMW(theirs.parameters()), theirs))


def test_weights_equal_torch_ddp(tmp_path):
    path = str(tmp_path / "w.pt")
    launch.spawn(_ours_vs_torch, 2, args=(5, path))
    assert_beside_torch(path)


# ---- errors ----------------------------------------------------------------
def _mismatched(rank, device):
    topo = Topology.create(device)
    width = 32 if rank == 0 else 33
    DDPModule(nn.Sequential(nn.Linear(8, width), nn.Linear(width, 2)), topo.comm("dp"))


@pytest.mark.float32  # the message names the dtype
def test_mismatched_model_is_a_clear_error():
    with pytest.raises(Exception) as e:
        launch.spawn(_mismatched, 2)
    msg = str(e.value)
    assert ("model parameters differ across ranks: parameter #0 is '0.weight' with shape [32, 8] "
            "(torch.float32) on rank 0 but '0.weight' with shape [33, 8] (torch.float32) on rank 1") in msg


class TwoHeads(nn.Module):
    """Uses head ``b`` only when asked: a parameter with no gradient in some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 32)
        self.a = nn.Linear(32, 10)
        self.b = nn.Linear(32, 10)
        self.use_b = False

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.a(h) + (self.b(h) if self.use_b else 0)


def test_unused_parameters_reported_clearly():
    work = digits()
    with pytest.raises(Exception) as e:
        sw.Trainer("ddp", 2, accelerator="cpu", progress=False).fit(
            TwoHeads(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=1)
    assert "DDP: these parameters received no gradient in this step" in str(e.value)
    assert "'b.weight'" in str(e.value) and "find_unused_parameters=True" in str(e.value)


def test_unused_parameters_allowed_equal_single(same_run):
    work = digits()
    torch.manual_seed(0)
    model = TwoHeads()
    runs = [sw.Trainer(s, n, accelerator="cpu", progress=False).fit(
        __import__("copy").deepcopy(model), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=4)
        for s, n in (("single", 1), (sw.DDP(find_unused_parameters=True), 2))]
    same_run(*runs)
    assert torch.equal(runs[1].state_dict["b.weight"], model.b.weight.detach())  # untouched, like single


def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown strategy 'dpp'; valid strategies: single, ddp"):
        sw.Trainer("dpp", 2)


def test_batch_not_divisible_is_clear():
    work = digits()
    with pytest.raises(ValueError) as e:
        sw.Trainer("ddp", 4, accelerator="cpu").fit(work.make_model(), work.train, work.loss_fn, ADAMW,
                                                     batch_size=30, max_steps=1)
    assert str(e.value) == ("batch_size=30 is not divisible by data-parallel size 4 x accumulate_grad_batches 1 = 4; "
                            "the global batch must split evenly (try batch_size=28)")


# ---- setup() in a hand-written loop -----------------------------------------
def _hand_loop(rank, device, path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))
    wrapped, opt = sw.setup(model, ADAMW, strategy="ddp", accelerator="cpu")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 2, (8,), generator=g)
    for _ in range(3):
        F.cross_entropy(wrapped(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        torch.save(model.state_dict(), path)


def test_setup_hand_written_loop_equals_single(tmp_path):
    path = str(tmp_path / "m.pt")
    launch.spawn(_hand_loop, 2, args=(path,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = ADAMW(model.parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 2, (8,), generator=g)
    for _ in range(3):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for k, v in torch.load(path).items():
        torch.testing.assert_close(v, model.state_dict()[k], rtol=1e-5, atol=1e-6)
    assert not dist.is_initialized()
