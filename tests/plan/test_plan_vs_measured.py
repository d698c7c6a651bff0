"""The planner's predictions against what our training runs count, rank by rank."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.dims import CP, DP_CP, DP_SHARD_CP, PP, TP
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.plan import (
    ClusterSpec,
    Layout,
    ModelSpec,
    TrainingSpec,
    estimate,
    plan_run,
    rank_states,
)
from shardwise.plan.comm import Collective, bytes_sent, data_parallel_collectives
from shardwise.plan.memory import bytes_per_param
from shardwise.plan.run import microbatches, planner_layout, training_spec
from shardwise.plan.states import busiest, local_chunks, zero_stage
from shardwise.strategies.registry import available_strategies
from shardwise.workloads import CharText, digits, stdlib_text

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_predicted_bytes_equal_counted(strategy, devices):
    if strategy not in available_strategies():
        pytest.skip(f"{strategy} is not in this build")
    work = digits()
    run = sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
        work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3),
        batch_size=64, max_steps=2)
    est = estimate(ModelSpec.from_module(work.make_model()), ClusterSpec.with_devices(devices),
                   TrainingSpec(precision="fp32", optimizer="adamw", global_batch=64, micro_batch=64 // devices),
                   Layout(strategy, devices))
    # The planner predicts the busiest rank: ZeRO-1/2 keep small padded copies of
    # pieces cut short by a parameter's end, and which rank holds them varies.
    assert max(s["params_bytes"] for s in run.stats) == est.params_bytes
    for s in run.stats:
        assert s["optimizer_bytes"] == est.optimizer_bytes
        assert s["grads_bytes"] == est.grads_bytes
        assert s["comm_bytes_per_step"] == est.comm_bytes_per_step


# ---- composed layouts: FSDP with tensor and pipeline parallelism -------------
def make_gpt() -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))
    for b in m.blocks:
        b.attn.k.bias.requires_grad_(False)  # a frozen parameter: whole on every rank, and tp-sliced
    return m


# name -> (strategy factory, devices); factories, so collecting the tests builds nothing.
COMPOSED: dict[str, tuple[Callable[[], sw.Strategy], int]] = {
    "fsdp-tp": (lambda: sw.Parallel(dp=2, tp=2, zero=3), 4),
    "fsdp-pp-gpipe": (lambda: sw.Parallel(dp=2, pp=2, zero=3, schedule="gpipe"), 4),
    "fsdp-pp-1f1b": (lambda: sw.Parallel(dp=2, pp=2, zero=3, schedule="1f1b"), 4),
    "fsdp-tp-pp": (lambda: sw.Parallel(dp=2, tp=2, pp=2, zero=3), 8),
    "hsdp-tp": (lambda: sw.Parallel(dp=4, tp=2, zero=3, replicate=2), 8),
    "fsdp-pp-interleaved": (lambda: sw.Parallel(dp=2, pp=2, zero=3, chunks=2, schedule="interleaved"), 4),
    "zero1-pp": (lambda: sw.Parallel(dp=2, pp=2, zero=1), 4),
}


def _fit(strategy: sw.Strategy, devices: int, make: Callable[[], nn.Module], loss, steps: int = 1) -> sw.FitResult:
    # Two micro-batches per step and clipping: the count follows a full step with accumulation.
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=2,
                      gradient_clip_val=1.0).fit(make(), CharText(stdlib_text(20_000), 16), loss,
                                                 functools.partial(torch.optim.AdamW, lr=1e-3), batch_size=8,
                                                 max_steps=steps)


def _assert_planned(run: sw.FitResult, strategy: sw.Strategy, devices: int, make: Callable[[], nn.Module]) -> None:
    planned = rank_states(make(), strategy.describe(devices), "adamw")
    stats = sorted(run.stats, key=lambda s: s["rank"])
    # Every rank, every kind of state, to the byte (ranks in mesh order pp, dp, tp).
    assert [{k: s[k] for k in p.as_stats()} for s, p in zip(stats, planned, strict=True)] == \
        [p.as_stats() for p in planned]
    top = busiest(planned)
    assert max(s["model_state_bytes"] for s in stats) == top.total
    assert all(s["model_state_bytes"] <= top.total for s in stats)
    # The Trainer's memory check plans the same busiest rank.
    plan = plan_run(make(), strategy.describe(devices), 10**12, 8, "adamw", accumulate_grad_batches=2)
    assert plan.states == top


@pytest.mark.parametrize("name", list(COMPOSED))
def test_composed_layouts_counted_equal_planned(name):
    factory, devices = COMPOSED[name]
    _assert_planned(_fit(factory(), devices, make_gpt, lm_loss), factory(), devices, make_gpt)


@pytest.mark.parametrize("family,factory", [
    ("gpt2", lambda: sw.Parallel(dp=2, tp=2, zero=3)),
    ("gpt2", lambda: sw.Parallel(dp=2, pp=2, zero=3)),   # the tied embedding lives on both stages
    ("llama", lambda: sw.Parallel(dp=2, pp=2, zero=3)),
], ids=["gpt2-fsdp-tp", "gpt2-fsdp-pp-tied", "llama-fsdp-pp"])
def test_hf_composed_layouts_counted_equal_planned(family, factory):
    pytest.importorskip("transformers")
    import tiny_hf

    make = getattr(tiny_hf, family)
    _assert_planned(_fit(factory(), 4, make, tiny_hf.logits_loss), factory(), 4, make)


# ---- context and sequence parallelism: bytes per group label, every rank, one step ----------------
# Each layout runs for one step and for two: the difference is one training step's bytes per group label,
# free of what a run does once (rank 0's broadcast of the initial weights, the final gather of the full state
# dict; both are in both runs). The label "world" is the losses' all-reduce after training ("metrics.losses"),
# not a training collective, and is left out. A global batch of 8 sequences of 16 tokens in 2 micro-batches:
# 4 sequences per micro-batch (2 with dp = 2), fp32. Planned and counted (bytes per rank and step):
#   cp2-ring       cp 131072 = 131072, dp_cp 136704 = 136704
#   cp2-ulysses    cp 65536 = 65536, dp_cp 136704 = 136704
#   cp2-dp2-zero3  cp 65536 = 65536, dp_shard_cp 512640 + 12 (clipping) = 512652
#   cp2-tp2        cp 65536 = 65536, dp_cp 70272 = 70272, tp 65536 + 32776 (embedding, head, clipping) = 98312
#   tp2-sp         tp 131072 + 71176 (embedding, head, positions, 3584 of sp_grads, clipping) = 202248
CP_LAYOUTS: dict[str, tuple[Callable[[], sw.Strategy], int]] = {
    "cp2-ring": (lambda: sw.Parallel(cp=2), 2),
    "cp2-ulysses": (lambda: sw.Parallel(cp=2, cp_mode="ulysses"), 2),
    "cp2-dp2-zero3": (lambda: sw.Parallel(dp=2, cp=2, zero=3), 4),
    "cp2-tp2": (lambda: sw.Parallel(cp=2, tp=2), 4),
    "tp2-sp": (lambda: sw.Parallel(tp=2, sequence_parallel=True), 2),
}
CLIP_SCALAR = 8  # the clipper's squared norm, one float64 (shardwise.parallel.clip.clip_global_norm)


def make_trainable_gpt() -> GPT:
    """make_gpt without its frozen biases: the formula planner reduces every parameter of
    ``ModelSpec.from_module`` (frozen ones included), our data-parallel wrappers only the trainable ones."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))


def _step_bytes(one: sw.FitResult, two: sw.FitResult) -> list[dict[str, int]]:
    """Per rank (rank order), the bytes of one training step by group label: two steps minus one."""
    out = []
    for a, b in zip(sorted(one.stats, key=lambda s: s["rank"]), sorted(two.stats, key=lambda s: s["rank"]),
                    strict=True):
        diff = {k: v - a["comm_by_group"].get(k, 0) for k, v in b["comm_by_group"].items() if k != "world"}
        out.append({k: v for k, v in diff.items() if v})
    return out


def _planned_step_bytes(make: Callable[[], nn.Module], strategy: sw.Strategy, devices: int
                        ) -> tuple[dict[str, int], dict[str, int]]:
    """The planner's bytes per group label for one step of this run, and what it leaves out (exact, by label).

    tp, cp (and pp) traffic is the planner's estimate for the run's layout, micro-batches and precision.
    The data-parallel labels come from the planner's data-parallel model (plan.comm.data_parallel_collectives)
    given the trainable parameters a rank holds after the tp split (plan.states.local_chunks): with tp > 1 the
    estimate itself counts ceil(P / t) per rank, its docstring's approximation that ignores the replicated
    norms, biases and position embeddings (here 17088 elements instead of 17568).
    """
    layout = strategy.describe(devices)
    local = 8 // layout.dp
    m = microbatches(layout, local, 2)
    training = training_spec(layout, local, m, 2)
    lay = planner_layout(layout)
    spec = ModelSpec.from_module(make())
    cluster = ClusterSpec.with_devices(lay.devices)
    est = estimate(spec, cluster, training, lay)
    model_parallel = _by_group(c for c in est.collectives if c.group in (TP, CP, PP))
    numels = [p.numel for p in local_chunks(make(), layout)[0][0] if p.trainable]
    bpp = bytes_per_param(training.states_precision, training.optimizer, training.fp32_grads)
    data_parallel = _by_group(data_parallel_collectives(spec, cluster, training, lay, numels, bpp, m))
    if lay.tp == 1:  # the estimate is exact here: the module's own parameter sizes, padded one by one
        assert _by_group(c for c in est.collectives if c.group not in (TP, CP, PP)) == data_parallel
    planned = {**model_parallel, **data_parallel}

    # What the planner does not count, from the runtime's own collectives (per micro-batch unless said):
    t, cp, e = lay.tp, lay.cp, 4
    s, b, h, v = spec.seq_len, training.micro_batch, spec.hidden, spec.vocab
    act = (s // cp) * b * h * e  # one activation of this rank's tokens
    extra: dict[str, int] = {}
    if t > 1:
        # Outside the blocks the planner's 4 all-reduces per layer omit: the vocabulary-parallel embedding's
        # sum ("tp.g"; under SP a reduce-scatter and its all-gather, the same bytes), the head's input ("tp.f";
        # under SP the exit all-gather and its reduce-scatter) and the head's logits, all-gathered ("tp.gather").
        per_mb = 2 * bytes_sent("all_reduce", act, t) + bytes_sent("all_gather", (s // cp) * b * v * e, t)
        if lay.sequence_parallel:
            # The position embeddings' rows are split over tp ("tp.sp_scatter"): their gradient is all-gathered,
            # (T, h) with no batch dimension. The norms' weights and the row-parallel biases see this rank's
            # tokens only: their gradients are summed over tp in every backward ("sp_grads.<module>").
            per_mb += bytes_sent("all_gather", (s // cp) * h * e, t)
            per_mb += sum(bytes_sent("all_reduce", n * e, t) for n in sp_grad_numels(make()))
        extra[TP] = m * per_mb + bytes_sent("all_reduce", CLIP_SCALAR, t)  # clipping sums the norm over tp
    if zero_stage(layout) == 3:
        n = lay.dp * cp  # the shards' squared norms are summed over dp_shard x cp ("zero_clip")
        extra[DP_SHARD_CP] = bytes_sent("all_reduce", CLIP_SCALAR, n)
    return planned, extra


def _by_group(collectives: Iterable[Collective]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in collectives:
        out[c.group] = out.get(c.group, 0) + c.bytes_sent
    return out


def sp_grad_numels(model: GPT) -> list[int]:
    """Sizes of the parameters sequence parallelism sums over tp in GPT: its norms (the layout's ``norms``) and
    its row-parallel layers' biases."""
    out = []
    for blk in model.blocks:
        out += [p.numel() for p in (*blk.ln1.parameters(), *blk.ln2.parameters(), blk.attn.proj.bias, blk.mlp.fc2.bias)]
    return out + [p.numel() for p in model.ln_f.parameters()]


@pytest.mark.parametrize("name", list(CP_LAYOUTS))
def test_cp_and_sp_bytes_per_group_counted_equal_planned(name):
    factory, devices = CP_LAYOUTS[name]
    one = _fit(factory(), devices, make_trainable_gpt, lm_loss)
    two = _fit(factory(), devices, make_trainable_gpt, lm_loss, steps=2)
    planned, extra = _planned_step_bytes(make_trainable_gpt, factory(), devices)
    want = {k: planned.get(k, 0) + extra.get(k, 0) for k in planned.keys() | extra.keys()}
    measured = _step_bytes(one, two)
    assert measured == [want] * devices, (planned, extra)
    lay = factory().describe(devices)
    # The cp label is the planner's alone (nothing unmodelled), and the gradients go over the flattened groups.
    if lay.cp > 1:
        assert CP not in extra and planned[CP] > 0
        assert (DP_SHARD_CP if zero_stage(lay) == 3 else DP_CP) in planned
    if lay.sequence_parallel:
        sp = [b["comm_by_name"].get("sp_grads", 0) - a["comm_by_name"].get("sp_grads", 0)
              for a, b in zip(*(sorted(r.stats, key=lambda x: x["rank"]) for r in (one, two)), strict=True)]
        assert sp == [2 * sum(bytes_sent("all_reduce", n * 4, 2) for n in sp_grad_numels(make_trainable_gpt()))] * 2
    # Model states as for the composed layouts: every rank, to the byte.
    _assert_planned(one, factory(), devices, make_trainable_gpt)
