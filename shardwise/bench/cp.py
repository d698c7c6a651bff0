"""Benchmark pair ``cp``: our context parallelism, ring against Ulysses, with data parallelism as the baseline.

PyTorch has no context parallelism that runs on CPU to compare with: torch's
``context_parallel`` (``torch.distributed.tensor.experimental``) swaps in ring
versions of the CUDA SDPA kernels only (flash, memory-efficient, cuDNN), and
on CPU ``scaled_dot_product_attention`` dispatches to none of them. So the
baseline is the same model trained on the same tokens per step by data
parallelism, ``Parallel(dp=N)`` (DDP): each rank holds its share of the
global batch as whole sequences, where ``Parallel(cp=N)`` holds every sequence
and ``S / N`` of its tokens (the head-tail chunks of
:mod:`shardwise.parallel.cp.attention`). Tokens per rank are equal, so the
step times compare the cost of splitting the sequence (attention across the
ranks, its traffic) against not splitting it.

The three contenders run in the same spawned ranks, on the same GPT weights
and the same global batch; repetitions rotate which goes first; medians as in
:mod:`shardwise.bench.harness` (median over a repetition's timed steps, median
over repetitions, slowest rank). Each is driven as :mod:`shardwise.bench.compose`
drives its contenders (``strategy.setup``, ``strategy.train_step``, ``opt.step``).

Columns besides the times: bytes sent per rank per step as our ``Comm`` counts
them (:func:`expected_sent` is the formula), and the activation bytes autograd
saves for backward in one forward (:func:`saved_bytes`: saved-tensor hooks,
each storage once, parameters and the batch itself left out), over the run's
local batch and over a single sequence. A single sequence's figure is what
falls as ``1/C``: per sequence, a cp rank saves the activations of ``S / C``
tokens, where data parallelism saves those of ``S``.
"""
from __future__ import annotations

import argparse
import copy
import functools
import pickle
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from rich.table import Table
from torch import nn

from shardwise.bench.compose import strategy_step
from shardwise.bench.harness import measure, spawn_collect
from shardwise.bench.tables import Column, table, wide
from shardwise.comm.topology import Topology
from shardwise.dims import CP, DP, WORLD
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.parallel.cp.attention import RING, ULYSSES
from shardwise.parallel.pp.schedules import Recorder
from shardwise.strategies.parallel import Parallel

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CFG = GPTConfig(vocab_size=256, block_size=1024, n_layer=2, n_head=8, n_embd=128)
SEQUENCES = 4  # the global batch, in sequences of CFG.block_size tokens
BASELINE = "baseline"  # the contender's key for data parallelism (its mode is None)
Step = Callable[[], torch.Tensor]


@dataclass
class CPContender:
    """One way to train the model on the ranks: ``mode`` ``"ring"``/``"ulysses"`` (cp over every rank) or None
    (the baseline: dp over every rank, whole sequences)."""

    name: str
    mode: str | None

    @property
    def key(self) -> str:
        return self.mode or BASELINE

    def strategy(self, n: int, recorder: Recorder | None = None) -> Parallel:
        if self.mode is None:
            return Parallel(dp=n, recorder=recorder)
        return Parallel(dp=1, cp=n, cp_mode=self.mode, recorder=recorder)


CONTENDERS = (CPContender("shardwise Parallel(cp=N, ring)", RING),
              CPContender("shardwise Parallel(cp=N, ulysses)", ULYSSES),
              CPContender("shardwise Parallel(dp=N) (DDP)", None))


def gpt(cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def global_batch(cfg: GPTConfig, sequences: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequences`` random token sequences of ``cfg.block_size`` tokens: (inputs, next tokens)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (sequences, cfg.block_size + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def local_batch(c: CPContender, topo: Topology, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rank is given: under cp every sequence whole (``train_step`` cuts this rank's tokens out), under
    dp this rank's share of the sequences."""
    if c.mode is not None:
        return x.to(topo.device), y.to(topo.device)
    n, r = topo.size(DP), topo.coord(DP)
    return x.chunk(n)[r].to(topo.device), y.chunk(n)[r].to(topo.device)


def build_step(c: CPContender, model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor) -> Step:
    """One optimizer step of ``c`` on this rank's batch."""
    return strategy_step(c.strategy(topo.world_size), model, topo, x, y)


def saved_bytes(c: CPContender, model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor) -> int:
    """Activation bytes this rank saves for backward in one forward of ``(x, y)`` (loss included): the pipeline
    runner's saved-tensor hooks (:class:`~shardwise.parallel.checkpointing.SavedActivations`), each storage
    counted once, parameters and the (cut) batch left out. Runs one step without the optimizer update."""
    rec = Recorder(track_saved=True)
    strat = c.strategy(topo.world_size, rec)
    pm, _ = strat.setup(copy.deepcopy(model), ADAMW, topo)
    strat.train_step(pm, [(x, y)], lm_loss, topo)
    return rec.peak_saved_bytes


def _timed(c: CPContender, model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, warmup: int,
           steps: int) -> tuple[float, int, float]:
    return measure(
        lambda: build_step(c, copy.deepcopy(model), topo, x, y),  # type: ignore[arg-type,return-value]
        topo,
        x.device.type == "cuda",
        warmup,
        steps,
    )


def _worker(rank: int, device: torch.device, blob: bytes, path: str) -> None:
    job = pickle.loads(blob)
    n = torch.distributed.get_world_size()
    topos = {CP: Topology.create(device, dp=1, cp=n), DP: Topology.create(device, dp=n)}
    model: GPT = job["model"]
    x, y = global_batch(model.cfg, job["sequences"])
    contenders: tuple[CPContender, ...] = job["contenders"]
    out: dict[str, dict[str, Any]] = {}
    batches = {}
    for c in contenders:
        topo = topos[DP if c.mode is None else CP]
        batches[c.key] = (topo, *local_batch(c, topo, x, y))
        xl, yl = batches[c.key][1:]
        out[c.key] = {"name": c.name, "times": [], "rss": [], "sent": [], "sequences": xl.shape[0],
                      "saved": saved_bytes(c, model, topo, xl, yl),
                      "saved_one": saved_bytes(c, model, topo, xl[:1], yl[:1])}  # one sequence (cp: cut, too)
    for rep in range(job["reps"]):  # rotate which contender goes first
        k = rep % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            topo, xl, yl = batches[c.key]
            t, mem, sent = _timed(c, model, topo, xl, yl, job["warmup"], job["steps"])
            out[c.key]["times"].append(t)
            out[c.key]["rss"].append(mem)
            out[c.key]["sent"].append(sent)
    everyone = topos[DP].comm(WORLD).all_gather_object(out, name="bench.gather")
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(everyone, f)
    for topo in topos.values():
        topo.close()


def run_cp(model: GPT, nproc: int, sequences: int = SEQUENCES, reps: int = 5, warmup: int = 2, steps: int = 5,
           accelerator: str = "cpu",
           contenders: tuple[CPContender, ...] = CONTENDERS) -> list[dict[str, dict[str, Any]]]:
    """Every contender on ``nproc`` ranks over a global batch of ``sequences`` sequences; per rank, per
    contender key: step times (median over the timed steps), peak RSS increases and bytes sent per step, one
    of each per repetition; saved activation bytes (over the rank's batch and over one sequence); the
    sequences the rank holds."""
    if sequences % nproc:
        raise SystemExit(f"cp: the global batch of {sequences} sequences must divide over --nproc {nproc} "
                         "(the data-parallel baseline gives each rank whole sequences)")
    if model.cfg.block_size % (2 * nproc):
        raise SystemExit(f"cp: {model.cfg.block_size} tokens do not split into 2 x {nproc} chunks")
    job = {"model": model, "sequences": sequences, "reps": reps, "warmup": warmup, "steps": steps,
           "contenders": contenders}
    out: list[dict[str, dict[str, Any]]] = spawn_collect(_worker, nproc, pickle.dumps(job), accelerator=accelerator)
    return out


# ---- the formulas --------------------------------------------------------------------------------
def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def expected_sent(cfg: GPTConfig, mode: str | None, n: int, sequences: int, grads: int, e: int = 4) -> int:
    """Bytes one rank sends per step (module docstring of :mod:`shardwise.parallel.cp.attention`), ``C = N``:
    ring ``2(S/C)·h_kv·d·B·(C-1)·e`` forward, as much again backward plus ``2(S/C)·h_kv·d·B·C·e``; ulysses
    ``4(S/C)·H·d·B·(C-1)/C·e`` forward and as much backward; per layer; and for everyone the gradient
    all-reduce over dp x cp, ``2(N-1)/N`` x gradient bytes (``grads``)."""
    s, b, h, d = cfg.block_size, sequences, cfg.n_head, cfg.n_embd // cfg.n_head
    h_kv = h  # GPT: one kv head per query head
    all_reduce = 2 * (n - 1) * grads // n
    if mode is None:
        return all_reduce
    c = n
    if mode == RING:
        kv = 2 * (s // c) * h_kv * d * b * (c - 1) * e
        per_layer = kv + kv + 2 * (s // c) * h_kv * d * b * c * e
    else:
        per_layer = 2 * (4 * (s // c) * h * d * b * (c - 1) // c * e)
    return per_layer * cfg.n_layer + all_reduce


FORMULA = ("ring: 2(S/C)·h_kv·d·B·(C-1)·e forward, as much again plus 2(S/C)·h_kv·d·B·C·e backward, per layer; "
           "ulysses: 4(S/C)·H·d·B·(C-1)/C·e forward and as much backward, per layer; every contender: the gradient "
           "all-reduce over the N ranks (dp x cp), 2(N-1)/N x gradient bytes. B: the sequences a rank holds, "
           "S tokens each, d: head width, e = 4 B (fp32).")


# ---- the table -----------------------------------------------------------------------------------
def summarize(results: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per contender: median over repetitions, then the slowest rank (step time) or the largest (bytes)."""
    out: dict[str, dict[str, Any]] = {}
    for key, first in results[0].items():
        out[key] = {"name": first["name"], "sequences": first["sequences"],
                    "step_time_s": max(statistics.median(r[key]["times"]) for r in results),
                    "rss": max(statistics.median(r[key]["rss"]) for r in results),
                    "sent": max(statistics.median(r[key]["sent"]) for r in results),
                    "saved": max(r[key]["saved"] for r in results),
                    "saved_one": max(r[key]["saved_one"] for r in results)}
    return out


def cp_table(summary: dict[str, dict[str, Any]], cfg: GPTConfig, n: int, sequences: int, grads: int,
             wide_: bool = False) -> Table:
    title = (f"Context parallelism, ring against Ulysses: GPT {cfg.n_layer} x {cfg.n_embd} ({cfg.n_head} heads, "
             f"vocab {cfg.vocab_size}), S={cfg.block_size}, C=N={n} ranks, global batch {sequences} sequences "
             f"({sequences * cfg.block_size} tokens), AdamW fp32. Baseline: Parallel(dp=N) on the same tokens per "
             f"step (PyTorch has no CPU context parallelism: torch's context_parallel dispatches only CUDA SDPA "
             f"kernels)")
    caption = (f"Formula: {FORMULA} Saved activations: bytes autograd holds for backward after one forward (each "
               "storage once, no parameters, no batch), over the rank's batch and over one sequence (under cp: its "
               "S/C tokens of it). --wide: every column.")
    base = summary[BASELINE]
    tokens = sequences * cfg.block_size
    rows = []
    for key, s in summary.items():
        mode = None if key == BASELINE else key
        st = s["step_time_s"]
        name = f"Parallel(dp={n}) (DDP)" if mode is None else f"Parallel(cp={n}, {mode})"
        held = cfg.block_size if mode is None else cfg.block_size // n
        rows.append([name, f"{s['sequences']} x {held} tokens", f"{1e3 * st:.2f} ms", f"{tokens / st:,.0f}",
                     f"{base['step_time_s'] / st:.3f}x", f"{s['sent']:,.0f} B",
                     f"{expected_sent(cfg, mode, n, s['sequences'], grads):,} B", f"{s['saved']:,} B",
                     f"{s['saved_one']:,} B", f"{s['saved_one'] / base['saved_one']:.4f}x"])
    return table(title, COLUMNS, rows, wide_, caption)


COLUMNS = (Column("implementation", left=True), Column("a rank holds", detail=True), Column("median step"),
           Column("tokens/s", detail=True), Column("vs dp"), Column("sent/rank/step"), Column("formula", detail=True),
           Column("saved act. / rank", detail=True), Column("saved act. / seq."), Column("per seq. vs dp"))


def cp_pair(a: argparse.Namespace) -> Table:
    """``shardwise bench --pairs cp``: the global batch is :data:`SEQUENCES` sequences of ``CFG.block_size``
    tokens (``--batch`` counts the other pairs' short samples and is not used here)."""
    model = gpt()
    res = run_cp(model, a.nproc, SEQUENCES, a.reps, steps=a.steps, accelerator=a.accelerator)
    return cp_table(summarize(res), CFG, a.nproc, SEQUENCES, grad_bytes(model), wide(a))


__all__ = ["BASELINE", "CFG", "CONTENDERS", "SEQUENCES", "CPContender", "cp_pair", "cp_table", "expected_sent",
           "global_batch", "gpt", "grad_bytes", "run_cp", "saved_bytes", "summarize"]
