"""Model-state memory against the published numbers: the ZeRO paper's Table 1 and DeepSpeed's estimator."""
from __future__ import annotations

import pytest

from shardwise.plan import (
    ClusterSpec,
    Layout,
    ModelSpec,
    TrainingSpec,
    bytes_per_param,
    estimate,
    model_state_bytes,
    shard_numel,
)

pytestmark = pytest.mark.timeout(60)

# Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models" (SC'20, arXiv:1910.02054), Table 1: per-device memory of the model
# states for mixed-precision Adam (K = 12, so 16 bytes per parameter unsharded) as a
# function of the data-parallel degree, for P_os (ZeRO-1), P_os+g (ZeRO-2) and
# P_os+g+p (ZeRO-3). The paper's GB are 10^9 bytes. Values are as printed, so each is
# checked to within half a unit of its last printed digit.
ZERO_TABLE_1 = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
            64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513.5", "257.75", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"), 16: ("4750", "2875", "1000"),
           64: ("4187.5", "2218.75", "250"), 256: ("4046.9", "2054.7", "62.5"),
           1024: ("4011.7", "2013.7", "15.6")},
}


def _tolerance(printed: str) -> float:
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return 0.5 * 10 ** -decimals


@pytest.mark.parametrize("psi", sorted(ZERO_TABLE_1))
@pytest.mark.parametrize("n", [1, 4, 16, 64, 256, 1024])
def test_zero_paper_table_1(psi, n):
    bpp = bytes_per_param("bf16-mixed", "adamw")
    assert (bpp.param, bpp.grad, bpp.optimizer) == (2, 2, 12)  # the paper's 2 + 2 + K with K = 12
    for strategy, printed in zip(("zero1", "zero2", "zero3"), ZERO_TABLE_1[psi][n], strict=True):
        got = model_state_bytes(int(psi), strategy, n, bpp).total / 1e9
        assert abs(got - float(printed)) <= _tolerance(printed), (psi, n, strategy, got, printed)
    # The baseline (plain data parallelism) is the N = 1 column at every degree: 16 bytes per parameter.
    assert model_state_bytes(int(psi), "ddp", n, bpp).total == 16 * int(psi)


def test_zero_table_through_the_planner():
    """The same numbers come out of estimate() for a 7.5B model on 64 devices."""
    cluster = ClusterSpec.with_devices(64)
    training = TrainingSpec(precision="bf16-mixed", optimizer="adamw")
    model = ModelSpec.from_params(7.5e9)
    got = {s: estimate(model, cluster, training, Layout(s, 64)).model_states_bytes / 1e9
           for s in ("ddp", "zero1", "zero2", "zero3")}
    assert round(got["ddp"]) == 120 and round(got["zero1"], 1) == 31.4
    assert round(got["zero2"], 1) == 16.6 and round(got["zero3"], 2) == 1.88


# ---- the byte conventions our training code counts --------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_fp32_adamw_conventions(n):
    numel = 1001  # not a multiple of n: shards are padded
    p = 4 * numel
    part = 4 * shard_numel(numel, n)
    bpp = bytes_per_param("fp32", "adamw")
    ddp = model_state_bytes(numel, "ddp", n, bpp)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (p, p, 2 * p)
    z1 = model_state_bytes(numel, "zero1", n, bpp)
    assert (z1.params, z1.grads, z1.optimizer) == (p, p, 2 * part)
    z2 = model_state_bytes(numel, "zero2", n, bpp)
    assert (z2.params, z2.grads, z2.optimizer) == (p, part, 2 * part)
    for name in ("zero3", "fsdp"):
        z3 = model_state_bytes(numel, name, n, bpp)
        assert (z3.params, z3.grads, z3.optimizer) == (part, part, 2 * part)


def test_shard_numel_pads_up():
    assert [shard_numel(10, n) for n in (1, 2, 3, 4, 10, 11)] == [10, 5, 4, 3, 1, 1]
    with pytest.raises(ValueError):
        shard_numel(10, 0)


def test_optimizer_states_per_optimizer():
    assert bytes_per_param("fp32", "sgd").optimizer == 0
    assert bytes_per_param("fp32", "sgd-momentum").optimizer == 4
    assert bytes_per_param("fp32", "adamw").optimizer == 8
    # bf16-mixed always keeps the fp32 master weights next to the states.
    assert bytes_per_param("bf16-mixed", "sgd").optimizer == 4
    assert bytes_per_param("bf16-mixed", "sgd-momentum").optimizer == 8
    assert bytes_per_param("bf16-mixed", "adamw").total == 16


# ---- DeepSpeed's estimate_zero3_model_states_mem_needs_all_live -------------
# The example in the Hugging Face Transformers DeepSpeed guide ("Memory requirements",
# huggingface.co/docs/transformers/deepspeed), which runs DeepSpeed's
# estimate_zero3_model_states_mem_needs_all_live on bigscience/T0_3B:
#   "SW: Model with 2783M total params, 65M largest layer params."
# Exact counts of that model (T5 v1.1 XL shape, AutoModel without the LM head:
# d_model 2048, d_ff 5120 gated, 32 heads of 64, 24+24 layers, vocabulary 32128):
# 2,783,959,040 parameters; the largest layer is the shared embedding, 32128 x 2048.
# DeepSpeed keeps 18 bytes per parameter sharded (16-bit weights, fp32 gradient
# partition, fp32 master weights and Adam moments), plus 4 bytes per parameter of
# the largest layer, gathered live (16-bit weights and 16-bit gradients); GB = 2^30.
T0_3B_PARAMS = 2_783_959_040
T0_3B_LARGEST = 32128 * 2048
DEEPSPEED_T0_3B_PER_GPU = {  # (gpus, offload) -> "per GPU" column as printed
    (1, "all"): "0.25", (1, "optimizer"): "5.43", (1, "none"): "46.91",
    (2, "all"): "0.25", (2, "optimizer"): "2.84", (2, "none"): "23.58",
}


@pytest.mark.parametrize("gpus,offload", sorted(DEEPSPEED_T0_3B_PER_GPU))
def test_deepspeed_zero3_estimator_t0_3b(gpus, offload):
    model = ModelSpec(name="bigscience/T0_3B", params=T0_3B_PARAMS, largest_layer_params=T0_3B_LARGEST)
    cluster = ClusterSpec.with_devices(gpus)
    training = TrainingSpec(precision="bf16-mixed", optimizer="adamw", fp32_grads=True, offload=offload)
    est = estimate(model, cluster, training, Layout("zero3", gpus))
    per_gpu = (est.model_states_bytes + est.buffers["gathered units"]) / 2**30
    printed = DEEPSPEED_T0_3B_PER_GPU[(gpus, offload)]
    assert abs(per_gpu - float(printed)) <= _tolerance(printed), (per_gpu, printed)
    assert est.activation_bytes == 0  # neither a shape nor a trace: DeepSpeed's number has none either


def test_offload_moves_states_to_host():
    bpp = bytes_per_param("bf16-mixed", "adamw")
    on_device = model_state_bytes(1000, "zero2", 4, bpp)
    offloaded = model_state_bytes(1000, "zero2", 4, bpp, offload="optimizer")
    assert offloaded.optimizer == 0 and offloaded.grads == 0 and offloaded.params == on_device.params
    assert offloaded.host == on_device.optimizer + on_device.grads
    # ddp has no partitions to offload.
    assert model_state_bytes(1000, "ddp", 4, bpp, offload="optimizer") == model_state_bytes(1000, "ddp", 4, bpp)
