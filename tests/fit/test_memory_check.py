"""The Trainer's memory check plans exactly the run that was asked for.

Every check here must fire before any worker process starts: the ``no_spawn``
fixture makes starting one raise ``Spawned``, so a run the check accepts ends
in ``Spawned`` and a run it refuses in ``MemoryError``, with nothing trained.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.plan import plan_run
from shardwise.strategies.dp.ddp import DDP
from shardwise.strategies.registry import resolve
from shardwise.workloads import CharText, stdlib_text

pytestmark = pytest.mark.timeout(120)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
BATCH = 32


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64))


DATA = CharText(stdlib_text(20_000), 64)


def _fit(strategy: str | sw.Strategy, memory: int, **kw: object) -> None:
    sw.Trainer(strategy, 2, accelerator="cpu", progress=False, device_memory=memory, **kw).fit(
        make_gpt(), DATA, lm_loss, ADAMW, batch_size=BATCH, max_steps=1)


def _planned(strategy: str | sw.Strategy, precision: str = "32") -> int:
    layout = resolve(strategy).describe(2).with_run(precision, False)
    return plan_run(make_gpt(), layout, 10**12, BATCH, "adamw").total_bytes


def test_bf16_mixed_is_checked_against_the_bf16_plan(no_spawn):
    fp32, bf16 = _planned("ddp", "32"), _planned("ddp", "bf16-mixed")
    # Autocast keeps fp32 parameters, gradients and optimizer states: only the activations halve.
    assert bf16 < fp32
    between = (fp32 + bf16) // 2
    with pytest.raises(no_spawn):  # accepted: the check let the workers start
        _fit("ddp", between, precision="bf16-mixed", memory_check="error")
    with pytest.raises(MemoryError, match=r"does not fit: ddp on dp=2 tp=1 pp=1: "):
        _fit("ddp", between, precision="32", memory_check="error")


def test_a_run_that_fits_only_thanks_to_offload_is_accepted(no_spawn):
    plain, offloaded = _planned(sw.ZeRO1()), _planned(sw.ZeRO1(offload="optimizer"))
    assert offloaded < plain
    between = (plain + offloaded) // 2
    with pytest.raises(no_spawn):
        _fit(sw.ZeRO1(offload="optimizer"), between)
    with pytest.raises(MemoryError) as e:
        _fit(sw.ZeRO1(), between)
    # The refusal names the least change that fits: offloading the optimizer, with its need.
    assert "does not fit: zero1 on dp=2" in str(e.value)
    assert "offload='optimizer' would need" in str(e.value)


def test_composed_zero3_is_planned_with_its_tp_split(no_spawn):
    strategy = sw.Parallel(dp=1, tp=2, zero=3)
    plan = plan_run(make_gpt(), strategy.describe(2), 10**12, BATCH, "adamw")
    whole = sum(p.numel() * p.element_size() for p in make_gpt().parameters())
    # tp splits every matrix: each rank's parameters are half the model's, plus the replicated norms and biases.
    assert whole / 2 < plan.states.params < 0.55 * whole
    need = plan.total_bytes
    with pytest.raises(no_spawn):
        _fit(strategy, need)
    with pytest.raises(MemoryError, match=r"parallel on dp=1 tp=2 pp=1, zero=3: "):
        _fit(strategy, need - 1)


def test_a_model_tensor_parallelism_cannot_split_is_refused_before_any_process(no_spawn):
    model = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=6, n_embd=48))
    with pytest.raises(ValueError, match=r"n_head=6 is not divisible by tp=4"):
        sw.Trainer(sw.Parallel(dp=1, tp=4, zero=3), 4, accelerator="cpu", progress=False).fit(
            model, DATA, lm_loss, ADAMW, batch_size=BATCH, max_steps=1)


@dataclass
class Unplanned(DDP):
    """A strategy the planner knows nothing about (a user's own)."""

    name: ClassVar[str] = "my-own"


def test_a_layout_the_planner_cannot_model_is_said_so(no_spawn):
    with pytest.warns(UserWarning, match=r"memory check skipped: the planner cannot model this run .*'my-own'"):
        with pytest.raises(no_spawn):
            _fit(Unplanned(), 1)  # one byte: any check would refuse it, so none ran


def test_a_part_the_planner_cannot_estimate_is_said(monkeypatch, no_spawn):
    """The planner returns a plan whose activations it could not estimate: the check says so, not silently 0."""
    import dataclasses

    from shardwise.plan import run as plan_run_module
    from shardwise.workloads import digits

    real = plan_run_module.plan_run

    def partial_plan(*a, **k):
        return dataclasses.replace(real(*a, **k), notes=("activations and buffers not estimated: a test's reason",))

    monkeypatch.setattr("shardwise.plan.plan_run", partial_plan)
    work = digits()
    with pytest.warns(UserWarning, match=r"^memory check incomplete: activations and buffers not estimated: a test's "
                                         r"reason; only parameters, gradients and optimizer states were checked"), \
            pytest.raises(no_spawn):
        sw.Trainer("ddp", 2, accelerator="cpu", progress=False).fit(
            work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3),
            batch_size=64, max_steps=1)
