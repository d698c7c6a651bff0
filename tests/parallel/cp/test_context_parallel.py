"""Context parallelism: equal to one device, exact bytes, refusals before any process starts.

Each layout trains shardwise's GPT, Hugging Face Llama (RoPE, 4 heads and 2
kv heads) and Hugging Face GPT-2 (learned positions) for two steps with two
accumulated micro-batches and gradient clipping, and must equal the
single-process run (float64: losses and weights to 1e-9 relative). A wrong
position, a mask off by one chunk or a gradient averaged over the wrong group
moves the losses by far more (``test_wrong_positions_are_caught`` shows it).
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from tiny_hf import gpt2, llama, logits_loss, mistral, qwen2
from torch import nn

import shardwise as sw
from shardwise import launch
from shardwise.comm.collectives import Comm, CommStats
from shardwise.comm.topology import Topology
from shardwise.dims import CP, ParallelDims
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.parallel.checkpointing import track_saved_activations
from shardwise.parallel.cp.apply import ContextParallel, apply_context_parallel, shard_batch
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(600), pytest.mark.float64]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEQ, BATCH, STEPS, ACC = 16, 8, 2, 2


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=SEQ, n_layer=2, n_head=4, n_embd=32))


MODELS = {
    "gpt": (gpt, lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3)),
    # lr 1e-4 as tests/strategies/test_hf_models.py: Adam turns rounding noise of near-zero gradients into updates
    # of ~lr.
    "llama": (llama, logits_loss, functools.partial(torch.optim.AdamW, lr=1e-4)),
    "gpt2": (gpt2, logits_loss, functools.partial(torch.optim.AdamW, lr=1e-4)),
    "qwen2": (qwen2, logits_loss, functools.partial(torch.optim.AdamW, lr=1e-4)),
    "mistral": (mistral, logits_loss, functools.partial(torch.optim.AdamW, lr=1e-4)),
}
LAYOUTS = {
    "cp2-ring": (lambda: sw.Parallel(cp=2), 2),
    "cp4-ring": (lambda: sw.Parallel(cp=4), 4),
    "cp2-ulysses": (lambda: sw.Parallel(cp=2, cp_mode="ulysses"), 2),
    "cp2-dp2-zero3": (lambda: sw.Parallel(cp=2, dp=2, zero=3), 4),
    "cp2-tp2": (lambda: sw.Parallel(cp=2, tp=2), 4),
    "cp2-pp2": (lambda: sw.Parallel(cp=2, pp=2), 4),
    "cp2-tp2-sequence-parallel": (lambda: sw.Parallel(cp=2, tp=2, sequence_parallel=True), 4),
}


def fit(model: str, strategy: object, devices: int, fit_kw: dict | None = None, **kw: object) -> sw.FitResult:
    make, loss, opt = MODELS[model]
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=ACC,
                      gradient_clip_val=0.05, **kw).fit(
        make(), CharText(stdlib_text(20_000), SEQ), loss, opt, batch_size=BATCH, max_steps=STEPS, **(fit_kw or {}))


_refs: dict[str, sw.FitResult] = {}


def reference(model: str) -> sw.FitResult:
    if model not in _refs:
        _refs[model] = fit(model, "single", 1)
    return _refs[model]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", ["gpt", "llama", "gpt2"])
def test_context_parallel_equals_single_device(model, layout, same_run):
    make, devices = LAYOUTS[layout]
    run = fit(model, make(), devices)
    same_run(reference(model), run)
    assert all(s["comm_by_group"].get(CP, 0) > 0 for s in run.stats)  # attention did cross the cp ranks


GPT_ONLY = {
    "cp2-dp2-zero1": (lambda: sw.Parallel(cp=2, dp=2, zero=1), 4, {}),
    "cp2-dp2-zero2-ulysses": (lambda: sw.Parallel(cp=2, dp=2, zero=2, cp_mode="ulysses"), 4, {}),
    "cp2-hsdp": (lambda: sw.Parallel(cp=2, dp=2, zero=3, replicate=2), 4, {}),
    "cp2-activation-checkpointing": (lambda: sw.Parallel(cp=2), 2, {"activation_checkpointing": True}),
    "cp2-tp2-pp2-ulysses": (lambda: sw.Parallel(cp=2, tp=2, pp=2, cp_mode="ulysses"), 8, {}),
    "cp2-tp4-sequence-parallel": (lambda: sw.Parallel(cp=2, tp=4, sequence_parallel=True), 8, {}),
}


@pytest.mark.parametrize("layout", list(GPT_ONLY))
def test_more_compositions_on_gpt(layout, same_run):
    """The other data-parallel forms over dp x cp, recomputation in backward (the ring runs again there),
    and all of cp, tp and pp at once."""
    make, devices, kw = GPT_ONLY[layout]
    same_run(reference("gpt"), fit("gpt", make(), devices, **kw))


def test_validation_under_cp_equals_single():
    """Validation cuts the sequences as training does; its loss is the mean over every token."""
    val = CharText(stdlib_text(30_000)[20_000:], SEQ)  # text the training run does not read
    runs = [fit("gpt", s, d, {"val_dataset": val, "val_every": STEPS})
            for s, d in [("single", 1), (sw.Parallel(cp=2), 2)]]
    a, b = (r.val_metrics[-1]["val_loss"] for r in runs)
    assert abs(a - b) <= 1e-9 * abs(a), (a, b)


@pytest.mark.parametrize("layout", ["cp2-ring", "cp2-ulysses"])
@pytest.mark.parametrize("model", ["qwen2", "mistral"])
def test_other_hugging_face_families(model, layout, same_run):
    """Qwen2 (biases on q, k, v) and Mistral (one kv head: Ulysses repeats it to each of the 2 ranks) take the
    same route through transformers' attention registry."""
    make, devices = LAYOUTS[layout]
    same_run(reference(model), fit(model, make(), devices))


# ---- bytes -----------------------------------------------------------------------------------------------
def _cp_bytes(mode: str, cp: int) -> int:
    """Bytes one rank sends over its cp group in the whole run of ``gpt()``, from the formulas of
    docs/long_context.md: per attention layer and micro-batch of B sequences, S/C tokens per rank,
    h heads (= kv heads here) of width d, element size e."""
    cfg = gpt().cfg
    b, s, h, d, e = BATCH // ACC, SEQ, cfg.n_head, cfg.n_embd // cfg.n_head, 8
    if mode == "ring":
        block = 2 * (s // cp) * h * d * b * e  # k and v of this rank's tokens
        per_layer = block * (cp - 1) + block * (cp - 1) + block * cp  # forward; backward: kv again, gradients home
    else:
        per_layer = 2 * 4 * (s // cp) * h * d * b * (cp - 1) // cp * e  # q, k, v, out; forward and backward
    return per_layer * cfg.n_layer * ACC * STEPS


@pytest.mark.parametrize("mode,cp", [("ring", 2), ("ring", 4), ("ulysses", 2), ("ulysses", 4)])
def test_cp_bytes_per_rank_equal_the_formula(mode, cp):
    run = fit("gpt", sw.Parallel(cp=cp, cp_mode=mode), cp)
    want = _cp_bytes(mode, cp)
    assert [s["comm_by_group"][CP] for s in run.stats] == [want] * cp
    # Gradients are averaged over dp x cp: here the cp ranks alone, under the flattened group's name.
    assert all(s["comm_by_group"]["dp_cp"] > 0 for s in run.stats)


class IgnoresPositions(GPT):
    """Takes position_ids but places every rank's tokens at 0..T-1: what a cp run without real positions does."""

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(idx)


def test_wrong_positions_are_caught():
    """The equivalence tests can fail: a model that drops the real positions gives other losses under cp."""
    def first_loss(strategy: object, devices: int) -> float:
        torch.manual_seed(0)
        model = IgnoresPositions(GPTConfig(vocab_size=128, block_size=SEQ, n_layer=2, n_head=4, n_embd=32))
        return sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
            model, CharText(stdlib_text(20_000), SEQ), lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3),
            batch_size=BATCH, max_steps=1).losses[0]

    ref, run = first_loss("single", 1), first_loss(sw.Parallel(cp=2), 2)
    assert abs(run - ref) > 1e-4 * abs(ref)  # against the 1e-9 the equivalence tests allow


# ---- refusals before any process starts ----------------------------------------------------------------
class NoAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 16)
        self.out = nn.Linear(16, 128)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(self.emb(x))


class NoPositions(GPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(idx)


def _refused(model: nn.Module, strategy: object, devices: int, seq: int = SEQ) -> str:
    with pytest.raises(ValueError) as e:
        sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
            model, CharText(stdlib_text(20_000), seq), lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3),
            batch_size=BATCH, max_steps=1)
    return str(e.value)


def test_refusals_name_the_fix(no_spawn):
    assert _refused(gpt(), sw.Parallel(cp=4), 4, seq=12) == (
        "context parallel: a sequence of 12 tokens does not split into 2*cp = 8 equal chunks (each rank holds a "
        "head and a tail chunk); use a sequence length divisible by 8")
    six = GPT(GPTConfig(vocab_size=128, block_size=SEQ, n_layer=1, n_head=6, n_embd=48))
    assert _refused(six, sw.Parallel(cp=4, cp_mode="ulysses"), 4) == (
        "cp_mode='ulysses' splits attention heads over the cp ranks: 6 heads (per tensor-parallel rank) do not "
        "divide by cp=4; use a cp size that divides 6, or cp_mode='ring'")
    assert _refused(NoAttention(), sw.Parallel(cp=2), 2) == (
        "context parallel: NoAttention has no attention that shardwise can replace; it needs "
        "shardwise.models.Attention modules (or any module whose attention is its `attend(q, k, v)` attribute), "
        "or a Hugging Face model whose attention goes through transformers' AttentionInterface "
        "(config._attn_implementation); without cp, use sw.Parallel(cp=1)")
    assert _refused(NoPositions(GPTConfig(vocab_size=128, block_size=SEQ)), sw.Parallel(cp=2), 2) == (
        "context parallel: NoPositions.forward takes no position_ids, so a rank cannot tell its tokens where they "
        "are in the sequence; add a position_ids=None argument (the positions of the tokens passed) to its forward")
    with pytest.raises(ValueError, match=r"^cp_mode='zigzag': valid are 'ring', 'ulysses'$"):
        sw.Parallel(cp=2, cp_mode="zigzag")
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by cp\*tp\*pp = 4\*1\*1 = 4"):
        sw.Parallel(cp=4).layout(6)


def test_cp_is_in_the_layout():
    layout = sw.Parallel(cp=2, dp=2, zero=3).layout(4)
    assert (layout.cp, layout.dp, layout.cp_mode, layout.devices, layout.batch_shards) == (2, 2, "ring", 4, 2)
    assert layout.dims.size("dp_shard_cp") == 4 and layout.dims.size("dp_cp") == 4
    assert layout.label() == "parallel(dp=2, cp=2, zero=3, cp_mode=ring)"


# ---- activation memory ----------------------------------------------------------------------------------
LONG = 64  # tokens per sequence for the activation measurement


def _saved_bytes(cp_comm: Comm | None, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one training step of a GPT on this rank's tokens (parameters and
    the batch itself not counted; each storage once; the peak over the step). ``cp_comm=None``: the model
    as it is, on one device (CPU SDPA)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=LONG, n_layer=2, n_head=4, n_embd=32))
    if cp_comm is None:
        xs, ys = x, y
    else:
        apply_context_parallel(model, ContextParallel(cp_comm, "ring"))
        xs, ys = shard_batch(x, cp_comm.size, cp_comm.rank), shard_batch(y, cp_comm.size, cp_comm.rank)
    with track_saved_activations(model.parameters(), [xs, ys]) as saved:
        lm_loss(model(xs), ys).backward()
    return saved.peak


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2, LONG + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _measure(rank: int, device: torch.device, out: str) -> None:
    topo = Topology.create(device, ParallelDims(cp=dist.get_world_size()))
    peak = _saved_bytes(topo.comm(CP), *_batch())
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(peak))
    topo.close()


def test_saved_activations_per_rank_fall_as_one_over_cp(tmp_path):
    one = _saved_bytes(None, *_batch())  # one device, the model unchanged
    assert _saved_bytes(Comm(None, CommStats()), *_batch()) == one  # the ring on a one-rank group keeps the same
    for cp in (2, 4):
        launch.spawn(_measure, cp, args=(str(tmp_path / f"cp{cp}"),))
        peaks = [int((tmp_path / f"cp{cp}.{r}").read_text()) for r in range(cp)]
        # Everything saved belongs to a token, except the loss's one float64 scalar (cross entropy's total
        # weight): with that aside, each rank keeps exactly 1/cp of what one device keeps.
        assert [(p - 8) * cp for p in peaks] == [one - 8] * cp, (cp, one, peaks)


def _planned(layout: object, memory: int) -> object:
    from shardwise.plan import plan_run  # as the Trainer's memory check imports it

    model = GPT(GPTConfig(vocab_size=128, block_size=LONG_FIT, n_layer=2, n_head=4, n_embd=32))
    return plan_run(model, layout.with_run("32", False), memory, BATCH,  # type: ignore[attr-defined]
                    functools.partial(torch.optim.AdamW, lr=1e-3)([nn.Parameter(torch.zeros(1))]))


LONG_FIT = 512  # tokens: activations, not parameters, decide whether this model fits


def test_a_sequence_one_rank_refuses_fits_with_cp4(same_run):
    """The planner's check refuses one rank under a memory cap that cp=4 fits in; the cp run trains to the
    single run's result (which itself runs only with the check off)."""
    one, four = sw.Parallel(cp=1).layout(1), sw.Parallel(cp=4).layout(4)
    big = 1 << 40
    need_one, need_four = _planned(one, big), _planned(four, big)
    # Per rank, activations fall as 1/cp (the kv blocks in flight are counted as a buffer, not activations).
    assert need_four.activation_bytes * 4 == need_one.activation_bytes
    cap = (need_one.total_bytes + need_four.total_bytes) // 2
    assert need_four.total_bytes < cap < need_one.total_bytes

    def run(strategy: object, devices: int, check: str) -> sw.FitResult:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=128, block_size=LONG_FIT, n_layer=2, n_head=4, n_embd=32))
        return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, memory_check=check,
                          device_memory=cap).fit(
            model, CharText(stdlib_text(60_000), LONG_FIT), lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3),
            batch_size=BATCH, max_steps=2)

    with pytest.raises(MemoryError, match="the planner predicts this run will not fit in device memory"):
        run("single", 1, "error")
    same_run(run("single", 1, "off"), run(sw.Parallel(cp=4), 4, "error"))
