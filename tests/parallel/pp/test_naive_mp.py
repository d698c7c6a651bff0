"""Naive model parallel: layers on a list of devices in one process, identical to the unsplit model."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.models import GPT, GPTConfig
from shardwise.parallel.pp.naive_mp import NaiveModelParallel
from shardwise.strategies.naive_mp import NaiveMP
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def test_forward_and_gradients_are_the_unsplit_models():
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    nmp = NaiveModelParallel(copy.deepcopy(ref), ["cpu", "cpu", "cpu"])
    assert nmp.names == [["embed"], ["blocks.0"], ["blocks.1", "head"]]  # balanced by parameter count
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    out, want = nmp(ids), ref(ids)
    assert torch.equal(out, want)  # the same operations in the same order: bit for bit
    out.square().mean().backward()
    want.square().mean().backward()
    grads = dict(nmp.original_state_dict())
    for k, p in ref.named_parameters():
        got = next(q for q in nmp.parameters() if nmp._keys[id(q)] == k)
        assert torch.equal(got.grad, p.grad), k
    assert list(grads) == list(ref.state_dict())
    assert nmp.moves == 0  # every "device" is the CPU: nothing moved
    assert nmp.output_device == torch.device("cpu")


@pytest.mark.float32  # the claim is fp32 bytes
def test_split_points_and_hops_between_distinct_devices():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    nmp = NaiveModelParallel(net, ["cpu", "meta"], split_points=["2"])
    assert nmp.names == [["0", "1"], ["2", "3", "4"]]
    assert {p.device.type for p in nmp.groups[0].parameters()} == {"cpu"}
    assert {p.device.type for p in nmp.groups[1].parameters()} == {"meta"}
    out = nmp(torch.randn(5, 4))  # the meta device computes shapes only: enough to see the hop
    assert out.device.type == "meta" and out.shape == (5, 2)
    assert (nmp.moves, nmp.moved_bytes) == (1, 5 * 8 * 4)


def test_tied_weights_across_devices_are_rejected():
    with pytest.raises(ValueError, match=r"a parameter of shape \[64, 16\] is used by layer groups 0 and 1 "
                                         r"\(a tied weight\)"):
        NaiveModelParallel(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16,
                                         tie_weights=True)), ["cpu", "cpu"])


def test_trainer_with_naive_mp_equals_single(same_run):
    work = digits()

    def fit(strategy):
        return sw.Trainer(strategy, 1, accelerator="cpu", progress=False, accumulate_grad_batches=2).fit(
            work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=5)

    ref, run = fit("single"), fit(NaiveMP(devices=["cpu", "cpu", "cpu"]))
    assert ref.losses == run.losses  # one process, same operations: exactly equal
    same_run(ref, run, rtol=0, atol=0)


@pytest.mark.float32  # the claim is about mixed precision over fp32 weights
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_naive_mp_honours_mixed_precision(precision):
    """The same operations as single-device training under autocast: exactly the same losses, and not fp32's."""
    work = digits()

    def fit(strategy, precision):
        return sw.Trainer(strategy, 1, accelerator="cpu", progress=False, precision=precision).fit(
            work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=3)

    ref, run = fit("single", precision), fit(NaiveMP(devices=["cpu", "cpu"]), precision)
    assert ref.losses == run.losses
    assert run.losses != fit("single", "32").losses


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_on_two_gpus():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    nmp = NaiveModelParallel(copy.deepcopy(net), ["cuda:0", "cuda:1"], split_points=["2"])
    x = torch.randn(8, 16)
    torch.testing.assert_close(nmp(x).cpu(), net(x))
    assert nmp.moves == 1
