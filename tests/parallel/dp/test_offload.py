"""CPU offload of ZeRO (ZeRO-Offload): same training, states on the offload device, exact host bytes, clear errors.

On a CPU-only machine the offload device is the training device, so the
copies move nothing between devices; what these tests prove is that the
optimizer steps its own master rows (not the training tensors), that those
rows, the gradient shards and the optimizer states are the ones on the
offload device, that training still equals one process, and that a changed
parameter (a checkpoint load) reaches the master rows.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import shardwise as sw
from shardwise.comm.topology import Topology
from shardwise.parallel.dp.sharding import chunk_numel
from shardwise.strategies.dp.fsdp import FSDP, ZeRO3
from shardwise.strategies.dp.zero import ZeRO1, ZeRO2
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CLIP = 0.05  # far below the digits MLP's gradient norm: every step is clipped


def fit(strategy, devices, steps=4, accumulate=1, clip=None):
    work = digits()
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=accumulate,
                      gradient_clip_val=clip).fit(work.make_model(), work.train, work.loss_fn, ADAMW,
                                                  batch_size=64, max_steps=steps)


def shard_bytes(n: int) -> int:
    """Bytes of one rank's padded shard of the digits MLP, in the default dtype (float64 here)."""
    return torch.empty(()).element_size() * sum(chunk_numel(p.numel(), n) for p in digits().make_model().parameters())


def full_bytes() -> int:
    return torch.empty(()).element_size() * sum(p.numel() for p in digits().make_model().parameters())


# ---- training equals one process, and the bytes land on the host -------------------
@pytest.mark.parametrize("strategy,accumulate,clip", [
    (ZeRO1(offload="optimizer"), 1, CLIP),
    (ZeRO2(offload="optimizer"), 2, None),
    (FSDP(offload="optimizer"), 1, CLIP),
    (ZeRO3(offload="all"), 2, CLIP),
], ids=["zero1-optimizer", "zero2-optimizer", "fsdp-optimizer", "zero3-all"])
def test_offloaded_training_equals_single_and_states_are_host_bytes(same_run, strategy, accumulate, clip):
    run = fit(strategy, 2, accumulate=accumulate, clip=clip)
    same_run(fit("single", 1, accumulate=accumulate, clip=clip), run)
    shard, full = shard_bytes(2), full_bytes()
    stage = {"zero1": 1, "zero2": 2}.get(strategy.name, 3)
    for s in run.stats:
        # Nothing of the optimizer stays on the training device.
        assert s["optimizer_bytes"] == 0
        assert s["host_optimizer_bytes"] == 2 * shard  # AdamW: exp_avg and exp_avg_sq of the master pieces
        assert s["host_params_bytes"] == shard          # the master rows the optimizer steps
        # Reduced gradient pieces, copied down (stage 1 drops them after the step, as without offload).
        assert s["host_grads_bytes"] == (0 if stage == 1 else shard)
        assert s["grads_bytes"] == (full if stage == 1 else 0)
        if stage < 3:
            assert s["params_bytes"] == full
        else:
            # "optimizer" keeps a device copy of the shard for the all-gathers; "all" keeps nothing.
            assert s["params_bytes"] == (0 if strategy.offload == "all" else shard)
        # Offload changes where the update runs, not what travels: the ZeRO paper's 2 or 3 x (N-1)/N x Psi
        # (ZeRO-3 gathers again for each accumulated micro-batch), plus the clip's float64 scalar all-reduce.
        collectives = 2 if stage < 3 else 2 * accumulate + 1
        assert s["comm_bytes_per_step"] == collectives * (2 - 1) * shard + (8 if clip else 0)


# ---- where the states live --------------------------------------------------------
@pytest.mark.parametrize("make", [lambda d: ZeRO2(offload="optimizer", offload_device=d),
                                  lambda d: ZeRO1(offload="optimizer", offload_device=d),
                                  lambda d: FSDP(offload="optimizer", offload_device=d),
                                  lambda d: ZeRO3(offload="all", offload_device=d)],
                         ids=["zero2", "zero1", "fsdp", "zero3-all"])
def test_optimizer_states_live_on_the_offload_device_apart_from_the_model(make):
    device = "cpu"
    strategy = make(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    wrapped, opt = strategy.setup(model, ADAMW, Topology.create(torch.device("cpu")))
    F.mse_loss(wrapped(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    seen: list[torch.Tensor] = []
    # The gradients the update reads, at the moment it runs (ZeRO-1 drops them after the step).
    opt.optimizer.register_step_pre_hook(
        lambda o, args, kwargs: seen.extend(p.grad for g in o.param_groups for p in g["params"]))
    opt.step()
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()
                      if p.untyped_storage().nbytes()}
    stepped = [p for g in opt.param_groups for p in g["params"]]
    assert stepped and all(p.device == torch.device(device) for p in stepped)
    assert len(seen) == len(stepped) and all(g is not None and g.device == torch.device(device) for g in seen)
    # The optimizer steps master pieces of its own, not views of the training parameters.
    assert not {p.untyped_storage().data_ptr() for p in stepped} & model_storages
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    assert len(states) == 2 * len(stepped)
    assert all(v.device == torch.device(device) for v in states)
    kinds = strategy.state_tensors(wrapped, opt)
    assert kinds["optimizer"] == [] and len(kinds["host_optimizer"]) == len(states)


# ---- a write to the parameters (a checkpoint load) reaches the master rows ----------
@pytest.mark.parametrize("strategy", [ZeRO2(offload="optimizer"), FSDP(offload="optimizer"), ZeRO3(offload="all")],
                         ids=["zero2", "fsdp", "zero3-all"])
def test_loading_a_checkpoint_in_place_restores_an_offloaded_run(strategy):
    torch.manual_seed(0)
    topo = Topology.create(torch.device("cpu"))
    wrapped, opt = strategy.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), ADAMW, topo)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]

    def step(x, y):
        F.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()

    for x, y in batches[:2]:
        step(x, y)
    def views():
        return [h.data for h in strategy.checkpoint_held(wrapped, opt, topo)]

    saved = [v.detach().clone() for v in views()]
    step(*batches[2])
    after = strategy.full_state_dict(wrapped, topo)
    step(*batches[3])  # move away from the saved point, then load it back in place
    with torch.no_grad():
        for v, w in zip(views(), saved):
            v.copy_(w)
    step(*batches[2])
    again = strategy.full_state_dict(wrapped, topo)
    for k in after:
        torch.testing.assert_close(again[k], after[k], rtol=0, atol=0)


# ---- clear errors -------------------------------------------------------------------
@pytest.mark.parametrize("cls,name", [(ZeRO1, "zero1"), (ZeRO2, "zero2")])
def test_offloading_everything_needs_sharded_parameters(cls, name):
    with pytest.raises(ValueError, match=rf"^offload='all' moves the parameter shards to the host too, but strategy "
                                         rf"'{name}' keeps full parameters on every device; use offload='optimizer' "
                                         r"with it, or 'zero3'/'fsdp'/'hsdp' for offload='all'$"):
        cls(offload="all")


@pytest.mark.parametrize("cls", [ZeRO2, FSDP])
def test_unknown_offload_is_an_error(cls):
    with pytest.raises(ValueError, match=r"^unknown offload 'disk'; use one of none, optimizer, all$"):
        cls(offload="disk")
