"""The planner's expert parallelism, by formula: the Mixtral shape, layouts, memory and all-to-alls."""
from __future__ import annotations

import pytest

from shardwise.dims import EDP, EP
from shardwise.plan import KNOWN_MODELS, ClusterSpec, Layout, TrainingSpec, enumerate_layouts, estimate
from shardwise.plan.comm import expert_rows_sent


def test_mixtral_counts_match_the_paper():
    m = KNOWN_MODELS["mixtral-8x7b"]
    # Jiang et al. 2024: 46.7B parameters, 12.9B active per token.
    assert round(m.params / 1e9, 1) == 46.7 and round(m.active_params / 1e9, 1) == 12.9
    assert m.expert_params == 32 * 8 * 3 * 4096 * 14336
    held, active = m.params_per_rank(ep=8)
    assert held == m.dense_params + m.expert_params // 8 and active == m.active_params


def test_layouts_try_ep_and_print_it():
    m = KNOWN_MODELS["mixtral-8x7b"]
    lays = enumerate_layouts(m, ClusterSpec.with_devices(8), TrainingSpec(), ["fsdp"], max_cp=1)
    assert {lay.ep for lay in lays if lay.tp == lay.pp == 1} == {1, 2, 4, 8}
    capped = enumerate_layouts(m, ClusterSpec.with_devices(8), TrainingSpec(), ["fsdp"], max_cp=1, max_ep=2)
    assert {lay.ep for lay in capped} == {1, 2}
    assert Layout("fsdp", 8, ep=4).code() == "sw.Parallel(dp=8, tp=1, pp=1, zero=3, ep=4)"
    with pytest.raises(ValueError):
        Layout("ddp", 6, ep=4)  # ep must divide dp x cp
    # A dense model gets no ep layouts.
    dense = enumerate_layouts(KNOWN_MODELS["llama2-7b"], ClusterSpec.with_devices(8), TrainingSpec(), ["fsdp"])
    assert all(lay.ep == 1 for lay in dense)


def test_expert_states_divide_by_ep_then_edp():
    m = KNOWN_MODELS["mixtral-8x7b"]
    c, t = ClusterSpec.with_devices(8, device_memory_bytes=10**15), TrainingSpec(precision="fp32", optimizer="sgd")
    for ep in (2, 4, 8):
        ddp = estimate(m, c, t, Layout("ddp", 8, ep=ep))
        assert ddp.params_bytes == 4 * (m.dense_params + m.expert_params // ep)
        z1 = estimate(m, c, t, Layout("zero1", 8, ep=ep))
        assert z1.params_bytes == ddp.params_bytes
        fsdp = estimate(m, c, t, Layout("fsdp", 8, ep=ep))
        assert fsdp.params_bytes == 4 * (-(-m.dense_params // 8) + -(-m.expert_params // ep // (8 // ep)))


def test_all_to_all_bytes_are_the_balanced_expectation():
    m = KNOWN_MODELS["mixtral-8x7b"]
    c, t = ClusterSpec.with_devices(8), TrainingSpec(micro_batch=2, seq_len=4096, global_batch=32)
    est = estimate(m, c, t, Layout("fsdp", 8, ep=4))
    by_name = {x.name: x for x in est.collectives if x.group == EP}
    calls = 32 * 2  # layers x micro-batches (32 / (8 x 2))
    rows = 2 * 4096 * 2 * 3 // 4
    assert by_name["ep_dispatch"].bytes_sent == calls * rows * 4096 * 2
    assert by_name["ep_dispatch_grad"].bytes_sent == by_name["ep_combine"].bytes_sent == calls * rows * 4096 * 2
    assert any(x.group == EDP for x in est.collectives)  # edp = 2: expert gradients reduced there
    assert expert_rows_sent(100, 2, 8, 4, capacity_factor=0.5) == 6 * 13  # C = ceil(0.5 x 200 / 8) = 13
    assert est.time.slot_comm_s > estimate(m, c, t, Layout("fsdp", 8)).time.slot_comm_s
