"""The planner's predictions against what our training runs count, rank by rank (issues 6 and 11)."""
from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.plan import (
    ClusterSpec,
    Layout,
    ModelSpec,
    TrainingSpec,
    estimate,
    plan_run,
    rank_states,
)
from shardwise.plan.states import busiest
from shardwise.strategies.registry import available_strategies
from shardwise.workloads import CharText, digits, stdlib_text

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_predicted_bytes_equal_counted(strategy, devices):
    if strategy not in available_strategies():
        pytest.skip(f"{strategy} is not in this build")
    work = digits()
    run = sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
        work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3),
        batch_size=64, max_steps=2)
    est = estimate(ModelSpec.from_module(work.make_model()), ClusterSpec.with_devices(devices),
                   TrainingSpec(precision="fp32", optimizer="adamw", global_batch=64, micro_batch=64 // devices),
                   Layout(strategy, devices))
    # The planner predicts the busiest rank: ZeRO-1/2 keep small padded copies of
    # pieces cut short by a parameter's end, and which rank holds them varies.
    assert max(s["params_bytes"] for s in run.stats) == est.params_bytes
    for s in run.stats:
        assert s["optimizer_bytes"] == est.optimizer_bytes
        assert s["grads_bytes"] == est.grads_bytes
        assert s["comm_bytes_per_step"] == est.comm_bytes_per_step


# ---- composed layouts (issue 11): FSDP with tensor and pipeline parallelism -------------
def make_gpt() -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))
    for b in m.blocks:
        b.attn.k.bias.requires_grad_(False)  # a frozen parameter: whole on every rank, and tp-sliced
    return m


# name -> (strategy factory, devices); factories, so collecting the tests builds nothing.
COMPOSED: dict[str, tuple[Callable[[], sw.Strategy], int]] = {
    "fsdp-tp": (lambda: sw.Parallel(dp=2, tp=2, zero=3), 4),
    "fsdp-pp-gpipe": (lambda: sw.Parallel(dp=2, pp=2, zero=3, schedule="gpipe"), 4),
    "fsdp-pp-1f1b": (lambda: sw.Parallel(dp=2, pp=2, zero=3, schedule="1f1b"), 4),
    "fsdp-tp-pp": (lambda: sw.Parallel(dp=2, tp=2, pp=2, zero=3), 8),
    "hsdp-tp": (lambda: sw.Parallel(dp=4, tp=2, zero=3, replicate=2), 8),
    "fsdp-pp-interleaved": (lambda: sw.Parallel(dp=2, pp=2, zero=3, chunks=2, schedule="interleaved"), 4),
    "zero1-pp": (lambda: sw.Parallel(dp=2, pp=2, zero=1), 4),
}


def _fit(strategy: sw.Strategy, devices: int, make: Callable[[], nn.Module], loss) -> sw.FitResult:
    # Two micro-batches per step and clipping: the count follows a full step with accumulation.
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=2,
                      gradient_clip_val=1.0).fit(make(), CharText(stdlib_text(20_000), 16), loss,
                                                 functools.partial(torch.optim.AdamW, lr=1e-3), batch_size=8,
                                                 max_steps=1)


def _assert_planned(run: sw.FitResult, strategy: sw.Strategy, devices: int, make: Callable[[], nn.Module]) -> None:
    planned = rank_states(make(), strategy.describe(devices), "adamw")
    stats = sorted(run.stats, key=lambda s: s["rank"])
    # Every rank, every kind of state, to the byte (ranks in mesh order pp, dp, tp).
    assert [{k: s[k] for k in p.as_stats()} for s, p in zip(stats, planned, strict=True)] == \
        [p.as_stats() for p in planned]
    top = busiest(planned)
    assert max(s["model_state_bytes"] for s in stats) == top.total
    assert all(s["model_state_bytes"] <= top.total for s in stats)
    # The Trainer's memory check plans the same busiest rank.
    plan = plan_run(make(), strategy.describe(devices), 10**12, 8, "adamw", accumulate_grad_batches=2)
    assert plan.states == top


@pytest.mark.parametrize("name", list(COMPOSED))
def test_composed_layouts_counted_equal_planned(name):
    factory, devices = COMPOSED[name]
    _assert_planned(_fit(factory(), devices, make_gpt, lm_loss), factory(), devices, make_gpt)


@pytest.mark.parametrize("family,factory", [
    ("gpt2", lambda: sw.Parallel(dp=2, tp=2, zero=3)),
    ("gpt2", lambda: sw.Parallel(dp=2, pp=2, zero=3)),   # the tied embedding lives on both stages
    ("llama", lambda: sw.Parallel(dp=2, pp=2, zero=3)),
], ids=["gpt2-fsdp-tp", "gpt2-fsdp-pp-tied", "llama-fsdp-pp"])
def test_hf_composed_layouts_counted_equal_planned(family, factory):
    pytest.importorskip("transformers")
    import tiny_hf

    make = getattr(tiny_hf, family)
    _assert_planned(_fit(factory(), 4, make, tiny_hf.logits_loss), factory(), 4, make)
