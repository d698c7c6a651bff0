"""Benchmark pair ``zb``: our ZB-H1 pipeline against torch's zero-bubble schedule, and against both 1F1Bs.

Four contenders train the same model, cut into the same stages (one per rank,
at the same place: :func:`~shardwise.parallel.pp.build.stage_starts`), on the
same batch cut into the same micro-batches:

* ``shardwise ZB-H1``: :func:`~shardwise.parallel.pp.run.pipeline_step` with ``schedule="zb-h1"``;
* ``torch ScheduleInterleavedZeroBubble`` (torch 2.13), given a list of one ``PipelineStage`` per rank. It
  accepts one stage per rank, and then runs exactly our ZB-H1's actions (forward F, input gradient I = our B,
  weight gradient W, in the same order on every rank: its schedule IR, read by :func:`torch_order`, is
  compared with :func:`~shardwise.parallel.pp.schedules.zb_h1`'s in the table's caption and in
  tests/bench/test_zb_pair.py);
* ``shardwise 1F1B``: ``schedule="1f1b"`` (the issue asks ZB-H1 against our 1F1B, at 1F1B's memory);
* ``torch Schedule1F1B``: the common reference, as in the ``pp`` pair (its loop runs our 1F1B's order:
  :func:`torch_1f1b_order`).

They run in the same spawned ranks; repetitions rotate which one goes first;
medians as in :mod:`shardwise.bench.harness` (median over a repetition's
timed steps, median over repetitions, then the slowest rank for times and
the largest for memory and bytes). Columns besides those: bytes sent per rank
per step as our ``Comm`` counts them, against :func:`expected_sent`
(activations forward, their gradients backward, over the ``m`` micro-batches),
and each schedule's bubble on the model clock
(:func:`~shardwise.parallel.pp.schedules.simulate`, ``F = B = W = 1``; torch's
schedules are simulated from their own action lists), and the activation
bytes autograd held for backward at the peak of one step, per rank
(:class:`~shardwise.parallel.checkpointing.SavedActivations`). One untimed step per contender from the
same weights gives the loss and gradients that the caption compares (ours ZB-H1 against
torch's).
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import pickle
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble
from torch.nn import functional as F

from shardwise.bench.harness import NOT_SEEN, NOT_SEEN_NOTE, PAIRED_NOTE, measure, ratio_text, spawn_collect
from shardwise.bench.harness import paired as harness_paired
from shardwise.bench.pp.mp import mlp
from shardwise.bench.tables import Column, table, wide
from shardwise.comm.topology import Topology
from shardwise.dims import PP, WORLD
from shardwise.parallel.checkpointing import SavedActivations
from shardwise.parallel.pp.build import build_pipeline, stage_starts
from shardwise.parallel.pp.layers import pipeline_layers
from shardwise.parallel.pp.placement import Placement
from shardwise.parallel.pp.run import pipeline_step
from shardwise.parallel.pp.schedules import Action, bubble_fraction, get_schedule
from shardwise.parallel.pp.timeline import replay
from shardwise.stats import AllocatedPeak

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
WIDTH, DEPTH = 1024, 8  # 8 x Linear(1024): 2 layers per stage at p = 4
MICROBATCHES = 8
ALLOC_STEPS = 3  # steps in the tensor-peak measurement: the optimizer's state exists from the first on
ZB, F1B, TORCH_ZB, TORCH_1F1B = "zb-h1", "1f1b", "torch-zb", "torch-1f1b"
CPU_NOTE = ("CPU / step: the process CPU time of a timed step (every thread), median of the repetitions, summed "
            "over the ranks; where ranks share cores (more ranks than cores) it, not one rank's wall clock, sets "
            "the pace, and it varies less from run to run.")
Order = list[str]  # per rank, its compute actions in order, e.g. "F0 F1 B0 W0 ...": kind F, B or W, micro-batch


class Built:
    """A contender's training step on this rank, callable (one optimizer step: the harness times it).

    ``run(update)`` returns the step's mean loss on the last stage (None elsewhere); ``params``: this rank's
    stage parameters, in layer order; ``order``: the schedule's actions of every rank (ours from
    :func:`~shardwise.parallel.pp.schedules.get_schedule`, torch's zero-bubble one from its schedule IR, its 1F1B's
    from :func:`torch_1f1b_order`)."""

    def __init__(self, run: Callable[[], torch.Tensor | None], opt: torch.optim.Optimizer, params: list[nn.Parameter],
                 order: Order) -> None:
        self._run, self.opt, self.params, self.order = run, opt, params, order

    def run(self, update: bool = True) -> torch.Tensor | None:
        loss = self._run()
        if update:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss

    def __call__(self) -> None:
        self.run()


BuildFn = Callable[[nn.Module, Topology, torch.Tensor, torch.Tensor, int], Built]


@dataclass
class ZBContender:
    name: str
    key: str
    build: BuildFn
    counts_bytes: bool = True


def our_order(schedule: str, p: int, m: int) -> Order:
    return [" ".join(f"{a.kind}{a.mb}" for a in get_schedule(schedule)(p, m, s, 1)) for s in range(p)]


def our_pipeline(schedule: str, model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int,
          chunks: int = 1, shape: str = "loop", order: Callable[[str, int, int], Order] | None = None) -> Built:
    """Our pipeline for ``schedule`` (``chunks`` per rank placed as ``shape``), timed by the pair's harness;
    ``order`` lists its actions per rank (default :func:`our_order`)."""
    pm = build_pipeline(model.to(topo.device), topo, chunks=chunks, shape=shape)
    params = list(pm.parameters())
    return Built(lambda: pipeline_step(pm, [(x, y)], F.mse_loss, topo, schedule, m), ADAMW(params), params,
                 (order or our_order)(schedule, topo.size(PP), m))


def ours_zb(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Built:
    return our_pipeline(ZB, model, topo, x, y, m)


def ours_1f1b(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Built:
    return our_pipeline(F1B, model, topo, x, y, m)


def _torch_stage(model: nn.Module, topo: Topology, x: torch.Tensor, m: int) -> tuple[nn.Sequential, PipelineStage]:
    """This rank's stage for torch's schedules: the same layers ours keeps (the same cut)."""
    p, r = topo.size(PP), topo.coord(PP)
    layers = pipeline_layers(model)
    starts = stage_starts(layers, p) + [len(layers)]
    sub = nn.Sequential(*[mod for _, mod in layers[starts[r]:starts[r + 1]]]).to(topo.device)
    return sub, PipelineStage(sub, r, p, topo.device, input_args=(x.chunk(m)[0],), group=topo.group(PP))


_KINDS = {"F": "F", "I": "B", "B": "B", "W": "W"}  # torch's computation types -> ours (I: backward input)


def torch_order(pipeline_order: dict[int, list[Any]]) -> Order:
    """torch's compute-only schedule IR (``rank -> [_Action | None]``, None an idle slot) in our notation: a
    full backward (``B``) and a backward-input (``I``) both become our ``B``; other actions (Schedule1F1B's
    final ``REDUCE_GRAD``) are not compute on a micro-batch and are left out."""
    return [" ".join(f"{_KINDS[a.computation_type.value]}{a.microbatch_index}" for a in pipeline_order[r]
                     if a is not None and a.computation_type.value in _KINDS) for r in sorted(pipeline_order)]


def _torch_run(sched: Any, topo: Topology, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    p, r = topo.size(PP), topo.coord(PP)

    def run() -> torch.Tensor | None:
        if r == 0:
            sched.step(x)
        elif r == p - 1:
            losses: list[torch.Tensor] = []
            sched.step(target=y, losses=losses)
            return torch.stack([t.detach() for t in losses]).mean()
        else:
            sched.step()
        return None
    return run


def torch_zb(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Built:
    sub, stage = _torch_stage(model, topo, x, m)
    sched = ScheduleInterleavedZeroBubble([stage], n_microbatches=m, loss_fn=F.mse_loss)
    params = list(sub.parameters())
    return Built(_torch_run(sched, topo, x, y), ADAMW(params), params, torch_order(sched.pipeline_order))


def torch_1f1b(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Built:
    sub, stage = _torch_stage(model, topo, x, m)
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=F.mse_loss)
    params = list(sub.parameters())
    return Built(_torch_run(sched, topo, x, y), ADAMW(params), params, torch_1f1b_order(topo.size(PP), m))


def torch_1f1b_order(p: int, m: int) -> Order:
    """The actions ``Schedule1F1B._step_microbatches`` runs (torch 2.13): ``min(m, p - s)`` forwards, then a
    backward and a forward in turn until the forwards are done, then the remaining backwards. Not its schedule
    IR (``_get_pipeline_order``, which only draws the schedule): that one numbers the last rank's micro-batches
    1..m (``F1 B0 F2 B1 ... F8 B7`` for m = 8: its forward counter starts one ahead on a rank without warm-up
    forwards), which would never run and cannot be simulated."""
    out = []
    for s in range(p):
        warm = min(m, p - s)
        acts = [f"F{i}" for i in range(warm)]
        for b in range(m - warm):
            acts += [f"B{b}", f"F{warm + b}"]
        out.append(" ".join(acts + [f"B{b}" for b in range(m - warm, m)]))
    return out


# torch ZB: ScheduleInterleavedZeroBubble; torch 1F1B: Schedule1F1B (short names: the tables' first column).
CONTENDERS = (ZBContender("shardwise ZB-H1", ZB, ours_zb),
              ZBContender("torch ZB", TORCH_ZB, torch_zb, counts_bytes=False),
              ZBContender("shardwise 1F1B", F1B, ours_1f1b),
              ZBContender("torch 1F1B", TORCH_1F1B, torch_1f1b, counts_bytes=False))


# ---- running -------------------------------------------------------------------------------------
def batch(n: int, width: int, dtype: torch.dtype, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank (one model replica): inputs and regression targets."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g).to(dtype), torch.randn(n, width, generator=g).to(dtype)


@dataclass
class RankResult:
    """One rank's figures, per contender key: step times, peak RSS increases, bytes sent per step, process CPU
    seconds per step (one per repetition); from one untimed step from the common weights, the loss (last rank,
    None elsewhere) and the largest difference of this rank's gradients from ZB-H1's, and the peak bytes
    autograd saved for backward (:class:`~shardwise.parallel.checkpointing.SavedActivations`: each storage
    once, parameters and the batch left out, released when autograd drops them: at B, or at W under a split
    backward); the peak bytes in live tensors over building the contender and :data:`ALLOC_STEPS` optimizer
    steps (:class:`~shardwise.stats.AllocatedPeak`); the schedule."""

    times: dict[str, list[float]] = field(default_factory=dict)
    rss: dict[str, list[int]] = field(default_factory=dict)
    sent: dict[str, list[float]] = field(default_factory=dict)
    loss: dict[str, float | None] = field(default_factory=dict)
    grad_gap: dict[str, float] = field(default_factory=dict)
    saved: dict[str, int] = field(default_factory=dict)  # peak activation bytes autograd held in that step
    alloc: dict[str, int] = field(default_factory=dict)  # peak bytes in live tensors: build and ALLOC_STEPS steps
    cpu: dict[str, list[float]] = field(default_factory=dict)  # process CPU seconds per step, one per repetition
    order: dict[str, Order] = field(default_factory=dict)


def _worker(rank: int, device: torch.device, blob: bytes, path: str) -> None:
    job = pickle.loads(blob)
    p = torch.distributed.get_world_size()
    topo = Topology.create(device, dp=1, tp=1, pp=p)
    base: nn.Module = job["model"].to(job["dtype"])
    x, y = (t.to(device) for t in batch(job["batch"], job["width"], job["dtype"]))
    m = job["microbatches"]
    contenders: tuple[ZBContender, ...] = job["contenders"]
    res = RankResult()
    grads: dict[str, torch.Tensor] = {}
    for c in contenders:  # one untimed step each from the same weights: the loss and gradients to compare
        built = c.build(copy.deepcopy(base), topo, x, y, m)
        saved = SavedActivations(built.params, [x, y])
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = built.run(update=False)
        res.saved[c.key] = saved.peak
        res.loss[c.key] = None if loss is None else float(loss)
        grads[c.key] = torch.cat([q.grad.detach().flatten().cpu() for q in built.params])  # type: ignore[union-attr]
        res.order[c.key] = built.order
        res.times[c.key], res.rss[c.key], res.sent[c.key], res.cpu[c.key] = [], [], [], []
        del built
    ref = grads[contenders[0].key]  # the first contender is the reference (ours)
    res.grad_gap = {k: float((g - ref).abs().max()) for k, g in grads.items()}
    del grads, ref
    for c in contenders:  # the exact tensor peak of build and training, untimed (the profiler slows each step)
        gc.collect()
        with AllocatedPeak() as ap:
            built = c.build(copy.deepcopy(base), topo, x, y, m)
            for _ in range(ALLOC_STEPS):
                built()
            del built
        res.alloc[c.key] = ap.peak
    for rep in range(job["reps"]):  # rotate which contender goes first
        k = rep % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            t, mem, sent = measure(
                lambda c=c: c.build(copy.deepcopy(base), topo, x, y, m),  # type: ignore[misc]
                topo,
                device.type == "cuda",
                job["warmup"],
                job["steps"],
                cpu=res.cpu[c.key],
            )
            res.times[c.key].append(t)
            res.rss[c.key].append(mem)
            res.sent[c.key].append(sent)
    everyone = [RankResult(**d) for d in topo.comm(WORLD).all_gather_object(asdict(res), name="bench.gather")]
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(everyone, f)
    topo.close()


def run_zb(model: nn.Module, nproc: int, batch_size: int, microbatches: int = MICROBATCHES, reps: int = 5,
           warmup: int = 3, steps: int = 10, accelerator: str = "cpu", dtype: torch.dtype = torch.float32,
           contenders: tuple[ZBContender, ...] = CONTENDERS) -> list[RankResult]:
    """Every contender on ``nproc`` pipeline ranks (one stage each); one :class:`RankResult` per rank."""
    if batch_size % microbatches:
        raise SystemExit(f"zb: the batch of {batch_size} does not split into {microbatches} equal micro-batches")
    width = next(q for q in model.parameters()).shape[-1]
    job = {"model": model, "batch": batch_size, "width": width, "microbatches": microbatches, "reps": reps,
           "warmup": warmup, "steps": steps, "dtype": dtype, "contenders": contenders}
    out: list[RankResult] = spawn_collect(_worker, nproc, pickle.dumps(job), accelerator=accelerator)
    return out


# ---- the formulas --------------------------------------------------------------------------------
def expected_sent(rank: int, p: int, batch_size: int, width: int, elem: int = 4) -> int:
    """Bytes one stage sends per step: the activations of its last layer forward (every stage but the last)
    and the gradient of its input backward (every stage but the first), ``batch x width x elem`` each over the
    ``m`` micro-batches (the shape header goes once, in the first step, which is not timed)."""
    return ((rank < p - 1) + (rank > 0)) * batch_size * width * elem


def simulated_bubble(order: Order, p: int) -> float:
    """The schedule's idle share on the model clock with ``F = B = W = 1`` (a whole backward 2)."""
    plans = [[Action(a[0], int(a[1:])) for a in acts.split()] for acts in order]
    return bubble_fraction(replay(plans, Placement(p, 1), t_f=1.0, t_b=2.0, t_w=1.0))


# ---- the table -----------------------------------------------------------------------------------
def summarize(results: list[RankResult]) -> dict[str, dict[str, Any]]:
    """Per contender: medians over repetitions, then the slowest rank (time) or the largest (memory, bytes); CPU
    seconds per step summed over the ranks."""
    first = results[0]
    return {key: {"step_time_s": max(statistics.median(r.times[key]) for r in results),
                  "cpu_s": sum(statistics.median(r.cpu[key]) for r in results),
                  "rss": max(statistics.median(r.rss[key]) for r in results),
                  "sent": max(statistics.median(r.sent[key]) for r in results),
                  "saved": [r.saved[key] for r in results],
                  "alloc": max(r.alloc[key] for r in results),
                  "order": first.order[key]} for key in first.times}


def paired(results: list[RankResult], key: str, other: str) -> tuple[float, float, float]:
    """``other``'s step time over ``key``'s, repetition by repetition, the slowest rank's: the median and the
    middle half (:func:`shardwise.bench.harness.paired`)."""
    return harness_paired([r.times for r in results], key, other)


def paired_text(results: list[RankResult], key: str, other: str) -> str:
    """:func:`paired` as a table cell: ``1.021x (0.990-1.046)``."""
    return ratio_text(*paired(results, key, other))


def loss_gap(results: list[RankResult], key: str = TORCH_ZB, ref: str = ZB,
             loss_rank: int = -1) -> tuple[float, float]:
    """Against the first contender (``ref``, ZB-H1), from the same weights on the same batch: (|loss - its loss|
    on the rank computing the loss (``loss_rank``: the last; rank 0 under a V placement), the largest
    |gradient - its gradient| over every rank's parameters)."""
    la, lb = results[loss_rank].loss[ref], results[loss_rank].loss[key]
    assert la is not None and lb is not None
    return abs(la - lb), max(r.grad_gap[key] for r in results)


def zb_table(results: list[RankResult], contenders: tuple[ZBContender, ...], p: int, m: int, batch_size: int,
             width: int, depth: int, elem: int = 4, wide_: bool = False) -> Table:
    s = summarize(results)
    names = {c.key: c.name for c in contenders}
    counts = {c.key: c.counts_bytes for c in contenders}
    formula = max(expected_sent(r, p, batch_size, width, elem) for r in range(p))
    same = s[ZB]["order"] == s[TORCH_ZB]["order"] if TORCH_ZB in s else False
    dl, dg = loss_gap(results) if TORCH_ZB in s else (float("nan"), float("nan"))
    zb_vs = ""
    if F1B in s:
        zb_vs = (f"shardwise ZB-H1 against shardwise 1F1B: throughput "
                 f"{s[F1B]['step_time_s'] / s[ZB]['step_time_s']:.3f}x, peak tensor bytes "
                 f"{s[ZB]['alloc'] / max(1, s[F1B]['alloc']):.3f}x, peak RSS increase "
                 f"{s[ZB]['rss'] / max(1, s[F1B]['rss']):.3f}x. ")
    caption = (f"{zb_vs}torch ZB: ScheduleInterleavedZeroBubble given one PipelineStage per rank, torch 1F1B: "
               f"Schedule1F1B; torch ZB runs "
               f"{'the same' if same else 'NOT the same'} actions in the same order as ours zb-h1 on every rank "
               f"(its I = our B). First step from the same weights: |loss ZB-H1 - loss torch ZB| = {dl:.3g}, "
               f"largest gradient difference {dg:.3g}. Formula: activations forward and their gradients backward, "
               f"batch x width x {elem} B each, the worst rank (a middle stage sends both). Saved act.: the peak "
               f"bytes autograd held for backward in one step, stage 0 first (saved-tensor hooks; no parameters, "
               f"no batch). Peak tensors: the most bytes in live tensors while the contender was built and "
               f"trained {ALLOC_STEPS} steps (torch's allocator, through the profiler; exact, the largest rank), "
               f"the memory the ratios beside it compare; the peak RSS increase also counts what the C heap "
               f"keeps mapped after frees, and varies from repetition to repetition. Simulated bubble: each "
               f"schedule's actions on the model clock, F = B = W = 1 (1F1B's backward 2): (p-1)/(m+p-1) for 1F1B, "
               f"(p-1)/(3m+p-1) for ZB-H1. {CPU_NOTE} {PAIRED_NOTE} {NOT_SEEN_NOTE} --wide: every column.")
    title = (f"Zero bubble: {depth} x Linear({width}) MLP, {p} stages (one per rank), {m} micro-batches, "
             f"batch {batch_size}, AdamW")
    rows = []
    for key, v in s.items():
        st, mem = v["step_time_s"], v["alloc"]
        vs_t = [f"{s[k]['step_time_s'] / st:.3f}x" if k in s else "" for k in (TORCH_ZB, TORCH_1F1B)]
        vs_t.insert(1, paired_text(results, key, TORCH_ZB) if TORCH_ZB in s else "")
        vs_m = [f"{mem / max(1, s[k]['alloc']):.3f}x" if k in s else "" for k in (TORCH_ZB, TORCH_1F1B)]
        rss = f"{v['rss'] / max(1, s[TORCH_ZB]['rss']):.3f}x" if TORCH_ZB in s else ""
        cpu = f"{v['cpu_s'] / s[TORCH_ZB]['cpu_s']:.3f}x" if TORCH_ZB in s else ""
        rows.append([names[key], f"{simulated_bubble(v['order'], p):.4f}", f"{1e3 * st:.2f} ms", *vs_t,
                     f"{1e3 * v['cpu_s']:.1f} ms", cpu, f"{mem / 2**20:.2f} MiB", *vs_m,
                     f"{v['rss'] / 2**20:.2f} MiB", rss,
                     " / ".join(f"{b / 1024:,.0f}" for b in v["saved"]) + " KiB",
                     f"{v['sent']:,.0f} B" if counts[key] else NOT_SEEN, f"{formula:,} B"])
    return table(title, ZB_COLUMNS, rows, wide_, caption)


# The default columns: time, the paired ratio and the exact memory against torch's zero-bubble schedule.
ZB_COLUMNS = (Column("implementation", left=True), Column("sim. bubble", detail=True), Column("median step"),
              Column("vs torch ZB"), Column("paired vs torch ZB"), Column("vs torch 1F1B", detail=True),
              Column("CPU / step", detail=True), Column("CPU vs torch ZB", detail=True), Column("peak tensors"),
              Column("mem. vs torch ZB"), Column("mem. vs torch 1F1B", detail=True),
              Column("peak RSS +", detail=True), Column("RSS vs torch ZB", detail=True),
              Column("saved act. / rank", detail=True), Column("sent/rank/step", detail=True),
              Column("formula", detail=True))


def zb_pair(a: argparse.Namespace) -> Table:
    """``--nproc`` stages, :data:`MICROBATCHES` micro-batches of ``--batch`` (``shardwise bench --pairs zb`` shows
    this table and, under it, the V half: :func:`shardwise.bench.pp.zbv.zb_pairs`)."""
    model = mlp(WIDTH, DEPTH)
    res = run_zb(model, a.nproc, a.batch, MICROBATCHES, a.reps, steps=a.steps, accelerator=a.accelerator)
    return zb_table(res, CONTENDERS, a.nproc, MICROBATCHES, a.batch, WIDTH, DEPTH, wide_=wide(a))


__all__ = ["ALLOC_STEPS", "CONTENDERS", "CPU_NOTE", "DEPTH", "F1B", "MICROBATCHES", "PAIRED_NOTE", "TORCH_1F1B",
           "TORCH_ZB", "WIDTH", "ZB", "Built", "RankResult", "ZBContender", "batch", "expected_sent", "loss_gap",
           "our_order", "ours_1f1b", "ours_zb", "paired", "paired_text", "run_zb", "simulated_bubble", "summarize",
           "torch_1f1b", "torch_1f1b_order", "torch_order", "torch_zb", "zb_pair", "zb_table"]
