"""Benchmark pairs as engine switches: one Trainer setup under ``engine="shardwise"`` and ``engine="torch"``.

A switch pair trains the same setup (strategy, model, data, loss, AdamW, global batch) with
``Trainer(strategy, engine=...).fit`` in the same spawned ranks (the Trainer joins the running group), a short
run per engine in each repetition, alternating which engine goes first (:func:`~shardwise.bench.harness.alternate`).
Everything around the engine (data loading, the step loop, the loss, the optimizer) is the same code on both
sides, so the ratio is the engines'. A run's step time is the Trainer's own ``stats["step_time_s"]`` (the median
of its steps after the first); its memory the peak RSS increase over the RSS before ``fit``; its bytes what our
communication layer counted per step (torch's engines' traffic passes outside it: not seen).

:data:`SWITCHES` names the pairs that run this way: those whose strategy ``engine="torch"`` runs (ddp, zero1,
zero2, zero3, fsdp, tp, fsdp-tp). The other pairs (pp, zb, ...) race hand-built torch code until it does; then
one entry here moves a pair over. ``--hand-built`` still runs the hand-built contenders of the switches
(:mod:`shardwise.bench.zero`, :mod:`~shardwise.bench.pp.mp`, :mod:`~shardwise.bench.compose`; zero2 has none).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.utils.data import Dataset

from shardwise.bench.compose import expected_sent
from shardwise.bench.harness import (
    NOT_SEEN_NOTE,
    PAIRED_NOTE,
    PairResult,
    alternate,
    contender_cells,
    formula_cell,
    gather_results,
    merged,
    over_runs,
    runs_note,
    spawn_collect,
    summarize,
)
from shardwise.bench.tables import Column, table, wide
from shardwise.comm.topology import Topology
from shardwise.dims import DP, PP, TP
from shardwise.fit.trainer import Trainer
from shardwise.stats import current_rss_bytes, peak_rss_bytes, release_free_heap, reset_peak_rss
from shardwise.strategies.base import Strategy
from shardwise.strategies.parallel import Parallel
from shardwise.workloads import gpt, mlp1024

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
MLP, GPT_ = "MLP", "GPT"  # the workloads' labels (rows of the table)
Made = tuple[nn.Module, Dataset, Callable[..., torch.Tensor]]  # type: ignore[type-arg]  # (model, training data, loss function)


def _mlp() -> Made:
    work = mlp1024()
    return work.make_model(), work.train, work.loss_fn


def _gpt() -> Made:
    work = gpt(n_layer=4, n_embd=128, n_head=4, block=64)
    return work.make_model(), work.train, work.loss_fn


# Built here, then sent to the ranks as objects (a Workload's model factory is a closure, which cannot be pickled).
WORKLOADS: dict[str, tuple[str, Callable[[], Made]]] = {
    MLP: ("4 x Linear(1024) MLP, random regression data", _mlp),
    GPT_: ("GPT 4 x 128 (4 heads, T=64, vocabulary 128), characters of the standard library's source", _gpt)}


@dataclass(frozen=True)
class Switch:
    """A pair as an engine switch: ``strategy`` (a name the Trainer takes, or a function of the rank count
    returning a strategy object, such as :func:`fsdp_tp`) on each of ``workloads``; our bytes per step are
    ``factor (N-1)/N`` x the gradient bytes (2: an all-reduce, 3: ZeRO-3) or, with ``tp_formula``, the GPT's
    tensor-parallel all-reduces plus ZeRO-3 over dp (:func:`shardwise.bench.compose.expected_sent`); neither: no
    formula is shown."""

    strategy: str | Callable[[int], Strategy]
    workloads: tuple[str, ...]
    factor: int | None = None
    tp_formula: bool = False

    def strategy_for(self, nproc: int) -> str | Strategy:
        return self.strategy if isinstance(self.strategy, str) else self.strategy(nproc)

    def formula(self, model: nn.Module, nproc: int, batch: int) -> float | None:
        """The bytes our engine should count per rank and step on ``model``, ``nproc`` ranks, global ``batch``."""
        if self.factor is not None:
            return self.factor * (nproc - 1) / nproc * grad_bytes(model)
        if not self.tp_formula:
            return None
        strategy = self.strategy_for(nproc)
        dp = 1 if isinstance(strategy, str) else getattr(strategy, DP)  # the name "tp": every rank one replica
        width = next(model.parameters()).element_size()
        return expected_sent(model, dp, nproc // dp, batch) * width / 4  # expected_sent counts fp32 elements

    @property
    def formula_note(self) -> str:
        """What :meth:`formula` counts, for the table's caption ("" where it has no formula)."""
        if self.factor is not None:
            return f"formula: {self.factor}(N-1)/N x gradient bytes."
        return ("formula: per block 4 all-reduces of the (B/dp, T, D) activations, the embedding's and head's, the "
                "logits' all-gather, and 3(dp-1)/dp x the local parameter bytes (ZeRO-3)." if self.tp_formula else "")


def fsdp_tp(nproc: int) -> Strategy:
    """The fsdp-tp pair's layout (that of :mod:`shardwise.bench.compose`): tp=2 inside each replica, ZeRO-3 over
    the ``nproc // 2`` replicas."""
    if nproc % 2:
        raise SystemExit(f"fsdp-tp: --nproc {nproc} must be a multiple of tp=2")
    return Parallel(dp=nproc // 2, tp=2, zero=3)


def shown(strategy: str | Strategy) -> str:
    """How a title names ``strategy``: a name quoted, an object by the fields it sets (its full repr lists every
    field, some 300 characters for ``Parallel``)."""
    if isinstance(strategy, str):
        return repr(strategy)
    fields = [f for f in dataclasses.fields(strategy) if f.default is not dataclasses.MISSING]
    set_ = [f"{f.name}={getattr(strategy, f.name)!r}" for f in fields if getattr(strategy, f.name) != f.default]
    return f"{type(strategy).__name__}({', '.join(set_)})"


# The pairs that run as engine switches: the strategies engine="torch" runs
# (strategies/torch_engine/wrappers.py's TORCH).
# tp and fsdp-tp need a model with a built-in tensor-parallel plan: the GPT (the MLP is a bare nn.Sequential).
SWITCHES: dict[str, Switch] = {"ddp": Switch("ddp", (MLP,), 2), "zero1": Switch("zero1", (MLP, GPT_), 2),
                               "zero2": Switch("zero2", (MLP, GPT_), 2), "zero3": Switch("zero3", (MLP, GPT_), 3),
                               "fsdp": Switch("fsdp", (MLP, GPT_), 3), TP: Switch(TP, (GPT_,), tp_formula=True),
                               "fsdp-tp": Switch(fsdp_tp, (GPT_,), tp_formula=True),
                               # 1F1B over the GPT's blocks; its sends (activations, their gradients) have no formula
                               PP: Switch(PP, (GPT_,))}


@dataclass(frozen=True)
class EngineContender:
    """One side of a switch: the engine that runs the strategy (a contender of :func:`alternate`)."""

    engine: str

    @property
    def name(self) -> str:
        return self.engine

    @property
    def counts_bytes(self) -> bool:
        return self.engine == "shardwise"


ENGINES = (EngineContender("shardwise"), EngineContender("torch"))


def fit_once(c: EngineContender, job: dict[str, Any], made: Made, rank: int,
             losses: dict[str, list[float]]) -> tuple[float, int, float]:
    """One short ``fit`` of the setup under ``c``'s engine: (this rank's median step, its peak RSS increase,
    bytes our Comm counted per step); the run's global losses go to ``losses[c.engine]``."""
    model, data, loss = made
    gc.collect()
    release_free_heap()  # what the other engine freed must not lower this one's RSS increase
    reset_peak_rss()
    before = current_rss_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same notices under both engines, once per run
        result = Trainer(job["strategy"], job["nproc"], accelerator=job["accelerator"], engine=c.engine,
                         progress=False, memory_check="off").fit(
            model, data, loss, ADAMW, batch_size=job["batch"], max_steps=job["steps"] + 1, return_state_dict=False)
    mem = peak_rss_bytes() - before
    losses[c.engine] = list(result.losses)
    mine = result.stats[rank]
    return mine["step_time_s"], mem, mine["comm_bytes_per_step"]


def _worker(rank: int, device: torch.device, blob: bytes, path: str) -> None:
    job = pickle.loads(blob)
    topo = Topology.create(device)  # for gathering the results; each fit builds its own
    losses: dict[str, list[float]] = {}
    res = alternate(ENGINES, job["reps"], lambda c: fit_once(c, job, job["made"], rank, losses))
    res.losses = losses  # the last run of each engine: did both train alike?
    gather_results(res, topo, path)
    topo.close()


def run_switch(strategy: str | Strategy, made: Made, nproc: int, batch: int, reps: int = 5, steps: int = 10,
               accelerator: str = "cpu") -> tuple[list[PairResult], dict[str, list[float]]]:
    """One launch of ``nproc`` ranks alternating both engines ``reps`` times on ``made`` (model, data, loss),
    ``steps`` timed steps each (after one more, untimed): one :class:`PairResult` per rank, and each engine's
    losses in its last run."""
    job = dict(strategy=strategy, made=made, nproc=nproc, batch=batch, reps=reps, steps=steps,
               accelerator=accelerator)
    out: list[PairResult] = spawn_collect(_worker, nproc, pickle.dumps(job), accelerator=accelerator)
    return out, out[0].losses


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


COLUMNS = (Column("model", left=True), Column("engine", left=True), Column("median step"), Column("vs torch"),
           Column("paired vs torch"), Column("peak RSS +"), Column("RSS vs torch"), Column("sent/rank/step"),
           Column("formula", detail=True), Column("loss gap", detail=True))


def switch_rows(workload: str, runs: list[list[PairResult]], formula: float | None, gap: float) -> list[list[str]]:
    """The two rows (shardwise, torch) of one workload's runs."""
    every = merged(runs)
    s = summarize(every)
    return [[workload, c.engine, *contender_cells(s, every, c.name, "torch", formula_cell(formula)), f"{gap:.3g}"]
            for c in ENGINES]


def switch_table(name: str, sw: Switch, results: dict[str, tuple[list[list[PairResult]], float, float | None]],
                 nproc: int, batch: int, wide_: bool = False) -> Table:
    """``results``: per workload, its runs, the largest gap between the engines' losses and the formula's bytes."""
    rows = [row for w, (runs, gap, formula) in results.items() for row in switch_rows(w, runs, formula, gap)]
    notes = [f"{k}: {WORKLOADS[k][0]}." for k in results if k in WORKLOADS] + [
        "vs torch: engine='torch''s median step over this one's (above 1: faster); RSS vs torch: peak RSS "
        "increase over its (below 1: less).", PAIRED_NOTE, NOT_SEEN_NOTE,
        sw.formula_note,
        "loss gap: the largest difference of the two engines' losses in their last runs."]
    notes += [f"{w}: {runs_note(runs)}" for w, (runs, _, _) in results.items() if len(runs) > 1]
    title = (f"{name}: Trainer({shown(sw.strategy_for(nproc))}, engine='shardwise' | 'torch'), {nproc} ranks, global "
             f"batch {batch}, AdamW fp32, the engines alternating in the same ranks")
    return table(title, COLUMNS, rows, wide_, " ".join(x for x in notes if x))


def loss_gap(losses: dict[str, list[float]]) -> float:
    """The largest difference of the two engines' losses, step by step."""
    return max((abs(a - b) for a, b in zip(losses.get("shardwise", []), losses.get("torch", []))), default=0.0)


def switch_pair(name: str, a: argparse.Namespace) -> Table:
    """``shardwise bench --pairs NAME`` for a name of :data:`SWITCHES`: every workload, ``--runs`` launches each."""
    sw = SWITCHES[name]
    results = {}
    for w in sw.workloads:
        made = WORKLOADS[w][1]()
        gaps: list[float] = []

        def one() -> list[PairResult]:
            res, losses = run_switch(sw.strategy_for(a.nproc), made, a.nproc, a.batch, a.reps, a.steps, a.accelerator)
            gaps.append(loss_gap(losses))
            return res
        runs = over_runs(getattr(a, "runs", 1), one)
        results[w] = (runs, max(gaps), sw.formula(made[0], a.nproc, a.batch))
    return switch_table(name, sw, results, a.nproc, a.batch, wide(a))


__all__ = ["ENGINES", "GPT_", "MLP", "SWITCHES", "WORKLOADS", "EngineContender", "Switch", "fit_once", "loss_gap",
           "fsdp_tp", "grad_bytes", "run_switch", "shown", "switch_pair", "switch_rows", "switch_table"]
