"""check_fit, and predictions against what real training on this machine counts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.models import GPT, MLP, GPTConfig, lm_loss
from shardwise.plan import (
    ClusterSpec,
    Layout,
    ModelSpec,
    TrainingSpec,
    check_fit,
    estimate,
)

pytestmark = pytest.mark.timeout(60)


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))


def _meta_gpt(**cfg: int) -> GPT:
    """A model check_fit can read without anyone paying for its weights."""
    with torch.device("meta"):
        return GPT(GPTConfig(**cfg))


def _counted_states(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int, int]:
    """Bytes of parameters, gradients and optimizer state tensors (AdamW's scalar step counters excluded)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    states = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    return params, grads, states


@pytest.mark.parametrize("opt_name,factory", [
    ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)),
    ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-3)),
])
def test_predicted_model_states_equal_counted(opt_name, factory):
    """One real fp32 training step on CPU: the tensors that exist are exactly the ones predicted."""
    model = _tiny_gpt()
    opt = factory(model.parameters())
    x = torch.randint(0, 128, (4, 32))
    lm_loss(model(x), x).backward()
    opt.step()
    spec = ModelSpec.from_module(model)
    est = estimate(spec, ClusterSpec.with_devices(1), TrainingSpec(precision="fp32", optimizer=opt_name),
                   Layout("ddp", 1))
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == _counted_states(model, opt)


def test_predicted_activations_equal_counted_for_a_traced_model():
    model = MLP(64, 256, 3, 10)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(24, 64))
    # Traced at batch 8, asked about batch 24 per device: activations scale with the batch.
    fits, msg = check_fit(model, "ddp", 1, 1, 1, 10**9, 24, "fp32", "adamw", sample_input=torch.zeros(8, 64))
    assert fits
    assert f"activations {sum(saved.values()) / 1e3:.2f} kB" in msg


def test_check_fit_says_yes_and_no_with_numbers():
    model = _tiny_gpt()
    fits, msg = check_fit(model, "ddp", 2, 1, 1, 10**9, 8, "fp32", "adamw")
    assert fits and msg.startswith("fits: ddp on dp=2") and "activations" in msg
    fits, msg = check_fit(model, "ddp", 2, 1, 1, 2 * 10**6, 1, "fp32", "adamw")
    # ddp needs 2.21 MB here; sharding the optimizer states (ZeRO-1) is the least change that fits.
    assert not fits and msg.startswith("does not fit") and msg.endswith("zero1 would need 1.74 MB")


def test_check_fit_suggests_checkpointing_when_activations_dominate():
    model = _meta_gpt(vocab_size=128, block_size=32, n_layer=12, n_head=4, n_embd=64)
    fits, msg = check_fit(model, "zero3", 2, 1, 1, 40 * 10**6, 64, "fp32", "adamw")
    assert not fits and "activation checkpointing" in msg
    fits, msg = check_fit(model, "zero3", 2, 1, 1, 40 * 10**6, 64, "fp32", "adamw", activation_checkpointing=True)
    assert fits, msg


def test_check_fit_memory_falls_with_sharding():
    model = _meta_gpt(vocab_size=1024, block_size=128, n_layer=8, n_head=16, n_embd=1024)  # ~100M parameters
    needed = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        _, msg = check_fit(model, strategy, 4, 1, 1, 10**10, 1, "bf16-mixed", "adamw")
        value, unit = msg.split(": ")[2].split(" ")[:2]  # "... pp=1: 1.70 GB of ..."
        needed[strategy] = float(value) * {"GB": 1e9, "MB": 1e6, "kB": 1e3}[unit]
    assert needed["ddp"] > needed["zero1"] > needed["zero2"] > needed["zero3"]


def test_check_fit_strategies_and_errors():
    model = _tiny_gpt()
    for strategy in ("single", "dp", "ps", "fsdp", "tp", "pp"):
        assert check_fit(model, strategy, 1, 1, 1, 10**9, 1, "fp32", "sgd")[0]
    assert "optimizer states live on the servers" in check_fit(model, "ps", 2, 1, 1, 10**9, 1, "fp32", "adamw")[1]
    assert check_fit(model, "hsdp", 4, 1, 1, 10**9, 1, "fp32", "adamw", shard_group=2)[0]
    # tp/pp on a model without a transformer config: assumed even, and said so.
    assert "assumed even" in check_fit(MLP(), "ddp", 1, 2, 1, 10**9, 1, "fp32", "adamw")[1]
    with pytest.raises(ValueError, match="unknown strategy"):
        check_fit(model, "zero4", 1, 1, 1, 10**9, 1, "fp32", "adamw")
    fits, msg = check_fit(model, "ddp", 1, 3, 1, 10**9, 1, "fp32", "adamw")  # 3 does not divide 4 heads
    assert fits and msg.startswith("not checked")
