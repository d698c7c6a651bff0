"""Expert parallelism: equal to one device, exact token and byte counts, layout-free checkpoints.

Each layout trains shardwise's MoE GPT (4 experts, top-2) and Hugging Face
Mixtral (4 experts, top-2, 3-D expert weights) for two steps with two
accumulated micro-batches and gradient clipping, and must equal the
single-process run (float64). Routing is computed per token, so a token sent
to the wrong rank, an expert gradient averaged over the wrong group (a factor
of ep), or rows put back in the wrong order move the weights far beyond the
tolerance.
"""
from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from tiny_hf import logits_loss, mixtral, olmoe, qwen2_moe
from torch import nn

import shardwise as sw
from shardwise import checkpoint, launch
from shardwise.comm.collectives import Comm, CommStats
from shardwise.comm.topology import Topology
from shardwise.dims import DP, EDP, EP, ParallelDims
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.moe import Experts, MoE
from shardwise.parallel.dp.ddp import DDPModule
from shardwise.parallel.ep import ExpertParallel, apply_expert_parallel, capacity
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(600), pytest.mark.float64]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEQ, BATCH, STEPS, ACC = 16, 8, 2, 2
LAYERS, TOP_K = 2, 2


def moe_gpt(aux: float = 0.0, bias_rate: float = 0.0, score: str = "softmax") -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=SEQ, n_layer=LAYERS, n_head=4, n_embd=32, n_experts=4,
                         top_k=TOP_K, aux_loss_coef=aux, bias_update_rate=bias_rate, moe_score=score))


MODELS = {
    "gpt": (moe_gpt, lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3)),
    "gpt-aux": (functools.partial(moe_gpt, 0.05), lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3)),
    # DeepSeek-V3's routing: sigmoid scores, and the auxiliary-loss-free bias (a large rate, so it moves routes).
    "gpt-bias": (functools.partial(moe_gpt, 0.0, 0.05, "sigmoid"), lm_loss,
                 functools.partial(torch.optim.AdamW, lr=1e-3)),
    "mixtral": (mixtral, logits_loss, functools.partial(torch.optim.AdamW, lr=1e-3)),
    "qwen2_moe": (qwen2_moe, logits_loss, functools.partial(torch.optim.AdamW, lr=1e-3)),
    "olmoe": (olmoe, logits_loss, functools.partial(torch.optim.AdamW, lr=1e-3)),
}
LAYOUTS = {
    "ep2": (lambda: sw.Parallel(ep=2), 2),
    "ep4": (lambda: sw.Parallel(ep=4), 4),
    "ep2-dp4-zero3": (lambda: sw.Parallel(ep=2, zero=3), 4),
    "ep2-pp2": (lambda: sw.Parallel(ep=2, pp=2), 4),
    "ep2-tp2": (lambda: sw.Parallel(ep=2, tp=2), 4),
}


def fit(model: str, strategy: object, devices: int, **kw: object) -> sw.FitResult:
    make, loss, opt = MODELS[model]
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=ACC,
                      gradient_clip_val=0.05, **kw).fit(
        make(), CharText(stdlib_text(20_000), SEQ), loss, opt, batch_size=BATCH, max_steps=STEPS)


_refs: dict[str, sw.FitResult] = {}


def reference(model: str) -> sw.FitResult:
    if model not in _refs:
        _refs[model] = fit(model, "single", 1)
    return _refs[model]


def dispatched(run: sw.FitResult) -> int:
    return sum(s["counters"].get("moe_dispatched", 0) for s in run.stats)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", ["gpt", "mixtral"])
def test_expert_parallel_equals_single_device(model, layout, same_run):
    make, devices = LAYOUTS[layout]
    run = fit(model, make(), devices)
    same_run(reference(model), run)
    assert all(s["comm_by_name"].get("ep_dispatch", 0) > 0 for s in run.stats)  # tokens did cross the ep ranks
    # Every token's k slots are dispatched once per MoE layer per step: k * T, whatever the layout (tp ranks
    # each dispatch their copy of the same tokens; pp stages each their own layers).
    tp = 2 if layout.endswith("tp2") else 1
    assert dispatched(run) == STEPS * BATCH * SEQ * TOP_K * LAYERS * tp


def test_fit_reports_dropped_tokens_in_its_stats():
    """What a user reads after fit: every rank's ``counters`` hold the slots it dispatched and, with a capacity
    factor, the ones its experts dropped; dropless drops none."""
    capped = fit("gpt", sw.Parallel(ep=2, capacity_factor=0.5), 2)
    dropless = fit("gpt", sw.Parallel(ep=2), 2)
    for run in (capped, dropless):
        assert dispatched(run) == STEPS * BATCH * SEQ * TOP_K * LAYERS
    # cf 0.5 leaves room for half the slots an expert would get under even routing: every rank drops some.
    assert all(0 < s["counters"]["moe_dropped"] < s["counters"]["moe_dispatched"] for s in capped.stats)
    assert all(s["counters"].get("moe_dropped", 0) == 0 for s in dropless.stats)


@pytest.mark.parametrize("model", ["qwen2_moe", "olmoe"])
def test_other_hugging_face_moe_families(model, same_run):
    """Qwen2-MoE (routed experts beside a gated shared expert, which stays dense) and OLMoE (q/k norms) keep
    their experts in the same 3-D layout, so the same adapter splits them."""
    run = fit(model, sw.Parallel(ep=2), 2)
    same_run(reference(model), run)
    assert dispatched(run) == STEPS * BATCH * SEQ * TOP_K * LAYERS


GPT_ONLY = {
    "ep2-zero1": (lambda: sw.Parallel(ep=2, zero=1), 2),
    "ep2-zero2": (lambda: sw.Parallel(ep=2, zero=2), 2),
    "ep2-dp4": (lambda: sw.Parallel(ep=2), 4),           # edp = 2: expert gradients all-reduced over 2 ranks
    "ep2-cp2": (lambda: sw.Parallel(ep=2, cp=2), 2),     # ep carved from the cp ranks: each sees other tokens
    "ep2-dp2-pp2-zero3": (lambda: sw.Parallel(ep=2, pp=2, zero=3), 4),
}


@pytest.mark.parametrize("layout", list(GPT_ONLY))
def test_more_compositions_on_gpt(layout, same_run):
    make, devices = GPT_ONLY[layout]
    run = fit("gpt", make(), devices)
    same_run(reference("gpt"), run)
    if layout == "ep2-dp4":
        assert all(s["comm_by_group"].get(EDP, 0) > 0 for s in run.stats)


@pytest.mark.parametrize("strategy,devices", [("ddp", 2), ("zero3", 2), (sw.Parallel(ep=2), 2),
                                              (sw.Parallel(ep=4), 4), (sw.Parallel(ep=2, zero=3), 4),
                                              (sw.Parallel(ep=2, pp=2), 4), (sw.Parallel(ep=2, tp=2), 4)], ids=str)
def test_the_global_auxiliary_loss_equals_single_device(strategy, devices, same_run):
    """E * sum_i f_i * P_i is not linear in the batch; with f_i counted over every data-parallel rank, the
    data-parallel average of the local losses' gradients is the single-device gradient, accumulation included
    (each rank's j-th micro-batch is a strided part of the single device's j-th, see data.GlobalBatches)."""
    same_run(reference("gpt-aux"), fit("gpt-aux", strategy, devices))


@pytest.mark.parametrize("strategy,devices", [(sw.Parallel(ep=2), 2), (sw.Parallel(ep=2, pp=2, zero=3), 4)])
def test_the_loss_free_bias_update_equals_single_device(strategy, devices, same_run):
    """The bias moves by the step's loads summed over every data-parallel rank: the single-device update."""
    run = fit("gpt-bias", strategy, devices)
    same_run(reference("gpt-bias"), run)
    bias = reference("gpt-bias").state_dict["blocks.0.mlp.router.bias"]
    assert float(bias.abs().max()) > 0  # the bias did move (and is saved with the model)


def test_the_auxiliary_loss_is_not_linear_in_the_batch():
    """Why the counts are all-reduced: the loss of a batch is not the mean of its halves' losses, so a per-rank
    auxiliary loss would train another model (the test above would fail by this much)."""
    torch.manual_seed(1)
    m = MoE(16, 32, 4, 2).double()
    x = torch.randn(64, 16, dtype=torch.float64)
    with torch.no_grad():
        probs, _, index = m.router(x)
        whole = m.aux_loss(probs, index)
        halves = (m.aux_loss(probs[:32], index[:32]) + m.aux_loss(probs[32:], index[32:])) / 2
    assert abs(float(whole - halves)) > 1e-4  # float64: rounding is ~1e-16; the difference is ~1e-3


def test_the_auxiliary_loss_moves_the_router():
    """The loss does reach the router: with it on, the weights after two steps differ from those without."""
    on, off = reference("gpt-aux"), reference("gpt")
    key = "blocks.0.mlp.router.weight"
    assert float((on.state_dict[key] - off.state_dict[key]).abs().max()) > 1e-5
    assert on.losses[0] == off.losses[0]  # the model's output, hence its loss, is unchanged


# ---- exact counts ----------------------------------------------------------------------------------------
def _routed(rank: int, n: int, k: int, n_experts: int) -> torch.Tensor:
    """A fixed routing: token t of rank r goes to experts (t + r) % E and (t + r + 1) % E ... (k distinct)."""
    t = torch.arange(n)[:, None] + rank
    return (t + torch.arange(k)[None, :]) % n_experts


def _exact(rank: int, device: torch.device, cf: float | None) -> None:
    n, k, hidden, n_experts = 10, 2, 6, 4
    topo = Topology.create(device, ParallelDims(dp_shard=2, ep=2))
    torch.manual_seed(0)
    experts = Experts(hidden, 8, n_experts).double()
    full = Experts(hidden, 8, n_experts).double()
    full.load_state_dict(experts.state_dict())
    ep = ExpertParallel(topo.comm(EP), topo.stats, cf)
    apply_expert_parallel(experts, ep)
    x = torch.randn(n, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    index = _routed(rank, n, k, n_experts)
    weights = torch.full((n, k), 0.5, dtype=torch.float64)
    before = dict(topo.stats.by_name)
    out = experts(x, index, weights)
    load = torch.bincount(index.reshape(-1), minlength=n_experts)
    c = capacity(cf, n, k, n_experts) if cf is not None else n * k
    kept = load.clamp(max=c)
    mine = range(topo.coord(EP) * 2, topo.coord(EP) * 2 + 2)  # this rank's experts
    off_rank = int(sum(kept[e] for e in range(n_experts) if e not in mine))
    sent = topo.stats.by_name["ep_dispatch"] - before.get("ep_dispatch", 0)
    assert sent == off_rank * hidden * 8, (sent, off_rank)                  # rows x hidden x float64
    assert topo.stats.by_name["ep_combine"] - before.get("ep_combine", 0) == sent  # rows come back as they went
    assert topo.stats.counters["moe_dispatched"] == n * k
    assert topo.stats.counters["moe_dropped"] == int((load - c).clamp(min=0).sum())
    if cf is None:  # dropless: the same numbers as every expert on one rank
        torch.testing.assert_close(out, full(x, index, weights), rtol=1e-12, atol=1e-12)
    dist.barrier()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cf", [None, 0.5, 1.0])
def test_bytes_and_drops_are_counted_exactly(cf):
    launch.spawn(_exact, 2, args=(cf,))


def _idle_expert(rank: int, device: torch.device) -> None:
    topo = Topology.create(device, ParallelDims(dp_shard=4, ep=2))
    torch.manual_seed(0)
    experts = Experts(6, 8, 4).double()
    apply_expert_parallel(experts, ExpertParallel(topo.comm(EP), topo.stats))
    ddp = DDPModule(experts, topo.comm(DP), expert_comm=topo.comm(EDP))
    x = torch.randn(5, 6, dtype=torch.float64)
    index = torch.tensor([[0, 1]] * 5)  # experts 2 and 3 (ep rank 1's) get nothing on any rank
    ddp(x, index, torch.full((5, 2), 0.5, dtype=torch.float64)).sum().backward()
    if topo.coord(EP) == 1:
        assert all(p.grad is not None and not p.grad.any() for p in experts.parameters())
    dist.barrier()


@pytest.mark.timeout(120)
def test_an_expert_without_tokens_gets_a_zero_gradient_not_none():
    """DDP reduces every parameter's bucket: an expert no token reached this micro-batch still takes part."""
    launch.spawn(_idle_expert, 4)


def test_capacity_drops_the_overflow_in_token_order():
    """Each expert keeps its first C slots in token order: C = ceil(cf * N * k / E); here every token picks
    expert 0 first, so expert 0 keeps tokens 0..C-1 and the others lose their expert-0 share."""
    n, k, hidden, n_experts = 8, 2, 4, 4
    torch.manual_seed(0)
    experts = Experts(hidden, 8, n_experts).double()
    stats = CommStats()
    apply_expert_parallel(experts, ExpertParallel(None, stats, capacity_factor=1.0))
    index = torch.stack([torch.zeros(n, dtype=torch.long), torch.arange(n) % 3 + 1], dim=1)
    weights = torch.full((n, k), 0.5, dtype=torch.float64)
    x = torch.randn(n, hidden, dtype=torch.float64)
    out = experts(x, index, weights)
    c = capacity(1.0, n, k, n_experts)
    assert c == 4 and stats.counters["moe_dropped"] == n - c
    ref = Experts(hidden, 8, n_experts).double()
    ref.load_state_dict({k_: v for k_, v in experts.state_dict().items()})
    only_second = ref(x, index[:, 1:], weights[:, 1:])
    torch.testing.assert_close(out[c:], only_second[c:])             # tokens past C: their expert-0 slot dropped
    assert not torch.allclose(out[:c], only_second[:c])              # the first C kept it


# ---- checkpoints ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [("ep2", lambda: sw.Parallel(ep=2), 2), ("single", lambda: "single", 1)],
                         ids=["ep4->ep2", "ep4->single"])
def test_an_ep4_checkpoint_resumes_at_ep2_and_on_one_device(target, tmp_path, same_run):
    make, loss, opt = MODELS["gpt"]

    def run(strategy: object, devices: int, steps: int) -> sw.FitResult:
        return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, checkpoint_dir=str(tmp_path),
                          checkpoint_every=1).fit(make(), CharText(stdlib_text(20_000), SEQ), loss, opt,
                                                  batch_size=BATCH, max_steps=steps)

    run(sw.Parallel(ep=4), 4, 1)
    assert [os.path.basename(p) for p in checkpoint.checkpoints(str(tmp_path))] == ["step_00000001"]
    resumed = run(target[1](), target[2], 2)
    ref = sw.Trainer("single", 1, accelerator="cpu", progress=False).fit(
        make(), CharText(stdlib_text(20_000), SEQ), loss, opt, batch_size=BATCH, max_steps=2)
    same_run(ref, resumed)
    shutil.rmtree(tmp_path)


# ---- refusals before any process starts ---------------------------------------------------------------------
@pytest.mark.parametrize("strategy,devices,model,message", [
    (sw.Parallel(ep=2), 2, lambda: GPT(GPTConfig(n_layer=1)),
     "ep=2 need a mixture of experts, but GPT has no experts module"),
    (sw.Parallel(ep=4), 4, lambda: GPT(GPTConfig(n_layer=1, n_experts=6)),
     "ep=4 does not divide the 6 experts of 'blocks.0.mlp.experts'"),
    (sw.Parallel(ep=4, tp=2), 4, moe_gpt, "ep=4 must divide dp*cp = 2*1"),
    (sw.Parallel(ep=2, zero=3, replicate=2), 4, moe_gpt, "ep=2 with HSDP (dp_replicate=2 replicas of dp_shard=2"),
    (sw.Parallel(ep=2, capacity_factor=0.0), 2, moe_gpt, "capacity_factor=0.0 must be > 0"),
])
def test_refused_before_any_process_starts(strategy, devices, model, message, no_spawn):
    with pytest.raises(ValueError, match=None) as e:
        sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
            model(), CharText(stdlib_text(5_000), SEQ), lm_loss, torch.optim.SGD, batch_size=BATCH, max_steps=1)
    assert message in str(e.value)


def test_mixtral_local_auxiliary_loss_is_warned_about(no_spawn):
    """Mixtral computes its router loss inside its forward from this rank's tokens only: said, not hidden."""
    m = mixtral()
    m.config.output_router_logits = True
    with pytest.warns(UserWarning, match="computes its load-balancing loss from each rank's own tokens"):
        with pytest.raises(no_spawn):
            sw.Trainer(sw.Parallel(ep=2), 2, accelerator="cpu", progress=False).fit(
                m, CharText(stdlib_text(5_000), SEQ), logits_loss, torch.optim.SGD, batch_size=BATCH, max_steps=1)


def test_experts_divide_by_ep_per_rank():
    """Each rank keeps E/ep experts of each layer: the parameter count of a rank drops by exactly that."""
    m = moe_gpt()
    total = sum(p.numel() for p in m.parameters())
    expert = sum(p.numel() for n, p in m.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    apply_expert_parallel(m, ExpertParallel(_FakeComm(1, 4), CommStats()))
    assert sum(p.numel() for p in m.parameters()) == total - expert + expert // 4


class _FakeComm(Comm):
    """A communicator that only answers rank and size (the split itself needs no communication)."""

    def __init__(self, rank: int, size: int) -> None:  # noqa: D107
        self.rank, self.size = rank, size
