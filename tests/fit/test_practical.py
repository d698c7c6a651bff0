"""Mixed precision, activation checkpointing, gradient reduction dtype."""
from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

import shardwise as sw
from shardwise.checkpoint import store as checkpoint
from shardwise.models import GPT, GPTConfig
from shardwise.parallel.checkpointing import (
    apply_activation_checkpointing,
    saved_activation_bytes,
)
from shardwise.workloads import gpt

pytestmark = pytest.mark.timeout(240)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
STEPS = 6


def fit(strategy, devices, **kw):
    work = gpt(n_layer=2, n_embd=32, n_head=2, block=16, max_chars=20_000)
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, log_every_n_steps=1, **kw).fit(
        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=16, max_steps=STEPS)


@pytest.fixture(scope="module")
def fp32():
    return fit("single", 1)


# Stated tolerance: bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4%); over a few steps
# of a tiny GPT the per-step loss stays within 2% of fp32. Measured max relative difference is printed.
BF16_RTOL = 0.02


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("ddp", 2)])
def test_bf16_mixed_tracks_fp32(fp32, strategy, devices):
    run = fit(strategy, devices, precision="bf16-mixed")
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, fp32.losses))
    print(f"bf16-mixed {strategy}: max relative loss difference to fp32 {rel:.2e}")
    assert rel < BF16_RTOL
    assert rel > 0  # it really ran in bf16
    assert all(v.dtype == torch.float32 for v in run.state_dict.values())  # fp32 master weights


def test_fp16_mixed_with_loss_scaling_tracks_fp32(fp32):
    run = fit("ddp", 2, precision="16-mixed")
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, fp32.losses))
    assert 0 < rel < BF16_RTOL


def test_bf16_gradient_reduction_halves_the_bytes(fp32):
    full = fit("ddp", 2)
    half = fit(sw.DDP(reduce_dtype="bfloat16"), 2)
    assert half.stats[0]["comm_bytes_per_step"] == full.stats[0]["comm_bytes_per_step"] // 2
    rel = max(abs(a - b) / abs(b) for a, b in zip(half.losses, fp32.losses))
    assert rel < BF16_RTOL


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError,
                       match="^precision must be one of '32', 'bf16-mixed', '16-mixed', 'bf16-true', got 'fp8'$"):
        sw.Trainer("single", 1, precision="fp8")


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("ddp", 2)])
def test_activation_checkpointing_same_losses(fp32, same_run, strategy, devices):
    # Against the same strategy without checkpointing: recomputation must not change a bit of the
    # optimisation. (This GPT's key biases get mathematically zero gradients, which Adam turns into
    # noise-sized updates, so comparing ddp with single here would measure that noise instead.)
    without = fp32 if strategy == "single" else fit(strategy, devices)
    same_run(without, fit(strategy, devices, activation_checkpointing=True), rtol=1e-6)


def test_activation_checkpointing_lowers_saved_activations():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=64)
    model = GPT(cfg)
    x = torch.randint(0, 128, (8, 64))
    before = saved_activation_bytes(model, x)
    apply_activation_checkpointing(model)
    after = saved_activation_bytes(model, x)
    print(f"saved activation bytes: {before} without, {after} with checkpointing ({after / before:.2%})")
    assert after < before / 3


def test_metrics_jsonl_has_tokens_and_mfu(tmp_path):
    path = tmp_path / "m.jsonl"
    run = fit("ddp", 2, metrics_path=path, peak_flops=1e12)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["loss"] for r in rows] == run.losses  # the global loss fit returns, not rank 0's share
    params = sum(v.numel() for v in run.state_dict.values())
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(16 * 16 / r["step_time_s"])  # global batch x block
        assert r["mfu"] == pytest.approx(6 * params * r["tokens_per_s"] / (2 * 1e12))
        assert r["samples_per_s"] == pytest.approx(16 / r["step_time_s"])  # the global batch
        assert 0 < r["rss_bytes"] <= r["peak_rss_bytes"]  # the process's peak so far: at least what it holds now
        assert not any(k.startswith("cuda_") for k in r)  # the device's peak only on CUDA


def test_a_resumed_run_keeps_the_metrics_rows_before_its_checkpoint(tmp_path):
    """Rows of steps before the checkpoint stay; rows an interrupted attempt wrote past it are replaced."""
    path, ckpt = tmp_path / "m.jsonl", str(tmp_path / "ck")
    fit("ddp", 2, metrics_path=path, checkpoint_dir=ckpt, checkpoint_every=2)  # STEPS steps, checkpoints at 2, 4..
    rows = path.read_text().splitlines()
    # An attempt that died after its checkpoint at step 2 had written rows 0..3; the restart resumes at step 2.
    path.write_text("\n".join(rows[:4]) + "\n")
    for stale in checkpoint.checkpoints(ckpt)[1:]:
        shutil.rmtree(stale)
    fit("ddp", 2, metrics_path=path, checkpoint_dir=ckpt, checkpoint_every=2)
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(STEPS))


def test_verify_comparison_honours_atol():
    from shardwise.commands.verify import Comparison

    # Losses near zero: a relative error of 50% that is 1e-9 in absolute terms.
    c = Comparison(max_loss_diff=1e-9, max_loss_rel=0.5, max_param_diff=0.0, max_param_rel=0.0, worst_param="")
    assert c.within(1e-5, atol=1e-8)
    assert not c.within(1e-5, atol=1e-10)


def test_the_step_log_has_each_groups_lr_the_gradient_norm_and_the_bytes_sent(tmp_path):
    """Beside the global loss: lr of every parameter group, the global norm before clipping and whether the clip
    applied, and the bytes rank 0 sent in the step by group (ddp's gradient all-reduce over dp)."""
    path = tmp_path / "m.jsonl"
    fit("ddp", 2, metrics_path=path, gradient_clip_val=0.5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [sorted(k for k in r if k.startswith("lr/")) for r in rows] == [["lr/0"]] * STEPS
    assert all(r["grad_norm"] > 0 and r["clipped"] == (r["grad_norm"] > 0.5) for r in rows)
    assert all(r["comm_bytes/dp"] > 0 for r in rows)
