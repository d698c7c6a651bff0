"""Layout-free checkpoints: saved under one layout and world size, resumed under another, exactly.

Context-parallel layouts are sources and targets too: cp ranks hold the
same tensors, so a cp run's checkpoint is the same as any other layout's.

The matrix runs on the project's GPT with tied embeddings and on Hugging Face
GPT-2 from a tiny config (tied ``lm_head``, fused q|k|v split by tensor
parallelism). Each source layout trains K steps and saves; each of its
targets (another layout, another world size) resumes to 2K. Losses and final
weights must equal one uninterrupted single-process run. Every source has at
least two targets and every target at least two sources, 8 ranks -> 1 and
1 -> 8 included (checked by ``test_the_matrix_covers_every_layout``).

GPT-2 runs the pairs where its own layout matters: those with tensor
parallelism (its fused q|k|v split, its Conv1D weights), a pipeline (its
``lm_head`` tied across the stages) or context parallelism (its attention
reached through transformers' registry) on either side. Between the purely
data-parallel layouts (single, ddp, ZeRO, hsdp, the parameter server) every
parameter is kept, sharded or flattened whole, whatever the model: the
project's GPT runs those pairs alone.
"""
from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
from conftest import once_per_run
from tiny_hf import gpt2, logits_loss
from torch import nn

import shardwise as sw
from shardwise.checkpoint import store as checkpoint
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.strategies.parallel import Parallel
from shardwise.strategies.pp import PP
from shardwise.workloads import CharText, stdlib_text

pytestmark = [pytest.mark.timeout(600), pytest.mark.float64]

K = 1  # steps before the checkpoint (Adam's moments and step count are then saved); resumed runs go to 2K
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
ADAMW_HF = functools.partial(torch.optim.AdamW, lr=1e-4)  # as tests/strategies/test_hf_models.py

# name -> (strategy factory, devices)
LAYOUTS = {
    "single": (lambda: "single", 1),
    "ddp": (lambda: "ddp", 2),
    "zero1": (lambda: "zero1", 4),
    "zero3": (lambda: "zero3", 2),
    "hsdp": (lambda: sw.HSDP(shard_size=2), 4),
    "tp": (lambda: "tp", 2),
    "pp-1f1b": (lambda: PP(schedule="1f1b"), 2),
    "pp-interleaved": (lambda: PP(schedule="interleaved"), 2),
    "dp2-tp2-pp2-zero1": (lambda: Parallel(dp=2, tp=2, pp=2, zero=1), 8),
    "dp2-tp2-zero3": (lambda: Parallel(dp=2, tp=2, zero=3), 4),
    "ps-sync-2": (lambda: sw.ParameterServer(servers=2, mode="sync"), 4),
    "cp2-ring": (lambda: Parallel(cp=2), 2),
    "dp2-cp2-zero3-ulysses": (lambda: Parallel(dp=2, cp=2, zero=3, cp_mode="ulysses"), 4),
}
# source -> targets (each a different world size from its source)
MATRIX = {
    "single": ["tp", "dp2-tp2-pp2-zero1", "cp2-ring"],
    "ddp": ["hsdp", "ps-sync-2", "dp2-cp2-zero3-ulysses"],
    "zero1": ["zero3", "pp-1f1b"],
    "zero3": ["hsdp", "dp2-tp2-pp2-zero1"],
    "hsdp": ["single", "pp-1f1b"],
    "tp": ["dp2-tp2-zero3", "zero1"],
    "pp-1f1b": ["dp2-tp2-pp2-zero1", "hsdp"],
    "pp-interleaved": ["dp2-tp2-zero3", "zero1"],
    "dp2-tp2-pp2-zero1": ["single", "tp", "ps-sync-2"],
    "dp2-tp2-zero3": ["ddp", "zero3", "pp-interleaved"],
    "ps-sync-2": ["ddp", "pp-interleaved"],
    "cp2-ring": ["dp2-cp2-zero3-ulysses", "single"],
    "dp2-cp2-zero3-ulysses": ["cp2-ring", "zero3", "single"],
}
PAIRS = [(s, t) for s, ts in MATRIX.items() for t in ts]
DATA_PARALLEL = {"single", "ddp", "zero1", "zero3", "hsdp", "ps-sync-2"}
CASES = [(s, t, model) for s, t in PAIRS for model in ("gpt", "gpt2")
         if model == "gpt" or not {s, t} <= DATA_PARALLEL]


def tied_gpt() -> nn.Module:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_weights=True))
    for b in m.blocks:
        # The key bias's gradient is identically zero (softmax ignores a shift shared by all keys): frozen,
        # so that Adam does not turn rounding noise into updates and weights compare meaningfully.
        b.attn.k.bias.requires_grad_(False)
    return m


MODELS = {"gpt": (tied_gpt, lm_loss, ADAMW), "gpt2": (gpt2, logits_loss, ADAMW_HF)}


def fit(model: str, layout: str | tuple, steps: int, ckpt: str | None) -> sw.FitResult:
    """Train ``model`` under ``layout`` (a name of LAYOUTS or a (strategy factory, devices) pair)."""
    make, loss, opt = MODELS[model]
    strategy, devices = LAYOUTS[layout] if isinstance(layout, str) else layout
    return sw.Trainer(strategy(), devices, accelerator="cpu", progress=False, checkpoint_dir=ckpt,
                      checkpoint_every=K if ckpt else None).fit(
        make(), CharText(stdlib_text(20_000), 16), loss, opt, batch_size=8, max_steps=steps)


_refs: dict[str, sw.FitResult] = {}
_saved: dict[tuple[str, str], str] = {}


def reference(model: str, tmp_path_factory: pytest.TempPathFactory) -> sw.FitResult:
    """The uninterrupted run on one device (made once per pytest run, whichever xdist worker asks first)."""
    if model not in _refs:
        _refs[model] = once_per_run(f"layouts-{model}", tmp_path_factory, lambda: fit(model, "single", 2 * K, None))
    return _refs[model]


def saved(model: str, source: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint directory holding step K of ``source`` (made once per source and pytest run, copied per
    target)."""
    def save() -> str:
        d = str(tmp_path_factory.mktemp(f"{model}-{source}"))
        part = fit(model, source, K, d)
        torch.testing.assert_close(torch.tensor(part.losses),
                                   torch.tensor(reference(model, tmp_path_factory).losses[:K]), rtol=1e-5, atol=1e-6)
        return d

    if (model, source) not in _saved:
        _saved[model, source] = once_per_run(f"layouts-{model}-{source}", tmp_path_factory, save)
    return _saved[model, source]


def test_the_matrix_covers_every_layout():
    sources: dict[str, set[str]] = {}
    for s, t in PAIRS:
        assert LAYOUTS[s][1] != LAYOUTS[t][1], f"{s} -> {t}: the world size must change"
        sources.setdefault(t, set()).add(s)
    assert set(MATRIX) == set(LAYOUTS)
    assert all(len(ts) >= 2 for ts in MATRIX.values())
    assert {t: len(s) for t, s in sources.items() if len(s) < 2} == {}
    assert set(sources) == set(LAYOUTS)
    sizes = {(LAYOUTS[s][1], LAYOUTS[t][1]) for s, t in PAIRS}
    assert (8, 1) in sizes and (1, 8) in sizes


@pytest.mark.parametrize("source,target,model", CASES, ids=[f"{s}->{t}-{m}" for s, t, m in CASES])
def test_resume_under_another_layout_equals_one_uninterrupted_run(model, source, target, tmp_path,
                                                                  tmp_path_factory, same_run):
    ckpt = str(tmp_path / "ck")
    shutil.copytree(saved(model, source, tmp_path_factory), ckpt)
    assert [os.path.basename(p) for p in checkpoint.checkpoints(ckpt)] == [f"step_{K:08d}"]
    resumed = fit(model, target, 2 * K, ckpt)
    same_run(reference(model, tmp_path_factory), resumed)


def written(ckpt: str, key: str) -> tuple[list[int], list[tuple[tuple[int, ...], tuple[int, ...], str]]]:
    """(global shape, [(offsets, sizes, the file that holds it)]) of ``key`` in the newest checkpoint."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(checkpoint.checkpoints(ckpt)[-1]).read_metadata()
    tm = md.state_dict_metadata[key]
    files = {(i.fqn, tuple(i.offset)): info.relative_path for i, info in md.storage_data.items()}
    chunks = sorted((tuple(c.offsets), tuple(c.sizes), files[key, tuple(c.offsets)]) for c in tm.chunks)
    return list(tm.size), chunks


def test_each_rank_writes_only_what_it_holds(tmp_path):
    """tp: each rank its slice (rows of a colwise weight, columns of a rowwise one, rows of the vocab);
    pp: each stage its layers; FSDP over tp: each rank a contiguous run of its tp slice, as rectangles."""
    tp = str(tmp_path / "tp")
    fit("gpt", "tp", 1, tp)
    assert written(tp, "model.blocks.0.attn.q.weight") == \
        ([32, 32], [((0, 0), (16, 32), "__0_0.distcp"), ((16, 0), (16, 32), "__1_0.distcp")])
    assert written(tp, "optim.blocks.0.mlp.fc2.weight.exp_avg") == \
        ([32, 128], [((0, 0), (32, 64), "__0_0.distcp"), ((0, 64), (32, 64), "__1_0.distcp")])
    assert written(tp, "model.tok_emb.weight") == \
        ([128, 32], [((0, 0), (64, 32), "__0_0.distcp"), ((64, 0), (64, 32), "__1_0.distcp")])
    assert [c[:2] for c in written(tp, "model.ln_f.weight")[1]] == [((0,), (32,))]  # replicated: written once

    pp = str(tmp_path / "pp")
    fit("gpt", "pp-1f1b", 1, pp)
    assert written(pp, "model.blocks.0.attn.q.weight")[1] == [((0, 0), (32, 32), "__0_0.distcp")]
    assert written(pp, "model.ln_f.weight")[1] == [((0,), (32,), "__1_0.distcp")]

    z3 = str(tmp_path / "z3")
    fit("gpt", "dp2-tp2-zero3", 1, z3)
    # fc2.weight [32, 128] is rowwise: tp rank t holds columns 64t..64t+63, a [32, 64] slice;
    # FSDP over dp=2 gives dp rank d rows 16d..16d+15 of it (a contiguous run of 1024 elements).
    # Mesh (pp, dp, tp): global rank = 2 * dp + tp.
    assert written(z3, "model.blocks.0.mlp.fc2.weight") == ([32, 128], [
        ((0, 0), (16, 64), "__0_0.distcp"), ((0, 64), (16, 64), "__1_0.distcp"),
        ((16, 0), (16, 64), "__2_0.distcp"), ((16, 64), (16, 64), "__3_0.distcp")])
    # A bias of 128 colwise-split into 64 per tp rank, then 32 per dp rank.
    assert written(z3, "model.blocks.0.mlp.fc1.bias")[1] == [
        ((0,), (32,), "__0_0.distcp"), ((32,), (32,), "__2_0.distcp"),
        ((64,), (32,), "__1_0.distcp"), ((96,), (32,), "__3_0.distcp")]


def test_a_gpipe_checkpoint_resumes_under_another_schedule(tmp_path, tmp_path_factory, same_run):
    """The schedule does not change what a stage holds: GPipe's checkpoint resumes under 1F1B on 2 x 2."""
    ckpt = str(tmp_path / "ck")
    fit("gpt", (lambda: PP(schedule="gpipe"), 2), K, ckpt)
    same_run(reference("gpt", tmp_path_factory), fit("gpt", "dp2-tp2-pp2-zero1", 2 * K, ckpt))


@pytest.mark.parametrize("zero,target", [(0, (lambda: "zero2", 2)), (2, "pp-1f1b")],
                         ids=["zero0->zero2", "zero2->pp-1f1b"])
def test_parallel_with_the_other_zero_stages(tmp_path, tmp_path_factory, same_run, zero, target):
    """Parallel(dp=2, tp=2) with zero=0 (DDP) and zero=2 saves and resumes under another layout too."""
    ckpt = str(tmp_path / "ck")
    fit("gpt", (lambda: Parallel(dp=2, tp=2, zero=zero), 4), K, ckpt)
    same_run(reference("gpt", tmp_path_factory), fit("gpt", target, 2 * K, ckpt))
