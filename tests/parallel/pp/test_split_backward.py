"""The split backward (B now, W later) gives exactly the plain backward's gradients, and W redoes none of B.

:mod:`shardwise.parallel.pp.split_backward` alone. Each test
runs a stage once with ``torch.autograd.backward(out, g)`` and once as
``backward_input`` then ``backward_weight``, and compares the input gradient and
every ``p.grad``. The work is measured too: FLOPs (torch's FlopCounterMode: the
matmuls, convolutions and attention) and the autograd nodes each pass runs.
"""
from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable
from functools import partial

import pytest
import torch
from tiny_hf import llama
from torch import nn
from torch.autograd.graph import Node
from torch.utils.flop_counter import FlopCounterMode

from shardwise.models import Block, GPTConfig
from shardwise.parallel.pp.layers import pipeline_layers
from shardwise.parallel.pp.split_backward import backward_input

pytestmark = [pytest.mark.float64, pytest.mark.timeout(120)]

same = partial(torch.testing.assert_close, rtol=1e-12, atol=1e-15)


def _nodes(out: torch.Tensor) -> list[Node]:
    seen: dict[Node, None] = {}
    todo = [out.grad_fn]
    while todo:
        n = todo.pop()
        if n is not None and n not in seen:
            seen[n] = None
            todo.extend(c for c, _ in n.next_functions)
    return list(seen)


def _hook_counter(stage: nn.Module) -> Counter:
    fired: Counter = Counter()
    for name, p in stage.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _, name=name: fired.update([name]))
    return fired


def _flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def split_vs_plain(stage: nn.Module, x: torch.Tensor) -> dict[str, object]:
    """Plain backward, then B and W on a second forward of the same stage: equal; what each pass ran."""
    torch.manual_seed(1)
    xr = x.detach().clone().requires_grad_()
    out = stage(xr)
    g = torch.randn_like(out)
    plain = _flops(lambda: torch.autograd.backward(out, g))
    ref = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    stage.zero_grad(set_to_none=True)

    fired = _hook_counter(stage)
    xs = x.detach().clone().requires_grad_()
    out = stage(xs)
    runs: list[Counter] = [Counter(), Counter()]
    phase = [0]
    for n in _nodes(out):
        n.register_prehook(lambda _, n=n: runs[phase[0]].update([n]))
    res: list[object] = []
    b = _flops(lambda: res.extend(backward_input(out, g, xs, stage.parameters())))
    (dx,), w = res
    # B is done: the previous stage could go on, and no parameter has a gradient yet.
    same(dx, xr.grad)
    assert all(p.grad is None for p in stage.parameters()) and xs.grad is None and not fired
    phase[0] = 1
    wf = _flops(w.backward_weight)
    assert {n for n, p in stage.named_parameters() if p.grad is not None} == set(ref)
    for n, p in stage.named_parameters():
        if p.grad is not None:
            same(p.grad, ref[n], msg=lambda m, n=n: f"{n}: {m}")
    assert fired == Counter(set(ref)), "one post-accumulate-grad hook call per parameter"
    assert max(runs[0].values()) == 1
    # "twice": the nodes B ran that W runs again; "w_max": the most times W ran one node (2: in two groups).
    return {"plain": plain, "b": b, "w": wf, "twice": {n.name() for n in runs[0] if n in runs[1]},
            "w_max": max(runs[1].values())}


def test_linear_gelu_stack():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    got = split_vs_plain(stage, torch.randn(5, 8))
    # W re-runs only the Linear nodes, for their weight side: B's dX = dY W is not computed again.
    assert got["twice"] == {"AddmmBackward0"} and got["w_max"] == 1
    assert got["b"] + got["w"] == got["plain"]
    assert got["w"] == 2 * 5 * (8 * 16 + 16 * 16 + 16 * 4)  # the three dW = X^T dY


def test_gpt_blocks():
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=32, n_head=4)
    stage = nn.Sequential(Block(cfg), Block(cfg))
    got = split_vs_plain(stage, torch.randn(2, 8, 32))
    assert got["b"] + got["w"] == got["plain"] and got["w"] > 0 and got["w_max"] == 1
    assert got["twice"] == {"AddmmBackward0", "NativeLayerNormBackward0"}


def test_cnn_with_batchnorm_in_train_mode():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).train()
    got = split_vs_plain(stage, torch.randn(4, 3, 6, 6))
    assert got["b"] + got["w"] == got["plain"] and got["w_max"] == 1
    assert got["twice"] == {"ConvolutionBackward0", "NativeBatchNormBackward0", "AddmmBackward0"}


def test_llama_decoder_layer():
    name, layer = pipeline_layers(llama())[1]  # the first decoder layer, called as the pipeline calls it
    assert name == "layers.0"
    got = split_vs_plain(layer, torch.randn(2, 8, 32))
    assert got["b"] + got["w"] == got["plain"] and got["w"] > 0 and got["w_max"] == 1


def test_frozen_parameter():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    stage[2].weight.requires_grad_(False)
    split_vs_plain(stage, torch.randn(4, 6))
    assert stage[2].weight.grad is None and stage[2].bias.grad is not None


class _Tied(nn.Module):
    """One Linear applied twice, and a weight used directly by two matmuls at different depths."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)) @ self.w
        return torch.tanh(self.lin(h)) @ self.w


def test_parameter_used_twice():
    """Exact, hooks once; the price (the module's docstring): W re-runs the nodes of B between the two uses."""
    torch.manual_seed(0)
    got = split_vs_plain(_Tied(), torch.randn(4, 6))
    assert got["b"] + got["w"] > got["plain"]


def test_gradient_hook_on_an_activation_applies_once():
    """A hook that doubles an activation's gradient: W roots at that node again, and the result is not doubled twice."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(6, 8), nn.Linear(8, 3)
    params = [*lin1.parameters(), *lin2.parameters()]

    def stage(x: torch.Tensor) -> torch.Tensor:
        h = lin1(x)  # its node, AddmmBackward0, is a boundary node: W starts there again
        h.register_hook(lambda g: 2 * g)
        return lin2(torch.tanh(h))

    x, g = torch.randn(4, 6, requires_grad=True), torch.randn(4, 3)
    torch.autograd.backward(stage(x), g)
    ref, rx = [p.grad.clone() for p in params], x.grad.clone()
    for p in params:
        p.grad = None
    (dx,), w = backward_input(stage(x), g, x, params)
    w.backward_weight()
    same(dx, rx)
    for p, r in zip(params, ref):
        same(p.grad, r)


def test_two_micro_batches_accumulate():
    """B of mb0, B of mb1, W of mb0, W of mb1: the .grad of two plain backwards, each hook once per W."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    xs, gs = torch.randn(2, 4, 6), torch.randn(2, 4, 3)
    for x, g in zip(xs, gs):
        torch.autograd.backward(stage(x), g)
    ref = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    fired = _hook_counter(stage)
    handles = []
    for x, g in zip(xs, gs):
        _, w = backward_input(stage(x.requires_grad_()), g, x, stage.parameters())
        handles.append(w)
    assert all(p.grad is None for p in stage.parameters()) and not fired
    handles[0].backward_weight()
    assert set(fired.values()) == {1}
    handles[1].backward_weight()
    assert set(fired.values()) == {2} and len(fired) == 4
    for p, r in zip(stage.parameters(), ref):
        same(p.grad, r)


def test_hooks_fire_once_per_parameter_per_w():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    fired = _hook_counter(stage)
    x = torch.randn(4, 6, requires_grad=True)
    _, w = backward_input(stage(x), torch.randn(4, 3), x, stage.parameters())
    assert not fired
    w.backward_weight()
    assert fired == Counter({n: 1 for n, _ in stage.named_parameters()})


def test_input_gradient_comes_before_any_parameter_gradient():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    x = torch.randn(4, 6, requires_grad=True)
    g = torch.randn(4, 3)
    (dx,), w = backward_input(stage(x), g, x, stage.parameters())
    assert all(p.grad is None for p in stage.parameters())
    want, = torch.autograd.grad(stage(x), x, g)
    same(dx, want)
    w.backward_weight()
    assert all(p.grad is not None for p in stage.parameters())


def test_graph_kept_until_w_then_freed():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(6, 8), nn.Linear(8, 3)
    x = torch.randn(4, 6, requires_grad=True)
    h = torch.tanh(lin1(x))  # what lin2's weight gradient needs (h^T dY)
    out = lin2(h)
    alive = weakref.ref(h)
    _, w = backward_input(out, torch.randn(4, 3), x, [*lin1.parameters(), *lin2.parameters()])
    del h, out
    gc.collect()
    assert alive() is not None, "the caller dropped the outputs; W still has what it needs"
    w.backward_weight()
    gc.collect()
    assert alive() is None, "after W the handle keeps nothing of the graph"
    assert w.done
    with pytest.raises(RuntimeError, match="already called"):
        w.backward_weight()


def test_last_stage_loss_and_first_stage_without_input_gradient():
    """A scalar loss with no output gradient (the last stage); token ids in (the first stage): all of it is W."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 6), nn.Linear(6, 10)
    ids = torch.randint(0, 10, (3, 5))
    loss = nn.functional.cross_entropy(head(emb(ids)).flatten(0, 1), ids.flatten())
    loss.backward()
    ref = [p.grad.clone() for p in (*emb.parameters(), *head.parameters())]
    for p in (*emb.parameters(), *head.parameters()):
        p.grad = None
    loss = nn.functional.cross_entropy(head(emb(ids)).flatten(0, 1), ids.flatten())
    dx, w = backward_input(loss, None, ids, [*emb.parameters(), *head.parameters()])
    assert dx == (None,)
    w.backward_weight()
    for p, r in zip((*emb.parameters(), *head.parameters()), ref):
        same(p.grad, r)
