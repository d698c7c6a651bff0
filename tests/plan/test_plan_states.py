"""Exact model-state layout of a real module under a RunLayout (no process is started here).

tests/plan/test_plan_vs_measured.py checks the same functions against what real
runs count; these pin down the rules on models small enough to count by hand.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.layout import RunLayout
from shardwise.models import GPT, GPTConfig
from shardwise.plan import (
    ClusterSpec,
    Layout,
    ModelSpec,
    NotModelled,
    TrainingSpec,
    estimate,
    plan_run,
    rank_states,
)
from shardwise.plan.estimate import check_layout
from shardwise.plan.states import busiest, local_chunks, optimizer_states

pytestmark = pytest.mark.timeout(60)


def seq(*shapes: tuple[int, int]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(i, o) for i, o in shapes))


def test_fsdp_pads_every_parameter_to_the_shard_group():
    model = seq((10, 3), (3, 5))  # weights 30 and 15, biases 3 and 5
    states = rank_states(model, sw.Parallel(dp=4, zero=3).describe(4))
    row = 8 + 1 + 4 + 2  # ceil(numel / 4) each
    assert {s.as_stats()["params_bytes"] for s in states} == {4 * row}
    assert (states[0].grads, states[0].optimizer) == (4 * row, 2 * 4 * row)  # AdamW: two states per element


def test_hsdp_shards_over_dp_over_replicate():
    model = seq((10, 3))
    hsdp = rank_states(model, sw.Parallel(dp=4, zero=3, replicate=2).describe(4))[0]
    assert hsdp.params == 4 * (15 + 2)  # ceil(30/2) + ceil(3/2): shards of 2, not of 4


def test_frozen_parameters_stay_whole_and_have_no_state():
    model = seq((10, 3))
    model[0].bias.requires_grad_(False)
    s = rank_states(model, sw.Parallel(dp=2, zero=3).describe(2))[0]
    assert (s.params, s.grads, s.optimizer) == (4 * (15 + 3), 4 * 15, 8 * 15)


def test_pipeline_stages_and_interleaved_chunks():
    model = seq((8, 8), (8, 8), (8, 8), (8, 8))  # four equal layers of 72
    lay = sw.Parallel(dp=1, pp=2, chunks=2, schedule="interleaved").describe(2)
    chunks = local_chunks(model, lay)
    # Rank r keeps virtual stages r and r + 2: one layer in each of its two chunks.
    assert [[sum(p.numel for p in c) for c in cs] for cs in chunks] == [[72, 72], [72, 72]]
    assert rank_states(model, lay)[0].params == 4 * 144


def test_gpt_3d_layout_every_rank():
    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))

    states = rank_states(gpt(), sw.Parallel(dp=2, tp=2, pp=2, zero=3).describe(8))
    assert len(states) == 8
    # Mesh order (pp, dp, tp): the four ranks of a stage hold the same rows.
    assert len({states[i] for i in range(4)}) == 1 and len({states[i] for i in range(4, 8)}) == 1
    named = dict(gpt().named_parameters())
    # Not split by tp: the position embedding, the norms, the biases added after a row-parallel sum.
    kept = sum(p.numel() for n, p in named.items() if n.startswith(("pos_emb", "ln_f")) or ".ln" in n
               or n.endswith(("proj.bias", "fc2.bias")))
    split = sum(p.numel() for p in named.values()) - kept
    rows = sum(s.grads for s in (states[0], states[4])) // 4  # elements of one rank of each stage
    assert rows == split // 4 + kept // 2  # all sizes here divide evenly: no padding


def test_zero1_copies_depend_on_the_rank():
    model = seq((3, 3))  # 9 + 3: pieces of 5 and 2 over 2 ranks; rank 1's are cut short
    states = rank_states(model, RunLayout("zero1", dp=2, zero=1))
    assert states[0].params == 4 * 12 and states[1].params == 4 * (12 + 5 + 2)
    assert busiest(states) == states[1]


def test_optimizer_states_are_counted_from_the_optimizer():
    p = [nn.Parameter(torch.zeros(1))]
    assert optimizer_states(torch.optim.AdamW(p)) == 2
    assert optimizer_states(torch.optim.Adam(p, amsgrad=True)) == 3
    assert optimizer_states(torch.optim.SGD(p, lr=0.1)) == 0
    assert optimizer_states(torch.optim.SGD(p, lr=0.1, momentum=0.9)) == 1


def test_offload_moves_the_optimizer_to_the_host():
    model = seq((10, 10))
    on = rank_states(model, RunLayout("fsdp", dp=2, zero=3))[0]
    off = rank_states(model, RunLayout("fsdp", dp=2, zero=3, offload="optimizer"))[0]
    assert (off.params, off.grads, off.optimizer) == (on.params, 0, 0)
    assert off.host == on.params + on.grads + on.optimizer


def test_unknown_strategies_are_not_modelled():
    with pytest.raises(NotModelled, match="'mine'"):
        rank_states(seq((2, 2)), RunLayout("mine"))
    with pytest.raises(NotModelled, match="fewer than the 4 stages"):
        plan_run(seq((2, 2)), sw.Parallel(dp=1, pp=4).describe(4), 10**9, 4)


def test_run_plan_adds_activations_and_accumulated_gradients():
    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=64))

    lay = sw.Parallel(dp=2, pp=2, zero=3).describe(4)
    one = plan_run(gpt(), lay, 10**9, 8)  # two micro-batches per step (one per stage)
    assert one.activation_bytes > 0
    # The chunk's gradient sync is off until the last micro-batch: whole gradients are held meanwhile.
    assert one.buffers["unsharded gradients (accumulation)"] > one.states.grads
    ck = plan_run(gpt(), lay.with_run("32", True), 10**9, 8)
    assert ck.activation_bytes < one.activation_bytes and ck.states == one.states


def test_formula_planner_composes_fsdp_with_pipelines():
    model, cluster = ModelSpec.transformer(8, 1024, 16, vocab=32000, seq_len=1024), ClusterSpec.with_devices(8)
    training = TrainingSpec(global_batch=16)
    assert check_layout(model, cluster, training, Layout("fsdp", 2, 2, 2)) is None
    assert "fsdp does" in check_layout(model, cluster, training, Layout("zero3", 2, 2, 2))
    e = estimate(model, cluster, training, Layout("fsdp", 2, 2, 2))
    assert e.microbatches == 8
    # Reduce-scatter once per step (the pipeline accumulates unreduced), gathers every micro-batch.
    rs = [c for c in e.collectives if c.kind == "reduce_scatter"]
    ag = [c for c in e.collectives if c.kind == "all_gather"]
    assert rs and all(not c.per_microbatch for c in rs) and all(c.per_microbatch for c in ag)
    assert e.layout.code("gpipe") == "sw.Parallel(dp=2, tp=2, pp=2, zero=3, schedule='gpipe')"
    assert Layout("hsdp", 8, shard_group=4).code() == "sw.HSDP(shard_size=4)"
