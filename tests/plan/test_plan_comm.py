"""Bytes each device sends per step, and the alpha-beta cost of the collectives."""
from __future__ import annotations

import math

import pytest

from shardwise.plan import (
    ClusterSpec,
    Layout,
    ModelSpec,
    TrainingSpec,
    bytes_sent,
    collective_time,
    estimate,
    group_link,
    shard_numel,
    sharded_numel,
)
from shardwise.plan.comm import Link

pytestmark = pytest.mark.timeout(60)

NUMEL = 1_000_003  # not divisible by the rank counts below


def _est(strategy: str, n: int, precision: str = "fp32", **kw: object):
    model = ModelSpec(name="m", params=NUMEL)
    return estimate(model, ClusterSpec.with_devices(n), TrainingSpec(precision=precision, **kw), Layout(strategy, n))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_data_parallel_volumes_are_the_zero_papers(n):
    """2 Psi for DDP, ZeRO-1 and ZeRO-2, 3 Psi for ZeRO-3 (Rajbhandari et al. 2020, section 7),
    as the ring algorithms send them: 2(N-1)/N and 3(N-1)/N of the buffer per rank."""
    g = 4 * NUMEL
    part = 4 * shard_numel(NUMEL, n)
    assert _est("ddp", n).comm_bytes_per_step == 2 * (n - 1) * g // n
    assert _est("ddp", n).comm_bytes_by_kind == {"all_reduce": 2 * (n - 1) * g // n}
    for name in ("zero1", "zero2"):
        e = _est(name, n)
        assert e.comm_bytes_by_kind == {"reduce_scatter": (n - 1) * part, "all_gather": (n - 1) * part}
    for name in ("zero3", "fsdp"):
        e = _est(name, n)
        assert e.comm_bytes_by_kind == {"all_gather": 2 * (n - 1) * part, "reduce_scatter": (n - 1) * part}
        assert e.comm_bytes_per_step == 3 * (n - 1) * part


def test_bf16_moves_half_the_bytes():
    assert _est("zero3", 4, "bf16-mixed").comm_bytes_per_step * 2 == pytest.approx(
        _est("zero3", 4, "fp32").comm_bytes_per_step, rel=1e-5)


def test_accumulation_multiplies_only_what_must_repeat():
    """ddp/zero1 reduce once per step (no_sync); zero2 reduce-scatters and zero3 gathers every micro-batch."""
    for name, factor in (("ddp", 1), ("zero1", 1), ("zero3", 4)):
        one, four = _est(name, 4, global_batch=4), _est(name, 4, global_batch=16)
        assert four.microbatches == 4
        assert four.comm_bytes_per_step == factor * one.comm_bytes_per_step
    one, four = _est("zero2", 4, global_batch=4), _est("zero2", 4, global_batch=16)
    assert four.comm_bytes_by_kind["reduce_scatter"] == 4 * one.comm_bytes_by_kind["reduce_scatter"]
    assert four.comm_bytes_by_kind["all_gather"] == one.comm_bytes_by_kind["all_gather"]


def test_no_sync_reduces_once_but_holds_full_gradients():
    """Accumulating under no_sync (our trainer's way): one reduce-scatter per step, the full gradients
    held meanwhile; without it ZeRO-2/3 reduce-scatter every micro-batch and keep only shards."""
    for name in ("zero2", "zero3"):
        each = _est(name, 4, global_batch=16)
        once = _est(name, 4, global_batch=16, no_sync=True)
        assert each.comm_bytes_by_kind["reduce_scatter"] == 4 * once.comm_bytes_by_kind["reduce_scatter"]
        assert each.comm_bytes_by_kind["all_gather"] == once.comm_bytes_by_kind["all_gather"]
        assert once.grads_bytes == each.grads_bytes + 4 * NUMEL
    # One micro-batch per step: nothing to accumulate, nothing held.
    assert _est("zero3", 4, no_sync=True).grads_bytes == _est("zero3", 4).grads_bytes


def test_shards_are_padded_per_parameter_for_real_modules():
    """Our ZeRO/FSDP pad every parameter to a multiple of N (shardwise.parallel.dp.sharding)."""
    sizes = (10, 3, 7)
    model = ModelSpec(name="m", params=sum(sizes), param_numels=sizes)
    e = estimate(model, ClusterSpec.with_devices(4), TrainingSpec(precision="fp32"), Layout("zero3", 4))
    per_rank = sharded_numel(sizes, 4)
    assert per_rank == 3 + 1 + 2 > shard_numel(20, 4)
    assert e.params_bytes == 4 * per_rank
    assert e.comm_bytes_by_kind == {"all_gather": 2 * 3 * 4 * per_rank, "reduce_scatter": 3 * 4 * per_rank}


def test_hsdp_reduces_inside_the_node_and_all_reduces_shards_across():
    model = ModelSpec(name="m", params=NUMEL)
    cluster = ClusterSpec.with_devices(16)  # 2 nodes of 8
    e = estimate(model, cluster, TrainingSpec(precision="fp32"), Layout("hsdp", 16, shard_group=8))
    part = 4 * shard_numel(NUMEL, 8)
    by_group = {(c.kind, c.group): c for c in e.collectives}
    assert by_group[("reduce_scatter", "dp_shard")].bytes_sent == 7 * part
    assert by_group[("all_reduce", "dp_replicate")].bytes_sent == part  # 2 (r-1)/r with r = 2
    assert not by_group[("all_gather", "dp_shard")].ranks > 8
    assert e.model_states_bytes == 4 * 4 * shard_numel(NUMEL, 8)


def test_alpha_beta_times():
    link = Link(bandwidth=100e9, latency=5e-6, spans_nodes=False)
    s = 1e9
    assert collective_time("all_reduce", s, 8, link) == pytest.approx(2 * 3 * 5e-6 + 2 * 7 / 8 * s / 100e9)
    assert collective_time("all_gather", s, 8, link) == pytest.approx(3 * 5e-6 + 7 / 8 * s / 100e9)
    assert collective_time("reduce_scatter", s, 1, link) == 0
    assert collective_time("send_recv", s, 2, link) == pytest.approx(5e-6 + s / 100e9)
    assert bytes_sent("all_reduce", 1000, 4) == 1500
    assert bytes_sent("all_gather", 1000, 4) == 750
    assert bytes_sent("all_reduce", 1000, 1) == 0


def test_links_inside_and_across_nodes():
    c = ClusterSpec(devices_per_node=8, nodes=4, intra_bw=450e9, inter_bw=50e9)
    assert group_link(c, 8, 1).bandwidth == 450e9  # tp or dp inside a node
    assert not group_link(c, 4, 2).spans_nodes
    across = group_link(c, 32, 1)  # 8 ranks per node share 8 NICs
    assert across.spans_nodes and across.bandwidth == min(450e9, 8 * 50e9)
    assert group_link(c, 4, 8).bandwidth == 50e9  # one rank per node: one NIC
    assert group_link(c, 16, 2).bandwidth == 4 * 50e9  # dp next to tp=2: 4 ranks per node
    assert group_link(c, 4, 8).latency == c.inter_latency_s


def test_tensor_parallel_traffic_per_layer():
    """Four all-reduces of s*b*h activations per layer and micro-batch, six with recomputation
    (Shoeybi et al. 2019); sequence parallelism swaps each for reduce-scatter + all-gather."""
    model = ModelSpec.transformer(layers=4, hidden=1024, heads=16, vocab=1000, seq_len=512)
    cluster = ClusterSpec.with_devices(4)
    act = 512 * 1 * 1024 * 2
    plain = estimate(model, cluster, TrainingSpec(global_batch=1), Layout("ddp", 1, tp=4))
    assert plain.comm_bytes_by_kind == {"all_reduce": 4 * 4 * (2 * 3 * act // 4)}
    ckpt = estimate(model, cluster, TrainingSpec(global_batch=1, activation_checkpointing=True),
                    Layout("ddp", 1, tp=4))
    assert ckpt.comm_bytes_per_step == 6 * 4 * (2 * 3 * act // 4)
    sp = estimate(model, cluster, TrainingSpec(global_batch=1, sequence_parallel=True), Layout("ddp", 1, tp=4))
    assert sp.comm_bytes_per_step == plain.comm_bytes_per_step
    assert set(sp.comm_bytes_by_kind) == {"all_gather", "reduce_scatter"}


def test_pipeline_sends_activations_and_gradients():
    model = ModelSpec.transformer(layers=8, hidden=1024, heads=16, vocab=1000, seq_len=512)
    cluster = ClusterSpec.with_devices(8)
    e = estimate(model, cluster, TrainingSpec(global_batch=8), Layout("ddp", 1, tp=2, pp=4))
    (p2p,) = [c for c in e.collectives if c.kind == "send_recv"]
    act = 512 * 1024 * 2
    assert p2p.bytes_sent == 2 * e.microbatches * math.ceil(act / 2)  # each tp rank sends its half
