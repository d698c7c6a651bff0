"""The pipeline runtime's kept gradient tensors: same results as a plain backward, memory kept across steps."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from shardwise import launch
from shardwise.comm.topology import Topology
from shardwise.parallel.kept_grads import KeptGrads
from shardwise.parallel.pipeline import build_pipeline
from shardwise.parallel.pipeline_run import pipeline_step

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64]


def test_lent_tensor_is_reused_and_untouched_ones_go_back():
    kept = KeptGrads()
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    kept.lend([used, unused])
    first = used.grad
    assert first is not None and unused.grad is not None
    (used * 2).sum().backward()
    kept.take_back_unused()
    assert torch.equal(used.grad, torch.full((3,), 2.0))
    assert unused.grad is None  # as a plain backward leaves a parameter it did not reach
    assert kept.nbytes == 5 * used.element_size()
    used.grad = None  # zero_grad(set_to_none=True)
    del first
    kept.lend([used])
    again = used.grad
    assert again is not None and torch.equal(again, torch.zeros(3))
    (used * 3).sum().backward()
    kept.take_back_unused()
    assert used.grad is again and torch.equal(again, torch.full((3,), 3.0))


def test_a_tensor_someone_still_holds_is_never_lent_again():
    kept = KeptGrads()
    p = nn.Parameter(torch.ones(3))
    kept.lend([p])
    p.sum().backward()
    kept.take_back_unused()
    stored = p.grad  # a user keeps last step's gradient, then clears it
    p.grad = None
    kept.lend([p])
    assert p.grad is not stored
    assert torch.equal(stored, torch.ones(3))  # not zeroed under its holder


def test_set_gradients_frozen_and_non_cpu_parameters_are_left_alone():
    kept = KeptGrads()
    set_, frozen = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2), requires_grad=False)
    meta = nn.Parameter(torch.ones(2, device="meta"))
    mine = torch.full((2,), 7.0)
    set_.grad = mine  # accumulating over calls, or zero_grad(set_to_none=False)
    kept.lend([set_, frozen, meta])
    assert set_.grad is mine and frozen.grad is None and meta.grad is None
    assert kept.nbytes == 0


class _WithUnused(nn.Module):
    """A layer with a parameter its forward never uses: AdamW must skip it (its gradient stays None)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.unused = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_WithUnused(8), _WithUnused(8), _WithUnused(8), nn.Linear(8, 4)).double()


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64))
            for _ in range(3)]


def _pipeline(rank: int, device: torch.device, schedule: str, path: str) -> None:
    topo = Topology.create(device, dp=1, tp=1, pp=2)
    pm = build_pipeline(_model(), topo, split_points=["2"])
    params = list(pm.parameters())
    opt = ADAMW(params)
    ptrs = []
    for x, y in _batches():
        pipeline_step(pm, [(x, y)], F.mse_loss, topo, schedule, 4)
        ptrs.append([p.grad.data_ptr() if p.grad is not None else None for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {k: v.detach().clone() for k, v in pm.claimed.items()}  # under the model's own names
    torch.save((state, ptrs, pm.kept_grads.nbytes), f"{path}.{rank}")
    topo.close()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipeline_with_kept_gradients_equals_one_process(tmp_path, schedule):
    path = str(tmp_path / "out.pt")
    launch.spawn(_pipeline, 2, args=(schedule, path))
    got = [torch.load(f"{path}.{r}", weights_only=False) for r in range(2)]
    ref = _model()
    opt = ADAMW(ref.parameters())
    for x, y in _batches():
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    expect = dict(ref.named_parameters())
    for rank, (state, ptrs, nbytes) in enumerate(got):
        for name, value in state.items():
            torch.testing.assert_close(value, expect[name].detach(), rtol=1e-12, atol=1e-12,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
        # The unused parameters took no step (weight decay would have moved them had they got a zero gradient).
        assert all(torch.equal(v, torch.ones(8)) for n, v in state.items() if n.endswith("unused"))
        # Every step's gradients sat in the same memory; unused ones were None each time.
        assert ptrs[0] == ptrs[1] == ptrs[2]
        assert sum(p is None for p in ptrs[0]) == 2 - rank
        assert nbytes == sum(v.numel() * 8 for v in state.values())
