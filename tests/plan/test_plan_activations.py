"""Activation memory: Korthikanti et al. 2022's formulas and the pipeline schedules' in-flight micro-batches."""
from __future__ import annotations

import pytest

from shardwise.plan import (
    KNOWN_MODELS,
    ClusterSpec,
    Layout,
    ModelSpec,
    TrainingSpec,
    estimate,
)
from shardwise.plan.memory import in_flight_microbatches, layer_activation_bytes

pytestmark = pytest.mark.timeout(60)

# Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
# (MLSys 2023, arXiv:2205.05198), bytes per layer for 16-bit activations:
#   no parallelism            s b h (34 + 5 a s / h)
#   tensor parallel           s b h (10 + 24/t + 5 a s / (h t))
#   tensor + sequence par.    s b h (34/t + 5 a s / (h t))
#   full recomputation        2 s b h
# shardwise's sequence parallelism keeps the all-gathered inputs of q/k/v and fc1 whole (so a layer moves
# exactly plain tp's bytes; Megatron keeps 1/t of them and gathers them again in backward): 4 + 30/t
# instead of 34/t (shardwise/parallel/tp/sequence_parallel.py; the runtime's own exact formula is checked in
# tests/parallel/tp/test_sequence_parallel.py).
# Their model configurations (Table 3), all with s = 2048 and t = 8.
PAPER_MODELS = {"22B": (64, 6144, 48), "175B": (96, 12288, 96), "530B": (128, 20480, 105),
                "1T": (160, 25600, 128)}


def _gpt(a: int, h: int, layers: int) -> ModelSpec:
    return ModelSpec.transformer(layers=layers, hidden=h, heads=a, vocab=51200, seq_len=2048)


@pytest.mark.parametrize("name", sorted(PAPER_MODELS))
@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_formulas(name, t):
    a, h, layers = PAPER_MODELS[name]
    m, s, b = _gpt(a, h, layers), 2048, 1
    sbh = s * b * h
    scores = 5 * a * s / h
    if t == 1:
        assert layer_activation_bytes(m, s, b) == pytest.approx(sbh * (34 + scores))
    assert layer_activation_bytes(m, s, b, tp=t) == pytest.approx(sbh * (10 + 24 / t + scores / t))
    assert layer_activation_bytes(m, s, b, tp=t, sequence_parallel=True) == \
        pytest.approx(sbh * (4 + 30 / t + scores / t))
    assert layer_activation_bytes(m, s, b, tp=t, recompute=True, sequence_parallel=False) == pytest.approx(2 * sbh)


@pytest.mark.parametrize("name", ["175B", "530B", "1T"])
def test_sequence_parallel_and_selective_recompute_save_about_3x(name):
    """The paper's headline (abstract) is about 5x less activation memory with sequence parallelism plus
    selective recomputation against tensor parallelism alone, with Megatron's 34/t. shardwise's sequence
    parallelism keeps 4 + 30/t (the gathered inputs whole, for plain tp's bytes), so at t = 8 it saves
    about 3x: (10 + 24/8 + 5as/8h) against (4 + 30/8 + 4a/8h). Selective recomputation drops the stored
    attention scores, which is what flash attention does too."""
    a, h, layers = PAPER_MODELS[name]
    m = _gpt(a, h, layers)
    tp_only = layer_activation_bytes(m, 2048, 1, tp=8)
    sp_selective = layer_activation_bytes(m, 2048, 1, tp=8, sequence_parallel=True, flash_attention=True)
    megatron = 34 / 8 + 4 * a / (8 * h)  # Table 2's sequence parallelism, flash attention's log-sum-exp
    assert 4.5 < tp_only / (2048 * h * megatron) < 6  # the paper's ~5x
    assert 2.5 < tp_only / sp_selective < 3.5


def test_gated_mlp_and_other_inner_sizes_generalise_the_34():
    base = KNOWN_MODELS["gpt2"]
    wide = base.replace(ffn_hidden=8 * base.hidden)  # MLP inner 8h: GeLU input and output twice as large
    s, b, h = 1024, 1, base.hidden
    no_scores = dict(flash_attention=True)
    assert layer_activation_bytes(wide, s, b, **no_scores) - layer_activation_bytes(base, s, b, **no_scores) \
        == pytest.approx(16 * s * b * h)
    llama = KNOWN_MODELS["llama2-7b"]
    assert llama.gated_mlp and layer_activation_bytes(llama, 4096, 1, flash_attention=True) > \
        layer_activation_bytes(llama.replace(gated_mlp=False), 4096, 1, flash_attention=True)


def test_pipeline_schedules_hold_p_or_m_microbatches():
    """1F1B's first stage holds p micro-batches, GPipe's all m (Narayanan et al. 2021; Huang et al. 2019)."""
    assert in_flight_microbatches("1f1b", pp=4, microbatches=16) == 4
    assert in_flight_microbatches("gpipe", pp=4, microbatches=16) == 16
    assert in_flight_microbatches("1f1b", pp=8, microbatches=2) == 2
    assert in_flight_microbatches("1f1b", pp=1, microbatches=16) == 1

    model = KNOWN_MODELS["gpt2-xl"]
    cluster = ClusterSpec.with_devices(4)
    est = {sched: estimate(model, cluster, TrainingSpec(global_batch=16, schedule=sched), Layout("ddp", 1, 1, 4))
           for sched in ("1f1b", "gpipe")}
    per_layer = layer_activation_bytes(model, 1024, 1)
    assert est["1f1b"].activation_bytes == pytest.approx(4 * 12 * per_layer)  # p=4 micro-batches x 12 layers
    assert est["gpipe"].activation_bytes > 16 * 12 * per_layer  # all 16, plus the last stage's logits


def test_1f1b_first_stage_equals_the_unpipelined_model():
    """With 1F1B the first stage's activations do not shrink with p (Korthikanti et al., pipeline section)."""
    model = KNOWN_MODELS["gpt2-xl"]
    training = TrainingSpec(global_batch=32, flash_attention=True)
    one = estimate(model, ClusterSpec.with_devices(1), training, Layout("ddp", 1))
    per_layer = layer_activation_bytes(model, 1024, 1, flash_attention=True)
    for pp in (2, 4, 8):
        e = estimate(model, ClusterSpec.with_devices(pp), training, Layout("ddp", 1, 1, pp))
        assert e.activation_bytes >= model.layers * per_layer
        assert e.activation_bytes <= one.activation_bytes


def test_checkpointing_keeps_layer_inputs_plus_one_recomputed_layer():
    model = KNOWN_MODELS["llama2-7b"]
    cluster = ClusterSpec.with_devices(8)
    est = estimate(model, cluster, TrainingSpec(activation_checkpointing=True, flash_attention=True),
                   Layout("zero3", 8))
    s, h = 4096, model.hidden
    inputs = model.layers * 2 * s * h
    logits = 4 * s * h + 4 * s * model.vocab
    assert est.activation_bytes == inputs + logits
    assert est.buffers["recomputed layer"] == pytest.approx(layer_activation_bytes(model, s, 1, flash_attention=True))


def test_fp32_doubles_the_16_bit_activations_but_not_the_fp32_logits():
    model = KNOWN_MODELS["gpt2"]
    cluster = ClusterSpec.with_devices(1)
    a16 = estimate(model, cluster, TrainingSpec(precision="bf16-mixed"), Layout("ddp", 1)).activation_bytes
    a32 = estimate(model, cluster, TrainingSpec(precision="fp32"), Layout("ddp", 1)).activation_bytes
    logits = 4 * model.seq_len * 1 * model.vocab  # fp32 for cross entropy in either precision, counted once
    assert a32 == pytest.approx(2 * a16 - logits, abs=2)
