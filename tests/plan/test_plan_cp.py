"""Context parallelism (cp, ring and Ulysses) and Megatron sequence parallelism in the planner.

Every expected number below is written from the formula it comes from (the
runtime's contract, the papers), not read back from the planner:

* ring attention (Liu et al. 2023): per attention layer and micro-batch, forward
  c-1 sends of the key block and of the value block, ``2 b (s/c) h_kv d e (c-1)``
  bytes (name ``cp.kv``); backward the same again plus c sends of their
  gradients (``cp.dkv``);
* Ulysses (Jacobs et al. 2023): 4 all-to-alls forward (q, k, v, output) and 4
  backward, each sending (c-1)/c of the local tensor; the paper's per-link
  volume is 4 N h / P;
* gradients are averaged over dp x cp: DDP under the label ``dp_cp``,
  ZeRO/FSDP sharded over ``dp_shard_cp``, HSDP's replicas under ``dp_replicate``;
* activations (Korthikanti et al. 2022, Table 2) are those of s/c tokens, the
  attention scores those of s/c queries against all s keys.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.layout import RunLayout
from shardwise.models import GPT, GPTConfig
from shardwise.plan.__main__ import main
from shardwise.plan.estimate import enumerate_layouts, estimate  # the function, not the lazily bound module
from shardwise.plan.memory import layer_activation_bytes, shard_numel
from shardwise.plan.model import ModelSpec
from shardwise.plan.run import plan_run, planner_layout
from shardwise.plan.specs import ClusterSpec, Layout, TrainingSpec
from shardwise.plan.states import rank_states

pytestmark = pytest.mark.timeout(60)

# 8 query heads of d = 32, 4 key/value heads (grouped-query attention), 2 layers, 1024 tokens.
SMALL = ModelSpec.transformer(layers=2, hidden=256, heads=8, kv_heads=4, vocab=1000, seq_len=1024)
D = 256 // 8


def _by_name(est) -> dict[tuple[str, str, str], int]:
    out: dict[tuple[str, str, str], int] = {}
    for c in est.collectives:
        key = (c.group, c.name, c.purpose)
        out[key] = out.get(key, 0) + c.bytes_sent
        assert c.bytes_received == c.bytes_sent  # every cp exchange receives what it sends
    return out


def _sent(est, group: str, name: str | None = None) -> int:
    return sum(c.bytes_sent for c in est.collectives if c.group == group and (name is None or c.name == name))


# ---- ring attention ---------------------------------------------------------------------------
@pytest.mark.parametrize("tp,c", [(1, 2), (1, 4), (2, 4), (2, 8)])
@pytest.mark.parametrize("b,m", [(1, 1), (2, 3)])
def test_ring_bytes_per_layer(tp, c, b, m):
    s, layers, e = 1024, 2, 2  # bf16 activations
    h_kv = 4 // tp  # kv heads this tp rank holds
    est = estimate(SMALL, ClusterSpec.with_devices(tp * c), TrainingSpec(global_batch=b * m, micro_batch=b),
                   Layout("ddp", 1, tp=tp, cp=c, cp_mode="ring"))
    assert est.microbatches == m
    block = b * (s // c) * h_kv * D * e
    forward = 2 * block * (c - 1)  # k and v, c-1 steps
    backward_kv = 2 * block * (c - 1)
    backward_dkv = 2 * block * c
    ring = [x for x in est.collectives if x.group == "cp"]
    assert {x.kind for x in ring} == {"send_recv"} and {x.name for x in ring} == {"cp.kv", "cp.dkv"}
    fwd = [x for x in ring if "forward" in x.purpose]
    assert sum(x.bytes_sent for x in fwd) == layers * m * forward
    assert sum(x.bytes_sent for x in fwd) == sum(x.calls for x in fwd) * block  # one block per send
    assert _sent(est, "cp", "cp.kv") == layers * m * (forward + backward_kv)
    assert _sent(est, "cp", "cp.dkv") == layers * m * backward_dkv
    _by_name(est)


def test_recomputation_replays_the_forward_sends():
    plain = estimate(SMALL, ClusterSpec.with_devices(4), TrainingSpec(global_batch=1), Layout("ddp", 1, cp=4))
    ckpt = estimate(SMALL, ClusterSpec.with_devices(4), TrainingSpec(global_batch=1, activation_checkpointing=True),
                    Layout("ddp", 1, cp=4))
    block = (1024 // 4) * 4 * D * 2
    assert _sent(ckpt, "cp", "cp.kv") - _sent(plain, "cp", "cp.kv") == 2 * 2 * block * 3  # one more forward
    assert _sent(ckpt, "cp", "cp.dkv") == _sent(plain, "cp", "cp.dkv")


# ---- Ulysses ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,c", [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4)])
def test_ulysses_bytes_per_layer(tp, c):
    s, layers, e, b = 1024, 2, 2, 1
    heads, h_kv = 8 // tp, 4 // tp
    est = estimate(SMALL, ClusterSpec.with_devices(tp * c), TrainingSpec(global_batch=1),
                   Layout("ddp", 1, tp=tp, cp=c, cp_mode="ulysses"))
    q = b * heads * (s // c) * D * e  # the output has the same shape
    kv = b * max(h_kv, c) * (s // c) * D * e  # kv heads replicated up to c when fewer
    per_layer = sum(x * (c - 1) // c for x in (q, kv, kv, q))  # (c-1)/c of each local tensor
    a2a = [x for x in est.collectives if x.group == "cp"]
    assert {(x.kind, x.name) for x in a2a} == {("all_to_all", "cp.a2a")}
    assert sum(x.calls for x in a2a) == 2 * 4 * layers  # 4 forward, their 4 mirrors backward
    for direction in ("forward", "backward"):
        assert sum(x.bytes_sent for x in a2a if direction in x.purpose) == layers * per_layer
    _by_name(est)


@pytest.mark.parametrize("c", [2, 4, 8])
def test_ulysses_volume_is_jacobs_4nh_over_p(c):
    """DeepSpeed-Ulysses (Jacobs et al. 2023, section 3.2): q, k, v and the output of N tokens of hidden size h
    move 4 N h / P elements per link; each rank keeps 1/P of what it holds, hence the (P-1)/P."""
    model = ModelSpec.transformer(layers=1, hidden=256, heads=8, vocab=1000, seq_len=1024)  # no GQA
    est = estimate(model, ClusterSpec.with_devices(c), TrainingSpec(global_batch=1), Layout("ddp", 1, cp=c,
                                                                                            cp_mode="ulysses"))
    n, h, e = 1024, 256, 2
    forward = sum(x.bytes_sent for x in est.collectives if x.group == "cp" and "forward" in x.purpose)
    assert forward == (c - 1) * 4 * n * h * e // (c * c)  # (P-1)/P x 4 N h / P elements, 2 bytes each


def test_ring_volume_stays_ulysses_falls_with_c():
    """Per rank, the ring moves about 2 s h_kv d per layer whatever c; Ulysses 4 s h / c."""
    ring = {c: _sent(estimate(SMALL, ClusterSpec.with_devices(c), TrainingSpec(global_batch=1),
                              Layout("ddp", 1, cp=c)), "cp") for c in (2, 8)}
    uly = {c: _sent(estimate(SMALL, ClusterSpec.with_devices(c), TrainingSpec(global_batch=1),
                             Layout("ddp", 1, cp=c, cp_mode="ulysses")), "cp") for c in (2, 8)}
    assert ring[8] > ring[2] and uly[8] < uly[2]


# ---- data parallelism over dp x cp ------------------------------------------------------------------
def _dp_est(layout: Layout, gb: int) -> object:
    return estimate(SMALL, ClusterSpec.with_devices(layout.devices), TrainingSpec(precision="fp32", global_batch=gb),
                    layout)


def test_ddp_all_reduces_over_dp_cp():
    p = SMALL.params
    for dp, c, label in ((2, 2, "dp_cp"), (4, 1, "dp")):
        n = dp * c
        est = _dp_est(Layout("ddp", dp, cp=c), dp)
        grads = [x for x in est.collectives if x.kind == "all_reduce"]
        assert {x.group for x in grads} == {label} and {x.ranks for x in grads} == {n}
        assert sum(x.bytes_sent for x in grads) == 2 * (n - 1) * (4 * p) // n
        assert est.model_states_bytes == 16 * p  # DDP: whole states on every rank, cp or not


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_zero_and_fsdp_shard_over_dp_shard_cp(strategy):
    p = SMALL.params
    dp, c = 2, 4
    n = dp * c
    part = 4 * shard_numel(p, n)  # fp32 bytes of one shard
    est = _dp_est(Layout(strategy, dp, cp=c), dp)
    dp_traffic = [x for x in est.collectives if x.group != "cp"]
    assert {x.group for x in dp_traffic} == {"dp_shard_cp"} and {x.ranks for x in dp_traffic} == {n}
    gathers = 2 if strategy == "fsdp" else 1  # FSDP gathers in forward and again in backward
    assert _sent(est, "dp_shard_cp") == (gathers + 1) * (n - 1) * part
    optimizer = 8 * shard_numel(p, n)
    assert est.optimizer_bytes == optimizer
    if strategy == "fsdp":
        assert est.model_states_bytes == 16 * shard_numel(p, n)
    # The same layout without cp keeps the label of before.
    assert {x.group for x in _dp_est(Layout(strategy, n), n).collectives} == {"dp"}


def test_hsdp_shards_over_dp_shard_cp_and_replicates_over_dp_replicate():
    p = SMALL.params
    est = _dp_est(Layout("hsdp", 4, cp=2, shard_group=2), 4)  # 2 replicas of 2 dp shards x 2 cp ranks
    n, r = 4, 2
    part = 4 * shard_numel(p, n)
    assert {x.group for x in est.collectives if x.group != "cp"} == {"dp_shard_cp", "dp_replicate"}
    rs = [x for x in est.collectives if x.kind == "reduce_scatter"]
    assert sum(x.bytes_sent for x in rs) == (n - 1) * part and {x.group for x in rs} == {"dp_shard_cp"}
    ar = [x for x in est.collectives if x.kind == "all_reduce"]
    assert sum(x.bytes_sent for x in ar) == 2 * (r - 1) * part // r and {x.group for x in ar} == {"dp_replicate"}
    assert est.model_states_bytes == 16 * shard_numel(p, n)
    plain = _dp_est(Layout("hsdp", 4, shard_group=2), 4)
    assert {x.group for x in plain.collectives} == {"dp_shard", "dp_replicate"}


# ---- activations: Korthikanti et al. 2022, Table 2, on s/c tokens ------------------------------------
# Their model configurations (Table 3): (heads, hidden, layers).
PAPER_MODELS = {"22B": (48, 6144, 64), "175B": (96, 12288, 96), "1T": (128, 25600, 160)}


@pytest.mark.parametrize("name", sorted(PAPER_MODELS))
@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_table_2_with_and_without_sequence_parallel_on_s_over_c_tokens(name, t, c):
    a, h, layers = PAPER_MODELS[name]
    model = ModelSpec.transformer(layers=layers, hidden=h, heads=a, vocab=51200, seq_len=2048)
    s, b = 2048, 1
    sbh = (s / c) * b * h  # this rank's tokens
    scores = 5 * a * s / (h * t)  # s/c queries against all s keys: (s/c) * s scores per head
    assert layer_activation_bytes(model, s, b, tp=t, cp=c) == pytest.approx(sbh * (10 + 24 / t + scores))
    assert layer_activation_bytes(model, s, b, tp=t, sequence_parallel=True, cp=c) == \
        pytest.approx(sbh * (4 + 30 / t + scores))  # shardwise's SP: the gathered q/k/v and fc1 inputs whole
    # The score term alone, per head: 5 bytes for each of (s/c) * s scores, a/t heads on this rank.
    with_scores = layer_activation_bytes(model, s, b, tp=t, sequence_parallel=True, cp=c)
    flash = layer_activation_bytes(model, s, b, tp=t, sequence_parallel=True, cp=c, flash_attention=True)
    assert with_scores - flash == pytest.approx(a / t * (5 * (s / c) * s - 4 * (s / c)))


def test_estimate_counts_table_2_for_a_cp_layout():
    a, h, layers = PAPER_MODELS["22B"]
    v, s, t, c = 51200, 2048, 8, 2
    model = ModelSpec.transformer(layers=layers, hidden=h, heads=a, vocab=v, seq_len=s)
    for sp in (False, True):
        est = estimate(model, ClusterSpec.with_devices(t * c), TrainingSpec(global_batch=1),
                       Layout("fsdp", 1, tp=t, cp=c, sequence_parallel=sp))
        tokens = s / c
        per_layer = tokens * h * ((4 + 30 / t) if sp else (10 + 24 / t)) + tokens * 5 * a * s / t
        output = 4 * tokens * h / (t if sp else 1) + 4 * tokens * v / t  # final norm input, fp32 logits
        assert est.activation_bytes == math.ceil(layers * per_layer + output)


def test_sequence_parallel_keeps_the_tp_bytes_and_counts_s_over_c_tokens():
    """Korthikanti et al. section 4.2.2: a reduce-scatter plus an all-gather move what one all-reduce did."""
    c, t = 2, 4
    training = TrainingSpec(global_batch=1)
    plain = estimate(SMALL, ClusterSpec.with_devices(8), training, Layout("ddp", 1, tp=t, cp=c))
    sp = estimate(SMALL, ClusterSpec.with_devices(8), training, Layout("ddp", 1, tp=t, cp=c, sequence_parallel=True))
    act = (1024 // c) * 256 * 2  # bytes of one activation of this rank's tokens
    assert _sent(plain, "tp") == _sent(sp, "tp") == 2 * 4 * 2 * (t - 1) * act // t  # 4 all-reduces x 2 layers
    assert {x.kind for x in sp.collectives if x.group == "tp"} == {"all_gather", "reduce_scatter"}
    assert sp.activation_bytes < plain.activation_bytes
    # The recipe's --sequence-parallel turns it on wherever tp > 1.
    asked = estimate(SMALL, ClusterSpec.with_devices(8), TrainingSpec(global_batch=1, sequence_parallel=True),
                     Layout("ddp", 1, tp=t, cp=c))
    assert asked.layout.sequence_parallel and asked.activation_bytes == sp.activation_bytes


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_memory_per_rank_falls_with_cp(mode):
    model = ModelSpec.transformer(layers=4, hidden=1024, heads=16, vocab=32000, seq_len=32768)
    training = TrainingSpec(global_batch=1, flash_attention=True)
    ests = {c: estimate(model, ClusterSpec.with_devices(c), training, Layout("fsdp", 1, cp=c, cp_mode=mode))
            for c in (1, 2, 4, 8)}
    for c in (2, 4, 8):
        # Every activation term is per token: c ranks hold 1/c each (to a byte of rounding).
        assert ests[c].activation_bytes == pytest.approx(ests[1].activation_bytes / c, abs=1)
        assert ests[c].model_states_bytes == pytest.approx(ests[1].model_states_bytes / c, rel=1e-6)  # FSDP over c
        assert ests[c].total_bytes < ests[c // 2].total_bytes


def test_ring_keeps_two_key_value_blocks_in_flight():
    est = estimate(SMALL, ClusterSpec.with_devices(8), TrainingSpec(global_batch=1, micro_batch=1),
                   Layout("ddp", 1, tp=2, cp=4))
    block = (1024 // 4) * (4 // 2) * D * 2  # one key (or value) block, bf16
    assert est.buffers["cp key/value blocks in flight"] == 2 * 2 * block


# ---- time ----------------------------------------------------------------------------------------
def test_compute_splits_over_cp():
    """Each cp rank computes s/c tokens: 2 P s + 4 l h s^2 forward FLOPs per sequence (Narayanan et al. 2021),
    divided by tp x cp."""
    cluster = ClusterSpec.with_devices(8)
    speed = cluster.flops("bf16-mixed")
    s, layers, h = 1024, 2, 256
    for tp, c in ((1, 8), (2, 4)):
        est = estimate(SMALL, cluster, TrainingSpec(global_batch=1), Layout("ddp", 1, tp=tp, cp=c))
        flops = 2 * SMALL.params * s + 4 * layers * h * s * s
        assert est.time.forward_s == pytest.approx(flops / (tp * c) / speed)


def test_ring_hides_behind_attention_and_ulysses_blocks():
    """Liu et al. 2023: the next block travels while the current one is computed. With links far faster than
    the attention compute nothing shows; with slow ones what is left is the traffic minus the compute."""
    lay = Layout("ddp", 1, cp=4)
    fast = ClusterSpec.with_devices(4, intra_bw=1e18, intra_latency_s=0.0)
    assert estimate(SMALL, fast, TrainingSpec(global_batch=1), lay).time.cp_exposed_s == 0
    slow = ClusterSpec.with_devices(4, intra_bw=1e6)
    est = estimate(SMALL, slow, TrainingSpec(global_batch=1), lay)
    ring = sum(x.time_s for x in est.collectives if x.group == "cp")
    attention = 3 * 4 * 2 * 256 * 1024 * 1024 / 4 / slow.flops("bf16-mixed")  # forward + backward (2x)
    assert est.time.cp_exposed_s == pytest.approx(ring - attention)
    uly = estimate(SMALL, slow, TrainingSpec(global_batch=1), Layout("ddp", 1, cp=4, cp_mode="ulysses"))
    a2a = sum(x.time_s for x in uly.collectives if x.group == "cp")
    assert uly.time.cp_exposed_s == 0 and uly.time.slot_comm_s == pytest.approx(a2a)


# ---- layouts ----------------------------------------------------------------------------------------
def test_layout_fields_label_and_code():
    lay = Layout("fsdp", 4, tp=2, cp=8, cp_mode="ulysses", sequence_parallel=True)
    assert (lay.devices, lay.shard_size) == (64, 32)
    assert lay.label == "fsdp dp4xcp8xtp2 (ulysses, sp)"
    assert lay.code() == "sw.Parallel(dp=4, tp=2, pp=1, zero=3, cp=8, cp_mode='ulysses', sequence_parallel=True)"
    assert Layout("ddp", 2, cp=4).cp_mode == "ring"  # sw.Parallel's default mode
    assert Layout("ddp", 2, cp=1, cp_mode="ring") == Layout("ddp", 2)
    assert Layout("hsdp", 8, cp=2, shard_group=4).label == "hsdp dp8xcp2 (shard 8, ring)"
    with pytest.raises(ValueError, match="cp_mode"):
        Layout("ddp", 2, cp=2, cp_mode="star")
    with pytest.raises(ValueError, match="tp > 1"):
        Layout("ddp", 2, sequence_parallel=True)


@pytest.mark.parametrize("layout", [
    Layout("ddp", 2, cp=2), Layout("zero1", 2, tp=2, cp=2, cp_mode="ulysses"),
    Layout("zero2", 1, cp=4, sequence_parallel=False), Layout("fsdp", 2, tp=2, cp=2, sequence_parallel=True),
    Layout("hsdp", 4, cp=2, shard_group=2), Layout("fsdp", 2, pp=2, cp=2),
], ids=lambda lay: lay.label)
def test_code_builds_the_layout(layout):
    """``Layout.code()`` is the strategy that builds it: its RunLayout maps back to the same Layout."""
    strategy = eval(layout.code(), {"sw": sw})  # noqa: S307 - our own generated code
    assert planner_layout(strategy.describe(layout.devices)) == layout


def test_planner_layout_maps_a_run():
    run = RunLayout("parallel", dp=2, tp=2, cp=4, zero=3, cp_mode="ulysses", sequence_parallel=True)
    assert planner_layout(run) == Layout("fsdp", 2, 2, 1, cp=4, cp_mode="ulysses", sequence_parallel=True)
    assert planner_layout(RunLayout("parallel", dp=2, cp=2, cp_mode="ring")).cp == 2
    assert not planner_layout(RunLayout("parallel", dp=2, sequence_parallel=True)).sequence_parallel  # no tp group


def test_enumerate_tries_powers_of_two_that_split_the_sequence():
    cluster = ClusterSpec(devices_per_node=12, nodes=1)  # 12 = 4 x 3: cp 3, 6 and 12 are not powers of two
    lays = enumerate_layouts(SMALL, cluster, TrainingSpec())
    assert {x.cp for x in lays} == {1, 2, 4}
    assert all(x.devices == 12 for x in lays)
    short = enumerate_layouts(SMALL, cluster, TrainingSpec(seq_len=12))  # 2 x 4 = 8 does not divide 12
    assert {x.cp for x in short} == {1, 2}
    assert {x.cp_mode for x in lays if x.cp > 1} == {"ring", "ulysses"}
    assert {x.cp_mode for x in lays if x.cp == 1} == {None}
    # Sequence parallelism is tried with and without where there is a tp group, never without one.
    assert not any(x.sequence_parallel for x in lays if x.tp == 1)
    for tp in {x.tp for x in lays if x.tp > 1}:
        assert {x.sequence_parallel for x in lays if x.tp == tp} == {False, True}
    assert all(x.sequence_parallel for x in enumerate_layouts(SMALL, cluster, TrainingSpec(sequence_parallel=True))
               if x.tp > 1)
    assert {x.cp for x in enumerate_layouts(SMALL, cluster, TrainingSpec(), max_cp=1)} == {1}
    assert {x.cp_mode for x in enumerate_layouts(SMALL, cluster, TrainingSpec(), cp_modes=["ring"])} == {None, "ring"}


def test_ulysses_needs_the_heads_to_split():
    model = ModelSpec.transformer(layers=2, hidden=384, heads=12, vocab=1000, seq_len=1024)
    lays = enumerate_layouts(model, ClusterSpec.with_devices(8), TrainingSpec())
    uly = {(x.tp, x.cp) for x in lays if x.cp_mode == "ulysses"}
    assert uly and all((12 // tp) % cp == 0 for tp, cp in uly)
    assert (1, 8) not in uly and (1, 8) in {(x.tp, x.cp) for x in lays if x.cp_mode == "ring"}


# ---- a real module under a cp run -------------------------------------------------------------------
def test_states_shard_over_dp_shard_cp_in_mesh_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3))  # 9 + 3: over 4 ranks, pieces of 3 and 1; the last rank's are short
    states = rank_states(model, RunLayout("zero1", dp=2, zero=1, cp=2))
    # Rank order (dp, cp): the last rank is dp_shard_cp rank 3, the one whose pieces are padded copies.
    assert [s.params for s in states] == [4 * 12] * 3 + [4 * (12 + 3 + 1)]
    assert {s.optimizer for s in states} == {2 * 4 * (3 + 1)}
    fsdp = rank_states(model, RunLayout("fsdp", dp=2, zero=3, cp=2))
    assert {s.params for s in fsdp} == {4 * (3 + 1)} and len(fsdp) == 4


def test_plan_run_of_a_cp_run():
    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64))

    one = plan_run(gpt(), sw.Parallel(dp=2, zero=3).describe(2), 10**9, 8)
    two = plan_run(gpt(), sw.Parallel(dp=2, cp=2, zero=3).describe(4), 10**9, 8)
    assert two.activation_bytes == pytest.approx(one.activation_bytes / 2, abs=1)  # s/2 tokens per rank
    assert two.states.params == sum(shard_numel(p.numel(), 4) for p in gpt().parameters()) * 4
    assert "cp=2 (ring)" in two.summary()


# ---- the command line: 8B parameters, 128k tokens, 64 GPUs -------------------------------------------
LONG = ["--params", "8e9", "--seq-len", "131072", "--devices", "64", "--flash-attention"]


def test_long_context_needs_cp(capsys):
    assert main([*LONG, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    spec = ModelSpec.from_params(8e9, seq_len=131072)  # the shape the planner guesses from the count
    s, h, a, v, layers = 131072, spec.hidden, spec.heads, spec.vocab, spec.layers
    available = rows[0]["available_bytes"]
    # Without cp even the leanest split keeps a whole model's layers of 128k tokens (1F1B's first stage holds
    # p micro-batches of l/p layers), at best s h 34/t bytes per layer (tp = 8 with sequence parallelism).
    floor = layers * s * h * 34 / 8
    assert floor > available
    no_cp = [r for r in rows if r["cp"] == 1]
    assert no_cp and not any(r["fits"] for r in no_cp)
    assert all(r["activation_bytes"] >= floor and r["largest_term"] == "activations" for r in no_cp)
    top = rows[0]
    assert top["recommended"] and top["fits"] and top["cp"] > 1
    assert "cp=" in top["code"] and top["code"].startswith("sw.Parallel(")
    # The fitting layouts' activations are Table 2's on s/c tokens (flash attention: 4 bytes of log-sum-exp
    # per head and query), plus the final norm and the fp32 logits.
    fitting = [r for r in rows if r["fits"]]
    assert fitting and all(r["cp"] > 1 for r in fitting)
    for r in (r for r in fitting if r["pp"] == 1):
        t, c, sp = r["tp"], r["cp"], r["sequence_parallel"]
        tokens = s / c
        per_layer = tokens * h * ((4 + 30 / t) if sp else (10 + 24 / t)) + tokens * 4 * a / t
        output = 4 * tokens * h / (t if sp else 1) + 4 * tokens * v / t
        assert r["activation_bytes"] == math.ceil(layers * per_layer + output), r["label"]


def test_long_context_table(capsys):
    assert main([*LONG, "--top", "5", "--width", "250"]) == 0
    out = capsys.readouterr().out
    rec = next(line for line in out.splitlines() if line.startswith("Recommended:"))
    assert "cp" in rec.split(" - ")[0] and "cp=" in out.split("why (per device):")[1]


def test_long_context_without_flash_attention_says_why(capsys):
    """Stored scores of 128k tokens, 5 a (s/c) s b bytes per layer, do not fit at any cp: the table says so."""
    assert main(["--params", "8e9", "--seq-len", "131072", "--devices", "64", "--top", "3"]) == 1
    out = capsys.readouterr().out
    assert "Nothing fits" in out and "--flash-attention" in out


def test_max_cp_and_modes_flags(capsys):
    assert main([*LONG, "--max-cp", "1", "--format", "json"]) == 1  # without cp nothing fits
    assert {r["cp"] for r in json.loads(capsys.readouterr().out)} == {1}
    assert main([*LONG, "--cp-modes", "ulysses", "--format", "json"]) == 0
    assert {r["cp_mode"] for r in json.loads(capsys.readouterr().out)} == {None, "ulysses"}
    assert main([*LONG, "--cp-modes", "star"]) == 2
    assert "unknown cp modes" in capsys.readouterr().err
