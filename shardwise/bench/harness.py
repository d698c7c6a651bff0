"""Side-by-side benchmarking of two implementations inside the same ranks.

Both contenders run in the same processes, on the same model, data and world
size; repetitions alternate which goes first (so warm caches and background
load favour neither); we report medians. A contender is a function that
builds ``(model, optimizer, step_sent_bytes)`` from a fresh model copy.
"""
from __future__ import annotations

import copy
import gc
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.table import Table
from torch import nn

from shardwise import launch
from shardwise.bench.tables import Column, table
from shardwise.comm.topology import Topology
from shardwise.stats import current_rss_bytes, peak_rss_bytes, release_free_heap, reset_peak_rss

# build(model, topo) -> (model, optimizer); after the contender ran, comm_bytes()
# tells the bytes it sent per step (None when it cannot be observed).
Build = Callable[[nn.Module, Topology], tuple[nn.Module, torch.optim.Optimizer]]


@dataclass
class Contender:
    name: str
    build: Build
    counts_bytes: bool = True  # False for PyTorch's own (its traffic is not visible to us)


@dataclass
class PairResult:
    names: tuple[str, str]
    step_times: dict[str, list[float]] = field(default_factory=dict)   # per repetition, median over steps
    peak_rss_delta: dict[str, list[int]] = field(default_factory=dict)  # bytes above the pre-build RSS
    sent_per_step: dict[str, float | None] = field(default_factory=dict)
    losses: dict[str, list[float]] = field(default_factory=dict)  # where a pair keeps them: each one's last run

    def median_time(self, name: str) -> float:
        return statistics.median(self.step_times[name])

    def median_mem(self, name: str) -> int:
        return int(statistics.median(self.peak_rss_delta[name]))


Step = Callable[[], None]


def optimizer_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                   x: torch.Tensor, y: torch.Tensor) -> Step:
    """One training step on a fixed batch, as a closure: forward, loss, backward, update, clear."""
    def step() -> None:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def timed_steps(step: Step, n: int, before: Step, cuda: bool) -> list[float]:
    """Seconds each of ``n`` calls of ``step`` took; ``before`` runs untimed first (a barrier lines
    the ranks up, so a step's time is not another rank's lateness)."""
    times = []
    for _ in range(n):
        before()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def measure(build: Callable[[], Step], topo: Topology, cuda: bool, warmup: int, steps: int,
            trim: bool = True, cpu: list[float] | None = None) -> tuple[float, int, float]:
    """Build a contender's step and time it: (median step s, peak RSS increase, bytes sent per step).

    The RSS baseline is taken before ``build``, so the wrapped model, its
    optimizer state and buffers all count; bytes are counted after warm-up.
    ``cpu``, when given, gets the process's CPU seconds per timed step (every thread's, the barriers between
    steps included): where ranks share cores, their CPU time, not the wall clock of one, sets the pace.
    """
    gc.collect()
    if trim:
        release_free_heap()
    reset_peak_rss()
    before = current_rss_bytes()
    step = build()
    barrier = topo.comm("world").barrier
    timed_steps(step, warmup, barrier, cuda)
    sent0 = topo.stats.sent
    c0 = time.process_time()
    times = timed_steps(step, steps, barrier, cuda)
    if cpu is not None:
        cpu.append((time.process_time() - c0) / steps)
    mem = peak_rss_bytes() - before
    sent = (topo.stats.sent - sent0) / steps
    del step
    gc.collect()
    return statistics.median(times), mem, sent


def _time_contender(c: Contender, base: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor,
                    loss_fn: Callable[..., torch.Tensor], warmup: int, steps: int,
                    trim: bool = False) -> tuple[float, int, float]:
    return measure(lambda: optimizer_step(*c.build(copy.deepcopy(base), topo), loss_fn, x, y),
                   topo, x.device.type == "cuda", warmup, steps, trim)


def _bench_worker(rank: int, device: torch.device, blob: bytes, path: str) -> None:
    job = pickle.loads(blob)
    topo = Topology.create(device)
    base: nn.Module = job["model"].to(device)
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(job["local_batch"], *job["in_shape"], generator=g).to(device)
    y = job["make_target"](x, g).to(device)
    res = alternate(job["contenders"], job["reps"], lambda c: _time_contender(
        c, base, topo, x, y, job["loss_fn"], job["warmup"], job["steps"], trim=job.get("exact_rss", False)))
    gather_results(res, topo, path)


def alternate(contenders: tuple[Any, Any], reps: int,
              time_one: Callable[[Any], tuple[float, float, float]]) -> PairResult:
    """Time two contenders ``reps`` times each, alternating which goes first (so warm caches and
    allocator state favour neither); ``time_one(c)`` returns (median step s, peak RSS increase, sent/step)."""
    a, b = contenders
    res = PairResult((a.name, b.name), {a.name: [], b.name: []}, {a.name: [], b.name: []})
    for rep in range(reps):
        for c in ((a, b) if rep % 2 == 0 else (b, a)):
            t, mem, sent = time_one(c)
            res.step_times[c.name].append(t)
            res.peak_rss_delta[c.name].append(mem)  # type: ignore[arg-type]
            res.sent_per_step[c.name] = sent if c.counts_bytes else None
    return res


def gather_results(res: PairResult, topo: Topology, path: str) -> None:
    """Every rank's result, written by rank 0 to ``path`` for the spawning process to read."""
    everyone = [PairResult(**{**d, "names": tuple(d["names"])})
                for d in topo.comm("world").all_gather_object(asdict(res), name="bench.gather")]
    if topo.rank == 0:
        with open(path, "wb") as f:
            pickle.dump(everyone, f)


def run_pair(contenders: tuple[Contender, Contender], model: nn.Module, in_shape: tuple[int, ...],
             make_target: Callable[[torch.Tensor, torch.Generator], torch.Tensor],
             loss_fn: Callable[..., torch.Tensor], nprocs: int, local_batch: int, reps: int = 5,
             warmup: int = 3, steps: int = 10, accelerator: str = "cpu", exact_rss: bool = True) -> list[PairResult]:
    """Run both contenders on ``nprocs`` ranks; returns one :class:`PairResult` per rank.

    ``exact_rss``: give freed heap memory back to the OS before each contender
    (see :func:`shardwise.stats.release_free_heap`), so that peak RSS increases compare fairly. On by
    default: without it the contender that runs second reuses what the first
    freed (the DDP pair's memory ratio read 0.501x over 7 repetitions and 2.495x
    over 2 without it; 0.905x with it).
    """
    job = dict(model=model, in_shape=in_shape, make_target=make_target, loss_fn=loss_fn,
               contenders=contenders, local_batch=local_batch, reps=reps, warmup=warmup, steps=steps,
               exact_rss=exact_rss)
    out: list[PairResult] = spawn_collect(_bench_worker, nprocs, pickle.dumps(job), accelerator=accelerator)
    return out


def spawn_collect(fn: Callable[..., None], nprocs: int, *args: Any, accelerator: str = "cpu") -> Any:
    """Run ``fn(rank, device, *args, path)`` on ``nprocs`` fresh ranks and return what rank 0 pickled to ``path``."""
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as tmp:
        path = os.path.join(tmp, "out.pkl")
        launch.spawn(fn, nprocs, args=(*args, path), accelerator=accelerator)
        with open(path, "rb") as f:
            return pickle.load(f)


def same_shape_target(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.randn(x.shape, generator=g)


def summarize(results: list[PairResult]) -> dict[str, Any]:
    """Medians over repetitions, then the worst (slowest, largest) rank."""
    a, b = results[0].names
    out: dict[str, Any] = {"names": (a, b)}
    for n in (a, b):
        out[n] = {
            "step_time_s": max(r.median_time(n) for r in results),
            "peak_rss_delta_bytes": max(r.median_mem(n) for r in results),
            "sent_per_step": results[0].sent_per_step[n],
        }
    return out


def middle_half(values: list[float]) -> tuple[float, float, float]:
    """The median of ``values`` and their quartiles (25th, 75th percentile, inclusive): the middle half."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    lo, _, hi = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), lo, hi


def paired(times: list[dict[str, list[float]]], key: str, other: str) -> tuple[float, float, float]:
    """``other``'s step time over ``key``'s (``key``'s throughput relative to ``other``'s), repetition by
    repetition, each the slowest rank's (``times``: per rank, per contender, one per repetition): the two ran in
    the same repetition, so a drift of the host slower than a repetition cancels in the ratio, where it only
    averages out in a ratio of medians. Returns the median and the middle half (:func:`middle_half`)."""
    reps = len(times[0][key])
    return middle_half([max(r[other][i] for r in times) / max(r[key][i] for r in times) for i in range(reps)])


def ratio_text(mid: float, lo: float, hi: float) -> str:
    """A median and middle half as a table cell: ``1.021x (0.990-1.046)``."""
    return f"{mid:.3f}x ({lo:.3f}-{hi:.3f})"


def over_runs(runs: int, run: Callable[[], list[PairResult]]) -> list[list[PairResult]]:
    """``run()`` (one launch of a pair's ranks) ``runs`` times, one after the other (``--runs``)."""
    return [run() for _ in range(max(1, runs))]


def merged(runs: list[list[PairResult]]) -> list[PairResult]:
    """Per rank, every run's repetitions one after the other: one result as if it were one long run."""
    out = []
    for per_rank in zip(*runs):
        first = per_rank[0]
        out.append(PairResult(first.names, {n: [t for r in per_rank for t in r.step_times[n]] for n in first.names},
                              {n: [m for r in per_rank for m in r.peak_rss_delta[n]] for n in first.names},
                              dict(first.sent_per_step), dict(first.losses)))
    return out


def runs_note(runs: list[list[PairResult]]) -> str:
    """Under ``--runs N`` (N > 1), a caption sentence: each run's paired ratio of the first contender against
    the second, and their median and middle half; empty for one run."""
    if len(runs) < 2:
        return ""
    ours, theirs = runs[0][0].names
    each = [paired([r.step_times for r in run], ours, theirs)[0] for run in runs]
    return (f"{len(runs)} runs (launches), each run's paired ratio: {', '.join(f'{v:.3f}x' for v in each)}; "
            f"their median and middle half {ratio_text(*middle_half(each))}.")


PAIRED_NOTE = ("paired: the other's step over this one's, repetition by repetition (each the slowest rank's median "
               "step; the two ran in the same repetition, so a slowdown of the host that lasts longer than one "
               "repetition hits both and cancels), median and, in brackets, the middle half of the repetitions.")


def _fmt_mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


PAIR_COLUMNS = (Column("implementation", left=True), Column("median step"), Column("vs torch"),
                Column("paired vs torch"), Column("peak RSS +"), Column("RSS vs torch"),
                Column("sent/rank/step"), Column("formula", detail=True))
NOT_SEEN = "not seen"  # the sent cell of torch's own engines: their traffic does not pass through our Comm
NOT_SEEN_NOTE = "not seen: torch's own traffic does not pass through our communication layer (not observable)."


def formula_cell(formula_bytes: float | None) -> str:
    return "" if formula_bytes is None else f"{formula_bytes:,.0f} B"


def contender_cells(summary: dict, every: list[PairResult], name: str, baseline: str, formula: str) -> list[str]:  # type: ignore[type-arg]
    """One contender's cells of a pair's table, against ``baseline``'s (``summary``: :func:`summarize` of
    ``every``): median step, throughput ratio, paired ratio, peak RSS increase and its ratio, bytes sent, the
    formula's bytes."""
    s, base = summary[name], summary[baseline]
    sent = s["sent_per_step"]
    return [f"{1e3 * s['step_time_s']:.2f} ms", f"{base['step_time_s'] / s['step_time_s']:.3f}x",
            ratio_text(*paired([r.step_times for r in every], name, baseline)), _fmt_mib(s["peak_rss_delta_bytes"]),
            f"{s['peak_rss_delta_bytes'] / max(1, base['peak_rss_delta_bytes']):.3f}x",
            NOT_SEEN if sent is None else f"{sent:,.0f} B", formula]


def pair_table(title: str, runs: list[list[PairResult]], summary: dict[str, Any],
               formula_bytes: float | None,
               formula_label: str, wide: bool = False) -> Table:
    """One row per contender of a :func:`summarize` result of ``runs`` (one list of per-rank results per launch,
    :func:`merged` before summarizing), torch's own as the baseline of the ratios; the paired column over every
    repetition of every run, and under several runs each run's paired ratio in the caption."""
    ours, theirs = summary["names"]
    every = merged(runs)
    formula = formula_cell(formula_bytes)
    rows = [[n, *contender_cells(summary, every, n, theirs, formula)] for n in (ours, theirs)]
    caption = " ".join(x for x in (
        "vs torch: torch's median step over this one's (above 1: faster); RSS vs torch: peak RSS increase over "
        "torch's (below 1: less).", PAIRED_NOTE, NOT_SEEN_NOTE, runs_note(runs),
        f"formula ({formula_label}): {formula}." if formula else "") if x)
    return table(title, PAIR_COLUMNS, rows, wide, caption)
