"""Benchmarks of the classic paradigms: DP against DDP, parameter servers against DDP, all-reduce algorithms.

Each function has the signature of :func:`shardwise.bench.pairs.ddp_pair`
(``a`` is the ``shardwise bench`` namespace: ``nproc``, ``reps``, ``steps``,
``batch``, ``accelerator``), returns a rich table, and saves a PNG plot to
``a.plot_dir`` (default ``benchmarks/plots``; ``None`` saves nothing).
Also runnable on its own::

    python -m shardwise.bench.classic dp_vs_ddp ps_vs_ddp allreduce --reps 3 --steps 10
"""
from __future__ import annotations

import argparse
import functools
import os
import pickle
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.nn import functional as F

import shardwise.dims as dims  # as a module: dims.DP is the dimension, DP the strategy
from shardwise.bench import add_arguments
from shardwise.bench.harness import optimizer_step, spawn_collect, timed_steps
from shardwise.bench.tables import Column, table, wide
from shardwise.comm.algorithms import (
    naive_allreduce,
    naive_bytes,
    ring_allreduce,
    ring_bytes,
)
from shardwise.comm.topology import Topology
from shardwise.commands import plots
from shardwise.console import make_console
from shardwise.fit.trainer import Trainer
from shardwise.parallel.dp.ddp import DDPModule
from shardwise.strategies.dp.ddp import DDP
from shardwise.strategies.dp.threaded import DP
from shardwise.strategies.ps import ParameterServer
from shardwise.workloads import mlp1024

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
KB = 1024
ALLREDUCE_SIZES = (KB, 32 * KB, KB * KB, 8 * KB * KB, 64 * KB * KB)
ALLREDUCE_WORLDS = (2, 4, 8)


# ---- shared helpers ----------------------------------------------------------------------------
def plot_path(a: argparse.Namespace, name: str) -> str | None:
    """Where to save plot ``name``: under ``a.plot_dir`` (default benchmarks/plots), or None."""
    d = getattr(a, "plot_dir", "benchmarks/plots")
    if d is None:
        return None
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, name)


def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB"


def _size(b: int) -> str:
    return f"{b // (KB * KB)} MB" if b >= KB * KB else f"{b // KB} KB"


def _timed_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                 warmup: int, steps: int, before: Callable[[], None]) -> list[float]:
    step = optimizer_step(model, opt, F.mse_loss, x, y)
    cuda = x.device.type == "cuda"
    timed_steps(step, warmup, before, cuda)
    return timed_steps(step, steps, before, cuda)


# ---- DP against DDP ------------------------------------------------------------------------------
def _one_core_per_device(device: torch.device) -> None:
    # On CPU a "device" is one core: DP's N replica threads and DDP's N processes
    # then occupy N cores alike, and the N=1 baseline is one core too.
    if device.type == "cpu":
        torch.set_num_threads(1)


def _dp_worker(rank: int, device: torch.device, n: int, batch: int, reps: int, steps: int, path: str) -> None:
    _one_core_per_device(device)
    work = mlp1024()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 1024, generator=g).to(device), torch.randn(batch, 1024, generator=g).to(device)
    strat = DP()
    strat.sizes(n)
    topo = Topology.create(device)
    reps_t = []
    for _ in range(reps):
        model, opt = strat.setup(work.make_model(), ADAMW, topo)
        reps_t.append(statistics.median(_timed_steps(model, opt, x, y, 2, steps, lambda: None)))
    with open(path, "wb") as f:
        pickle.dump(statistics.median(reps_t), f)


def _ddp_worker(rank: int, device: torch.device, batch: int, reps: int, steps: int, path: str) -> None:
    _one_core_per_device(device)
    work = mlp1024()
    topo = Topology.create(device)
    comm = topo.comm(dims.DP)
    n = comm.size
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch // n, 1024, generator=g).to(device)
    y = torch.randn(batch // n, 1024, generator=g).to(device)
    reps_t = []
    for _ in range(reps):
        base = work.make_model().to(device)
        model, opt = DDPModule(base, comm), ADAMW(base.parameters())
        times = _timed_steps(model, opt, x, y, 2, steps, lambda: comm.barrier())
        # A step is as slow as its slowest rank.
        reps_t.append(max(comm.all_gather_object(statistics.median(times), name="bench.gather")))
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(statistics.median(reps_t), f)


def dp_vs_ddp(a: argparse.Namespace) -> Table:
    """Single-process DP (threads) against our DDP (processes) on the same devices and global batch."""
    counts = sorted({1, 2, a.nproc})
    rows: list[tuple[int, float, float]] = []
    spread: dict[int, tuple[float, float, float, float]] = {}
    for n in counts:
        # One repetition per launch, alternating which goes first, so that load from
        # other work on the machine falls on both alike (the ratio stays fair).
        times: dict[str, list[float]] = {"DP": [], "DDP": []}
        for rep in range(a.reps):
            order = ("DP", "DDP") if rep % 2 == 0 else ("DDP", "DP")
            for which in order:
                if which == "DP":
                    times["DP"].append(spawn_collect(_dp_worker, 1, n, a.batch, 1, a.steps, accelerator=a.accelerator))
                elif n > 1:
                    times["DDP"].append(spawn_collect(_ddp_worker, n, a.batch, 1, a.steps, accelerator=a.accelerator))
        if n == 1:
            # With one device DDP has nothing to communicate: it is the single-device run, as is DP.
            times["DDP"] = times["DP"]
        rows.append((n, statistics.median(times["DP"]), statistics.median(times["DDP"])))
        spread[n] = (min(times["DP"]), max(times["DP"]), min(times["DDP"]), max(times["DDP"]))
    t = dp_vs_ddp_table(rows, spread, a)
    path = plot_path(a, "dp_vs_ddp.png")
    if path:
        plt = plots.pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(counts, [a.batch / r[1] for r in rows], "o-", label="DP (threads in one process)")
        ax.plot(counts, [a.batch / r[2] for r in rows], "s-", label="DDP (one process per device)")
        ax.set_xlabel(f"devices N ({a.accelerator})")
        ax.set_ylabel("throughput (samples / s)")
        ax.set_xticks(counts)
        ax.set_title("DP vs DDP, 4 x Linear(1024), global batch " + str(a.batch))
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return t


DP_COLUMNS = (Column("devices N"), Column("DP step"), Column("DP samples/s"), Column("DDP step"),
              Column("DDP samples/s"), Column("DDP / DP throughput"))


def dp_vs_ddp_table(rows: list[tuple[int, float, float]], spread: dict[int, tuple[float, float, float, float]],
                    a: argparse.Namespace) -> Table:
    """``rows``: (devices, DP step, DDP step), medians; ``spread``: per device count, (min, max) of each."""
    out = []
    for n, dp_t, ddp_t in rows:
        lo, hi, dlo, dhi = spread[n]
        out.append([str(n), f"{1e3 * dp_t:.1f} ms ({1e3 * lo:.0f}-{1e3 * hi:.0f})", f"{a.batch / dp_t:,.0f}",
                    f"{1e3 * ddp_t:.1f} ms ({1e3 * dlo:.0f}-{1e3 * dhi:.0f})", f"{a.batch / ddp_t:,.0f}",
                    f"{dp_t / ddp_t:.2f}x"])
    return table(f"DP (1 process, N threads) vs DDP (N processes): 4 x Linear(1024) MLP, global batch {a.batch}, "
                 f"AdamW, {a.accelerator}, median (min-max) of {a.reps} alternating launches", DP_COLUMNS, out, wide(a))


# ---- parameter server against DDP ----------------------------------------------------------------
def _ps_configs(workers: int) -> list[tuple[str, str, Any, int]]:
    """(series, label, strategy, processes) for ``workers`` data-parallel workers."""
    return [("DDP", "DDP", DDP(), workers),
            ("PS sync, 1 server", "PS sync, 1 server", ParameterServer(), workers + 1),
            ("PS sync, 2 servers", "PS sync, 2 servers", ParameterServer(servers=2), workers + 2),
            ("PS async, 1 server", f"PS async, 1 server, staleness <= {workers}",
             ParameterServer(mode="async", max_staleness=workers), workers + 1)]


PS_COLUMNS = (Column("configuration", left=True), Column("workers"), Column("processes", detail=True),
              Column("worker step"), Column("samples/s"), Column("max staleness", detail=True),
              Column("busiest receives / step"), Column("formula", detail=True))


def ps_vs_ddp(a: argparse.Namespace) -> Table:
    """Throughput and the busiest rank's received bytes per step, as the number of workers grows."""
    workers_list = sorted({1, 2, max(2, a.nproc)} | {4})
    work = mlp1024()
    p_bytes = sum(p.numel() * p.element_size() for p in work.make_model().parameters())
    results: dict[str, list[tuple[int, float, float]]] = {}
    rows: list[list[str]] = []
    for w in workers_list:
        configs = _ps_configs(w)
        seen: dict[str, list[tuple[float, float, float, int]]] = {c[1]: [] for c in configs}
        for rep in range(a.reps):
            # Rotate the order every repetition so that background load falls on every configuration alike.
            for _, label, strat, procs in configs[rep % len(configs):] + configs[:rep % len(configs)]:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    run = Trainer(strat, procs, accelerator=a.accelerator, progress=False).fit(
                        work.make_model(), work.train, work.loss_fn, ADAMW, batch_size=a.batch,
                        max_steps=a.steps)
                workers_stats = [s for s in run.stats if s.get("role", "worker") == "worker"]
                step = statistics.median(s["step_time_s"] for s in workers_stats)
                if label.startswith("PS async"):
                    # Workers run free: the job's rate is the sum of every worker's own rate.
                    rate = sum((a.batch / w) / s["step_time_s"] for s in workers_stats)
                else:
                    rate = a.batch / max(s["step_time_s"] for s in workers_stats)
                busiest = max(s["comm_received_bytes_per_step"] for s in run.stats)
                stale = max((max(s["staleness"]) for s in run.stats if s.get("role") == "server"), default=-1)
                seen[label].append((step, rate, busiest, stale))
        for series, label, strat, procs in configs:
            runs = seen[label]
            steps_t, rates = [r[0] for r in runs], [r[1] for r in runs]
            busiest, stale = max(r[2] for r in runs), max(r[3] for r in runs)
            servers = getattr(strat, "servers", 0)
            if not servers:
                formula, text = 2 * (w - 1) * p_bytes / w, "2(N-1)/N x P"
            else:
                # A server receives W pushes of its shard plus a header; a worker pulls the whole model.
                shard = p_bytes / servers
                formula = max(w * (shard + 16), p_bytes)
                text = ("W x (P + 16)" if servers == 1 else f"W x (P/{servers} + 16)") \
                    if w * (shard + 16) >= p_bytes else "P (a worker's pull)"
            results.setdefault(series, []).append((w, statistics.median(rates), busiest))
            step_cell = f"{1e3 * statistics.median(steps_t):.1f} ms ({1e3 * min(steps_t):.0f}-{1e3 * max(steps_t):.0f})"
            rows.append([label, str(w), str(procs), step_cell, f"{statistics.median(rates):,.0f}",
                         "-" if stale < 0 else str(stale), _mib(busiest), f"{text} = {_mib(formula)}"])
    t = table(f"Parameter server vs DDP: 4 x Linear(1024) MLP ({_mib(p_bytes)} of fp32 weights), global batch "
              f"{a.batch}, AdamW, {a.steps} steps, {a.accelerator}; median (min-max) of {a.reps} runs, "
              "configurations alternating", PS_COLUMNS, rows, wide(a))
    path = plot_path(a, "ps_vs_ddp.png")
    if path:
        _plot_ps_vs_ddp(path, results, workers_list, a)
    return t


def _plot_ps_vs_ddp(path: str, results: dict[str, list[tuple[int, float, float]]], workers_list: list[int],
                    a: argparse.Namespace) -> None:
    """Throughput and the busiest rank's inbound bytes against the number of workers, one line per series."""
    plt = plots.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, pts in results.items():
        ws = [p[0] for p in pts]
        ax1.plot(ws, [p[1] for p in pts], "o-", label=label)
        ax2.plot(ws, [p[2] / 2**20 for p in pts], "o-", label=label)
    for ax in (ax1, ax2):
        ax.set_xlabel("workers W")
        ax.set_xticks(workers_list)
        ax.legend(fontsize=8)
    ax1.set_ylabel("throughput (samples / s)")
    ax1.set_title("throughput")
    ax2.set_ylabel("MiB received per step by the busiest rank")
    ax2.set_title("busiest rank's inbound traffic")
    fig.suptitle(f"Parameter server vs DDP, 4 x Linear(1024), global batch {a.batch}, {a.accelerator}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- all-reduce algorithms ----------------------------------------------------------------------
def _allreduce_worker(rank: int, device: torch.device, sizes: tuple[int, ...], reps: int, path: str) -> None:
    topo = Topology.create(device)
    comm = topo.comm(dims.DP)
    algos: dict[str, Callable[..., Any]] = {
        "naive": naive_allreduce, "ring": ring_allreduce,
        "native": lambda t, c, name: c.all_reduce(t, name=name, async_op=True)}
    out = []
    for size in sizes:
        t = torch.ones(size // 4, device=device)
        for name, fn in algos.items():
            times = []
            for i in range(reps + 1):  # the first call warms up connections and allocator
                comm.barrier()
                s0, r0 = topo.stats.sent, topo.stats.received
                t0 = time.perf_counter()
                fn(t, comm, "bench.allreduce").wait()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                sent, received = topo.stats.sent - s0, topo.stats.received - r0
                if i:
                    times.append(dt)
            # One all-reduce takes as long as its slowest rank.
            slowest = [max(ts) for ts in zip(*comm.all_gather_object(times, name="bench.gather"))]
            traffic = comm.all_gather_object((sent, received), name="bench.gather")
            out.append({"n": comm.size, "size": size, "algo": name, "time": statistics.median(slowest),
                        "sent": [x[0] for x in traffic], "received": [x[1] for x in traffic]})
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(out, f)


def allreduce_algorithms(a: argparse.Namespace) -> Table:
    """Naive vs ring vs the backend's all-reduce for world sizes 2, 4, 8 and 1 KB .. 64 MB of fp32."""
    worlds = tuple(getattr(a, "allreduce_worlds", ALLREDUCE_WORLDS))
    sizes = tuple(getattr(a, "allreduce_sizes", ALLREDUCE_SIZES))
    rows: list[dict[str, Any]] = []
    for n in worlds:
        rows += spawn_collect(_allreduce_worker, n, sizes, a.reps, accelerator=a.accelerator)
    t = allreduce_table(rows, a)
    path = plot_path(a, "allreduce_algorithms.png")
    if path:
        plt = plots.pyplot()
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        colors = {"naive": "tab:red", "ring": "tab:blue", "native": "tab:green"}
        styles = {2: ":", 4: "--", 8: "-"}
        for n in worlds:
            for algo in colors:
                pts = [r for r in rows if r["n"] == n and r["algo"] == algo]
                ax1.plot([r["size"] for r in pts], [1e3 * r["time"] for r in pts], styles.get(n, "-"),
                         marker="o", ms=3, color=colors[algo], label=f"{algo}, N={n}")
        ax1.set_xscale("log", base=2)
        ax1.set_yscale("log")
        ax1.set_xlabel("message size S (bytes)")
        ax1.set_ylabel("time per all-reduce (ms)")
        ax1.set_title("time")
        ax1.legend(fontsize=7, ncol=3)
        big = max(sizes)
        for algo, marker in (("naive", "o"), ("ring", "s")):
            pts = [r for r in rows if r["size"] == big and r["algo"] == algo]
            ax2.plot([r["n"] for r in pts], [max(r["received"]) / big for r in pts], marker, ms=8,
                     color=colors[algo], label=f"{algo}: measured, busiest rank")
        ns = list(worlds)
        ax2.plot(ns, [n - 1 for n in ns], "-", color=colors["naive"], alpha=0.5, label="(N-1) x S (naive master)")
        ax2.plot(ns, [2 * (n - 1) / n for n in ns], "-", color=colors["ring"], alpha=0.5, label="2(N-1)/N x S (ring)")
        ax2.set_xlabel("ranks N")
        ax2.set_xticks(ns)
        ax2.set_ylabel("bytes received per rank / S")
        ax2.set_title(f"traffic of the busiest rank, S = {_size(big)}")
        ax2.legend(fontsize=8)
        fig.suptitle(f"naive vs ring vs native all-reduce ({a.accelerator})")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return t


ALLREDUCE_COLUMNS = (Column("N"), Column("size S"), Column("algorithm"), Column("time"), Column("algbw"),
                     Column("busiest sends", detail=True), Column("busiest receives"),
                     Column("formula (busiest)", detail=True), Column("/ S"))


def allreduce_table(rows: list[dict[str, Any]], a: argparse.Namespace) -> Table:
    """One row per (N, size, algorithm) of :func:`_allreduce_worker`'s results."""
    out = []
    for r in rows:
        n, s = r["n"], r["size"]
        if r["algo"] == "naive":
            fb, label = max(naive_bytes(s // 4, n, 4, k)[1] for k in range(n)), "(N-1) S"
        elif r["algo"] == "ring":
            fb, label = max(ring_bytes(s // 4, n, 4, k)[1] for k in range(n)), "2(N-1)/N S"
        else:
            fb, label = 2 * (n - 1) * s // n, "2(N-1)/N S (counted by formula)"
        sent, recv = max(r["sent"]), max(r["received"])
        out.append([str(n), _size(s), r["algo"], f"{1e3 * r['time']:.3f} ms", f"{s / r['time'] / 2**30:.2f} GiB/s",
                    f"{sent:,}", f"{recv:,}", f"{label} = {fb:,}", f"{recv / s:.3f}"])
    return table(f"All-reduce algorithms on {a.accelerator} (gloo for 'native'), fp32, median of {a.reps} (slowest "
                 "rank each)", ALLREDUCE_COLUMNS, out, wide(a))


BENCHES: dict[str, Callable[[argparse.Namespace], Table]] = {
    "dp_vs_ddp": dp_vs_ddp, "ps_vs_ddp": ps_vs_ddp, "allreduce": allreduce_algorithms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardwise.bench.classic", description=__doc__)
    p.add_argument("which", nargs="+", choices=list(BENCHES))
    add_arguments(p)
    p.add_argument("--plot-dir", dest="plot_dir", default="benchmarks/plots")
    a = p.parse_args(argv)
    console = make_console(min_width=140)
    for name in a.which:
        console.print(BENCHES[name](a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
