"""precision="bf16-true": weights, gradients and optimizer states in bf16 with no fp32 master copy.

The model-state bytes are counted rank by rank and must be exactly half of fp32's with AdamW (two moments:
4 + 4 + 8 bytes per parameter against 2 + 2 + 4) and exactly what the planner lays out. The distributed runs
must equal the single-device bf16-true run up to bf16 rounding: the tolerance comes from a measured floor.
"""
from __future__ import annotations

import functools

import docs_snippet
import pytest
import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.plan.states import rank_states
from shardwise.strategies.registry import resolve
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float32]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
SGD = functools.partial(torch.optim.SGD, lr=0.1)
STATES = ("params_bytes", "grads_bytes", "optimizer_bytes")


def gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))


def fit(strategy: str, devices: int, precision: str, optimizer=ADAMW) -> sw.FitResult:
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, precision=precision).fit(
        gpt(), CharText(stdlib_text(20_000), 16), lm_loss, optimizer, batch_size=8, max_steps=4)


def planned(strategy: str, devices: int, precision: str) -> list[dict[str, int]]:
    layout = resolve(strategy).layout(devices).with_run(precision, False)
    return [r.as_stats() for r in rank_states(gpt(), layout, ADAMW([torch.nn.Parameter(torch.zeros(1))]))]


def distance(run: sw.FitResult, ref: sw.FitResult) -> float:
    """|w - w_ref| / |w_ref| over every tensor at once (bf16 rounding makes single near-zero weights meaningless)."""
    diff = torch.cat([(run.state_dict[k].double() - v.double()).flatten() for k, v in ref.state_dict.items()])
    return float(diff.norm() / torch.cat([v.double().flatten() for v in ref.state_dict.values()]).norm())


@pytest.mark.parametrize("strategy, devices", [("single", 1), ("fsdp", 2)])
def test_bf16_true_holds_half_the_model_state_bytes_of_fp32_as_planned(strategy, devices):
    fp32, bf16 = fit(strategy, devices, "32"), fit(strategy, devices, "bf16-true")
    assert all(v.dtype == torch.bfloat16 for v in bf16.state_dict.values() if v.is_floating_point())
    for a, b, plan in zip(fp32.stats, bf16.stats, planned(strategy, devices, "bf16-true")):
        assert [b[k] * 2 for k in STATES] == [a[k] for k in STATES]
        assert {k: b[k] for k in plan} == plan  # exactly the planner's bytes, rank by rank


def test_bf16_true_runs_equal_the_single_device_bf16_true_run():
    """SGD: a wrong gradient (a missing average, a dropped bucket) moves the weights by its own size, where Adam
    would normalise a factor away. Measured on this run: ddp and fsdp 2.3e-4 from one device (the order of bf16
    sums), one device in bf16 1.7e-3 from fp32; the tolerance is twice the floor."""
    ref = fit("single", 1, "bf16-true", SGD)
    assert distance(ref, fit("single", 1, "32", SGD)) > 1e-3  # bf16 rounding is visible at this tolerance
    for strategy in ("ddp", "fsdp"):
        run = fit(strategy, 2, "bf16-true", SGD)
        assert distance(run, ref) < 5e-4
        assert run.losses == pytest.approx(ref.losses, abs=2 ** -5)  # a bf16 ulp at 4.8 is 2^-5


def test_16_true_is_refused_with_the_reason(no_spawn):
    with pytest.raises(ValueError) as e:
        sw.Trainer("ddp", 2, precision="16-true")
    assert str(e.value) == (
        "precision='16-true' is not supported: with the weights and optimizer states themselves in fp16 and no fp32 "
        "copy, Adam's default eps=1e-8 rounds to 0 (fp16's smallest value is 6e-8) and any update under 1/2048 of a "
        "weight is lost; use '16-mixed' (fp32 master weights and a loss scaler) or 'bf16-true' (bf16's exponent "
        "range, no scaler needed)")


def test_the_precision_page_runs_as_written(tmp_path, monkeypatch):
    """docs/practical.md's "Mixed precision" program: every precision name under zero3 on two ranks."""
    docs_snippet.run("practical.md", "precision", tmp_path, monkeypatch)
