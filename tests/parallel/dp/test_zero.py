"""ZeRO-1 and ZeRO-2: equal to single-device training, exact bytes, the real torch optimizer, DCP round trip."""
from __future__ import annotations

import functools

import pytest
import torch
from conftest import assert_beside_torch, train_beside_torch
from torch import nn
from torch.nn import functional as F

import shardwise as sw
from shardwise import launch
from shardwise.comm.topology import Topology
from shardwise.parallel.dp.sharding import chunk_numel, local_numel
from shardwise.parallel.dp.zero import ShardedOptimizer
from shardwise.strategies.dp.zero import ZeRO1, ZeRO2
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(240), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def fit(strategy, devices, steps=6, accumulate=1, clip=None, optimizer=ADAMW):
    work = digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=accumulate,
                      gradient_clip_val=clip).fit(work.make_model(), work.train, work.loss_fn, optimizer,
                                                  batch_size=64, max_steps=steps)


def numels():
    return [p.numel() for p in digits().make_model().parameters()]


@pytest.fixture(scope="module")
def reference():
    return fit("single", 1)


@pytest.mark.parametrize("strategy,devices,accumulate", [("zero1", 2, 1), ("zero1", 4, 2),
                                                         ("zero2", 2, 2), ("zero2", 4, 1)])
def test_equals_single(reference, same_run, strategy, devices, accumulate):
    same_run(reference, fit(strategy, devices, accumulate=accumulate))


@pytest.mark.parametrize("strategy,devices", [("zero1", 2), ("zero2", 4)])
def test_clipping_and_accumulation_equal_single(same_run, strategy, devices):
    # 0.05 is far below the gradient norm, so every step is clipped.
    same_run(fit("single", 1, clip=0.05), fit(strategy, devices, clip=0.05, accumulate=2))


def test_sgd_with_momentum_equals_single(same_run):
    sgd = functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9)
    same_run(fit("single", 1, optimizer=sgd), fit("zero2", 2, optimizer=sgd))


@pytest.mark.float32  # the claim is fp32 bytes
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_bytes_equal_formulas(strategy, devices):
    """P params, G grads, Adam 2 states, per rank; shards are ceil(numel/N) elements (fp32: 4 bytes each).

    ZeRO-1: P + G + 2P/N.  ZeRO-2: P + G/N + 2P/N.  Sent per step: 2(N-1)/N x G (the
    ZeRO paper's 2 Psi: reduce-scatter + all-gather), with G/N read as the padded shard.
    """
    run = fit(strategy, devices, steps=2)
    sizes = numels()
    full = 4 * sum(sizes)
    shard = 4 * sum(chunk_numel(n, devices) for n in sizes)  # equals full / N when every numel divides by N
    for r, s in enumerate(run.stats):
        # A piece cut short by a parameter's end (bias of 10 on 4 ranks: 3,3,3,1) is a small padded copy.
        copies = 4 * sum(chunk_numel(n, devices) for n in sizes
                         if local_numel(n, devices, r) < chunk_numel(n, devices))
        assert s["params_bytes"] == full + copies
        assert s["grads_bytes"] == (full if strategy == "zero1" else shard)
        assert s["optimizer_bytes"] == 2 * shard
        assert s["comm_bytes_per_step"] == 2 * (devices - 1) * shard
        # Over the two steps: (N-1) x shard per step for each of the two collectives.
        assert s["comm_by_name"]["zero_reduce_scatter"] == s["comm_by_name"]["zero_all_gather"] == \
            2 * (devices - 1) * shard
    if devices == 2:  # every numel of the digits MLP is even: exactly the paper's formulas
        for s in run.stats:
            assert s["comm_bytes_per_step"] == 2 * (devices - 1) * full // devices
            assert s["optimizer_bytes"] == 2 * full // devices


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_accumulation_sends_nothing_extra(strategy):
    one = fit(strategy, 2, steps=2, accumulate=1)
    four = fit(strategy, 2, steps=2, accumulate=4)
    assert [s["comm_bytes_per_step"] for s in four.stats] == [s["comm_bytes_per_step"] for s in one.stats]


# ---- in one process (world size 1: collectives are local copies) -------------
def test_the_optimizer_is_the_real_torch_optimizer():
    topo = Topology.create(torch.device("cpu"))
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    wrapped, opt = ZeRO2().setup(model, ADAMW, topo)
    assert isinstance(opt, ShardedOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert type(opt.optimizer) is torch.optim.AdamW
    assert opt.param_groups is opt.optimizer.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # schedulers drive the inner lr
    F.mse_loss(wrapped(torch.randn(2, 4)), torch.randn(2, 3)).backward()
    opt.step()
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_meta_model_is_a_clear_error():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="strategy 'zero1' keeps full parameters on every rank, so it cannot set "
                                         "up a model on the meta device; use 'zero3' or 'fsdp'"):
        ZeRO1().setup(model, ADAMW, Topology.create(torch.device("cpu")))


# ---- against torch.distributed.optim.ZeroRedundancyOptimizer -----------------------
def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))


def _ours_vs_torch_zero(rank, device, steps, path):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    topo = Topology.create(device)
    mine, theirs = _small(), _small()
    ours, o1 = ZeRO1().setup(mine, ADAMW, topo)
    torch_ddp = DistributedDataParallel(theirs, process_group=topo.group("dp"))
    o2 = ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=torch.optim.AdamW,
                                 process_group=topo.group("dp"), lr=1e-3)
    train_beside_torch(rank, steps, 5, path, (ours, o1, mine), (torch_ddp, o2, theirs))


def test_weights_equal_torch_zero_redundancy_optimizer(tmp_path):
    path = str(tmp_path / "w.pt")
    launch.spawn(_ours_vs_torch_zero, 2, args=(4, path))
    assert_beside_torch(path)


# ---- torch.distributed.checkpoint round trip ------------------------------------
def _dcp_round_trip(rank, device, strategy, path):
    import torch.distributed.checkpoint as dcp

    from shardwise.checkpoint.pieces import LoadPlanner, SavePlanner, build_state
    from shardwise.checkpoint.store import model_shapes

    topo = Topology.create(device)
    strat = sw.resolve(strategy)
    shapes = model_shapes(_small())
    model, opt = strat.setup(_small(), ADAMW, topo)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        F.cross_entropy(model(torch.randn(8, 16, generator=g)), torch.randint(0, 5, (8,), generator=g)).backward()
        opt.step()
        opt.zero_grad()

    def state():
        return build_state(strat.checkpoint_held(model, opt, topo), shapes)

    st = state()
    # The layout-free form: each tensor under its global shape; this rank's optimizer-state piece only.
    assert st["optim.2.bias.exp_avg"].size() == (5,)
    mine = [(tuple(o), v.numel()) for o, v in st["optim.2.bias.exp_avg"].parts]
    assert mine == ([((0,), 3)] if rank == 0 else [((3,), 2)])  # torch.chunk(5, 2)
    assert st["optim.0.weight.exp_avg"].size() == (32, 16)
    assert st["optim.0.weight.step"].size() == ()
    local = {k: [v.clone() for _, v in p.parts] for k, p in st.items()}
    dcp.save(st, checkpoint_id=path, planner=SavePlanner())
    with torch.no_grad():  # wreck the live state, then load it back in place
        for p in st.values():
            for _, v in p.parts:
                v.fill_(123.0)
    dcp.load(state(), checkpoint_id=path, planner=LoadPlanner())
    for k, p in state().items():
        for (_, v), w in zip(p.parts, local[k]):
            torch.testing.assert_close(v, w, rtol=0, atol=0)
    # The optimizer keeps training from the restored state.
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_dcp_round_trip_in_place(tmp_path, strategy):
    launch.spawn(_dcp_round_trip, 2, args=(strategy, str(tmp_path / "ck")))


# ---- collectives: native or pairwise exchange; stage 1 overlaps backward ----------------
@pytest.mark.parametrize("strategy", [ZeRO1(collectives="native"), ZeRO2(collectives="p2p"),
                                      sw.FSDP(collectives="native")], ids=["zero1-native", "zero2-p2p", "fsdp-native"])
def test_either_collectives_equal_single(reference, same_run, strategy):
    # "auto" picks p2p on gloo (the runs above); the backend's own collectives must train the same.
    same_run(reference, fit(strategy, 2))


def test_unknown_collectives_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^unknown collectives 'mpi'; use one of auto, native, p2p$"):
        ZeRO2(collectives="mpi").setup(_small(), ADAMW, Topology.create(torch.device("cpu")))


def _when_zero1_reduces(rank, device, path):
    topo = Topology.create(device)
    model, opt = ZeRO1().setup(_small(), ADAMW, topo)
    g = torch.Generator().manual_seed(rank)

    def backward():
        F.cross_entropy(model(torch.randn(8, 16, generator=g)), torch.randint(0, 5, (8,), generator=g)).backward()

    sent = {}
    with model.no_sync():
        backward()
    sent["after no_sync backward"] = topo.stats.by_name.get("zero_reduce_scatter", 0)
    backward()
    sent["after synced backward"] = topo.stats.by_name.get("zero_reduce_scatter", 0)
    opt.step()
    sent["after step"] = topo.stats.by_name.get("zero_reduce_scatter", 0)
    if rank == 0:
        torch.save(sent, path)


@pytest.mark.float32  # the claim is fp32 bytes
def test_zero1_reduces_while_backward_runs(tmp_path):
    """Stage 1 reduce-scatters from the last backward's hooks (overlapping it), not at the step, and never twice."""
    path = str(tmp_path / "s.pt")
    launch.spawn(_when_zero1_reduces, 2, args=(path,))
    sent = torch.load(path)
    piece = 4 * sum(chunk_numel(p.numel(), 2) for p in _small().parameters())
    assert sent == {"after no_sync backward": 0, "after synced backward": piece, "after step": piece}
