"""Benchmark pairs for model parallelism: our 1F1B against ``torch.distributed.pipelining``,
our tensor parallelism against DTensor's ``parallelize_module``.

Both contenders run in the same processes on the same model, weights and
data; repetitions alternate which goes first; medians are reported through
:func:`shardwise.bench.harness.summarize`. Unlike the data-parallel pairs,
every rank of a model-parallel group must see the same batch, and a pipeline
step is not ``model(x).backward()``, so each contender here provides a whole
training step.
"""
from __future__ import annotations

import argparse
import copy
import functools
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn import functional as F

from shardwise.bench.harness import (
    PairResult,
    alternate,
    gather_results,
    measure,
    merged,
    optimizer_step,
    over_runs,
    pair_table,
    spawn_collect,
    summarize,
)
from shardwise.bench.tables import wide
from shardwise.comm.topology import Topology
from shardwise.dims import DP, PP, TP
from shardwise.models import GPT, Block, GPTConfig, lm_loss
from shardwise.parallel.pp.build import build_pipeline, stage_starts
from shardwise.parallel.pp.layers import pipeline_layers
from shardwise.parallel.pp.run import pipeline_step
from shardwise.parallel.pp.schedules import (
    Recorder,
    bubble_fraction,
    default_chunks,
    gpipe_bubble,
    peak_in_flight,
    schedule_facts,
    simulate,
)
from shardwise.parallel.pp.torch_pp import torch_schedule, torch_stage
from shardwise.parallel.tp.apply import apply_tp

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
Step = Callable[[], None]
# build(model, topo, x, y, microbatches) -> one optimizer step as a closure
BuildStep = Callable[[nn.Module, Topology, torch.Tensor, torch.Tensor, int], Step]


@dataclass
class StepContender:
    name: str
    build: BuildStep
    counts_bytes: bool = True


# ---- pipeline: ours vs torch.distributed.pipelining ---------------------------------
def mlp(width: int = 1024, depth: int = 4) -> nn.Sequential:
    """``depth`` x Linear(width) with ReLU between (the mlp1024 benchmark model)."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())][:-1])


def ours_1f1b(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Step:
    pm = build_pipeline(model.to(topo.device), topo)
    opt = ADAMW(pm.parameters())

    def step() -> None:
        pipeline_step(pm, [(x, y)], F.mse_loss, topo, "1f1b", m)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def torch_1f1b(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Step:
    p, r = topo.size(PP), topo.coord(PP)
    layers = pipeline_layers(model)
    starts = stage_starts(layers, p) + [len(layers)]  # the same cut as ours
    sub = nn.Sequential(*[mod for _, mod in layers[starts[r]:starts[r + 1]]]).to(topo.device)
    example = x.chunk(m)[0]
    stage = torch_stage(sub, r, p, topo, example)
    sched = torch_schedule("1f1b", [stage], m, F.mse_loss)
    opt = ADAMW(sub.parameters())

    def step() -> None:
        if r == 0:
            sched.step(x)
        elif r == p - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# ---- tensor parallel: ours vs DTensor -------------------------------------------------
def megatron_mlp(width: int = 1024, blocks: int = 2) -> nn.Sequential:
    """``blocks`` x (Linear(w, 4w), GELU, Linear(4w, w)): the column/row pair of a Megatron MLP."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(blocks)
                           for m in (nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))])


def _tp_plan(model: nn.Sequential) -> dict[str, str]:
    return {str(i): ("colwise" if i % 3 == 0 else "rowwise") for i in range(len(model)) if i % 3 != 1}


def ours_tp(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Step:
    model = apply_tp(model.to(topo.device), _tp_plan(model), topo.comm(TP))  # type: ignore[arg-type]
    return optimizer_step(model, ADAMW(model.parameters()), F.mse_loss, x, y)


def torch_tp(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Step:
    styles = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel()
              for k, v in _tp_plan(model).items()}  # type: ignore[arg-type]
    model = parallelize_module(model.to(topo.device), topo.mesh[TP], styles)  # type: ignore[index,arg-type]
    return optimizer_step(model, ADAMW(model.parameters()), F.mse_loss, x, y)


# ---- the runner ---------------------------------------------------------------------
def _time(c: StepContender, base: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int,
          warmup: int, steps: int) -> tuple[float, int, float]:
    return measure(lambda: c.build(copy.deepcopy(base), topo, x, y, m), topo, x.device.type == "cuda", warmup, steps)


def _worker(rank: int, device: torch.device, blob: bytes, path: str) -> None:
    job = pickle.loads(blob)
    topo = Topology.create(device, **job["sizes"])
    g = torch.Generator().manual_seed(1234)  # the same batch on every rank: one model replica
    x = torch.randn(job["batch"], job["width"], generator=g).to(device)
    y = torch.randn(job["batch"], job["width"], generator=g).to(device)
    res = alternate(job["contenders"], job["reps"], lambda c: _time(
        c, job["model"], topo, x, y, job["microbatches"], job["warmup"], job["steps"]))
    gather_results(res, topo, path)


def run_steps(contenders: tuple[StepContender, StepContender], model: nn.Module, sizes: dict[str, int],
              batch: int, width: int, microbatches: int = 1, reps: int = 5, warmup: int = 3, steps: int = 10,
              accelerator: str = "cpu") -> list[PairResult]:
    """Both contenders' full training steps on ``dp*tp*pp`` ranks; one PairResult per rank."""
    job = dict(contenders=contenders, model=model, sizes=sizes, batch=batch, width=width,
               microbatches=microbatches, reps=reps, warmup=warmup, steps=steps)
    n = sizes[DP] * sizes[TP] * sizes[PP]
    out: list[PairResult] = spawn_collect(_worker, n, pickle.dumps(job), accelerator=accelerator)
    return out


def _summary_worst(results: list[PairResult]) -> dict[str, Any]:
    # Each stage's sent bytes differ (activations one way, gradients the other): report the largest.
    s = summarize(results)
    for n in s["names"]:
        vals = [r.sent_per_step[n] for r in results if r.sent_per_step[n] is not None]
        s[n]["sent_per_step"] = max(vals) if vals else None  # type: ignore[type-var]
    return s


def pp_sizes(stages: int) -> tuple[int, int]:
    """(Linear layers, micro-batches) of the pp pair at ``stages`` stages: 4 and 4 up to 4 stages, then one of
    each per stage, so that every stage holds a layer (the first 16-core run asked 8 stages of a 4-layer MLP, whose
    7 pipeline layers could not fill them) and 1F1B's steady phase is reached."""
    return max(4, stages), max(4, stages)


def pp_pair(a: argparse.Namespace) -> Table:
    """Our 1F1B against torch's ``Schedule1F1B``; ``--runs N`` launches it N times (the paired ratio of each run
    in the caption, with their median and middle half)."""
    n, width = a.nproc, 1024
    depth, m = pp_sizes(n)
    contenders = (StepContender("shardwise 1F1B", ours_1f1b),
                  StepContender("torch Schedule1F1B", torch_1f1b, counts_bytes=False))
    runs = over_runs(getattr(a, "runs", 1), lambda: run_steps(
        contenders, mlp(width, depth), {DP: 1, TP: 1, PP: n}, a.batch, width, m, a.reps, steps=a.steps,
        accelerator=a.accelerator))
    act = a.batch * width * 4  # one boundary's activations (or gradients) over the m micro-batches
    return pair_table(f"PP 1F1B: {depth} x Linear({width}) MLP, {n} stages, {m} micro-batches, batch {a.batch}, AdamW",
                      runs, _summary_worst(merged(runs)), act, "batch x width x 4 B", wide(a))


def tp_pair(a: argparse.Namespace) -> Table:
    n, width, blocks = a.nproc, 1024, 2
    contenders = (StepContender("shardwise TP", ours_tp),
                  StepContender("torch DTensor TP", torch_tp, counts_bytes=False))
    runs = over_runs(getattr(a, "runs", 1), lambda: run_steps(
        contenders, megatron_mlp(width, blocks), {DP: 1, TP: n, PP: 1}, a.batch, width, 1, a.reps, steps=a.steps,
        accelerator=a.accelerator))
    # Per block: one all-reduce forward (g after the row-parallel layer), one backward (f before the
    # column one), except the first block's f: the input needs no gradient, so autograd skips it.
    ar = 2 * (n - 1) * (a.batch * width * 4) // n
    title = (f"TP: {blocks} x Megatron MLP (Linear({width},{4 * width}) col, Linear({4 * width},{width}) row), "
             f"{n} ranks, batch {a.batch}, AdamW")
    return pair_table(title, runs, _summary_worst(merged(runs)), (2 * blocks - 1) * ar,
                      "(2 x blocks - 1) all-reduces", wide(a))


__all__ = ["StepContender", "ascii_timeline", "megatron_mlp", "mlp", "pp_pair", "pp_sizes", "run_steps", "tp_pair"]


# ---- measurements for docs/model_parallel.md ------------------------------------------
class _Sleep(torch.autograd.Function):
    """A layer of known cost: sleeps ``t_f`` in forward and ``t_b`` in backward (no CPU used)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        time.sleep(t_f)
        ctx.t_b = t_b
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.t_b)
        return g, None, None


class SleepLayer(nn.Module):
    def __init__(self, t_f: float, t_b: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.t_f, self.t_b = t_f, t_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Scale first, so the sleep's input needs a gradient even on the first stage.
        return _Sleep.apply(x * self.scale, self.t_f, self.t_b)  # type: ignore[no-any-return]


def _bubble_worker(rank: int, device: torch.device, cases: list[tuple[int, str, float, float]], path: str) -> None:
    p = torch.distributed.get_world_size()
    topo = Topology.create(device, dp=1, tp=1, pp=p)
    rows = []
    for m, schedule, t_f, t_b in cases:
        if t_f > 0:
            model: nn.Module = nn.Sequential(*[SleepLayer(t_f, t_b) for _ in range(p)])
            x = torch.randn(m * 4, 64)
        else:  # real compute: the mlp1024 model
            model = mlp(1024)
            x = torch.randn(m * 16, 1024)
        pm = build_pipeline(model, topo)
        rec = Recorder()
        for _ in range(3):  # the first step exchanges shapes; the last one is measured
            rec.events.clear()
            topo.comm("world").barrier()
            pipeline_step(pm, [(x, torch.zeros_like(x))], F.mse_loss, topo, schedule, m, rec)
        events = rec.gather(topo.comm(PP))
        rows.append((p, m, schedule, "sleep" if t_f > 0 else "mlp1024", bubble_fraction(events)))
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(rows, f)


def measure_bubbles(stages: list[int], micro: list[int], schedule: str = "gpipe", t_f: float = 0.01,
                    t_b: float = 0.02) -> list[tuple[int, int, str, str, float]]:
    """(p, m, schedule, layer kind, measured bubble) from the event recorder, one spawn per p."""
    rows: list[tuple[int, int, str, str, float]] = []
    for p in stages:
        rows += spawn_collect(_bubble_worker, p, [(m, schedule, t_f, t_b) for m in micro])
    return rows


def _memory_worker(rank: int, device: torch.device, m: int, path: str) -> None:
    p = torch.distributed.get_world_size()
    topo = Topology.create(device, dp=1, tp=1, pp=p)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2 * p - 2, n_head=4, n_embd=64)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 128, (4 * m, 64), generator=g)
    out = {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        pm = build_pipeline(GPT(cfg), topo)
        rec = Recorder(track_saved=True)
        pipeline_step(pm, [(x, x)], lm_loss, topo, schedule, m, rec)
        peaks = topo.comm(PP).all_gather_object(rec.peak_saved_bytes, name="bench.mem")
        out[schedule] = (peak_in_flight(rec.gather(topo.comm(PP))), peaks)
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(out, f)


def measure_activation_memory(p: int, m: int) -> dict[str, tuple[dict[int, int], list[int]]]:
    """Per schedule: (peak micro-batches in flight per stage, peak saved activation bytes per stage)."""
    return spawn_collect(_memory_worker, p, m)  # type: ignore[no-any-return]


def _tp_bytes_worker(rank: int, device: torch.device, path: str) -> None:
    n = torch.distributed.get_world_size()
    topo = Topology.create(device, dp=1, tp=n)
    cfg = GPTConfig(n_head=8, n_embd=128)
    torch.manual_seed(0)
    block = Block(cfg)
    plan = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise",
            "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    apply_tp(block, plan, topo.comm(TP))  # type: ignore[arg-type]
    x = torch.randn(8, 32, cfg.n_embd, requires_grad=True)
    s0, c0 = topo.stats.sent, topo.stats.calls
    block(x).sum().backward()
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump((n, topo.stats.sent - s0, topo.stats.calls - c0, 8 * 32 * cfg.n_embd * 4), f)


def measure_tp_block_bytes(sizes: list[int]) -> list[tuple[int, int, int, int]]:
    """(tp, bytes sent per rank for one block's forward+backward, all-reduce calls, activation bytes)."""
    rows = []
    for n in sizes:
        rows.append(spawn_collect(_tp_bytes_worker, n))
    return rows


def ascii_timeline(events: list[Any], unit: float = 1.0) -> str:
    """One line per stage, one character per ``unit`` of time: the micro-batch number for a forward,
    a letter (a = 0, b = 1, ...) for a backward (the input gradient B when the backward is split; over both
    units of a whole backward, which does its W too), a capital letter for a weight gradient W, ``.`` for idle."""
    stages = sorted({e.stage for e in events})
    width = int(round(max(e.end for e in events) / unit))
    lines = []
    for s in stages:
        row = ["."] * width
        for e in (e for e in events if e.stage == s):
            ch = str(e.mb % 10) if e.kind == "F" else chr(ord("A" if e.kind == "W" else "a") + e.mb % 26)
            for i in range(int(round(e.start / unit)), int(round(e.end / unit))):
                row[i] = ch
        lines.append(f"stage {s}: " + "".join(row))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m shardwise.bench.pp.mp {bubble,memory,tpbytes,pairs,timeline}``: the numbers in
    docs/model_parallel.md."""
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.pp.mp")
    ap.add_argument("what", choices=["bubble", "memory", "tpbytes", "pairs", "timeline"])
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--micro", default="1,2,4,8,16")
    ap.add_argument("--schedule", default="gpipe")
    ap.add_argument("--compute", action="store_true", help="bubble: real mlp1024 layers instead of sleeps")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--accelerator", default="cpu")
    a = ap.parse_args(argv)
    console = Console(width=160)
    stages = [int(s) for s in a.stages.split(",")]
    if a.what == "bubble":
        rows = measure_bubbles(stages, [int(m) for m in a.micro.split(",")], a.schedule,
                               *((0.0, 0.0) if a.compute else (0.01, 0.02)))
        t = Table(title=f"{a.schedule} bubble: measured (event recorder) vs (p-1)/(m+p-1)")
        for c in ("p", "m", "layers", "measured", "formula", "measured - formula"):
            t.add_column(c, justify="right")
        for p, m, _, kind, b in rows:
            f = gpipe_bubble(p, m)
            t.add_row(str(p), str(m), kind, f"{b:.4f}", f"{f:.4f}", f"{b - f:+.4f}")
        console.print(t)
    elif a.what == "memory":
        for p in stages:
            for m in [int(x) for x in a.micro.split(",")]:
                out = measure_activation_memory(p, m)
                t = Table(title=f"activations held, p={p} stages, m={m} micro-batches "
                                "(tiny GPT, 4 x 64 tokens each)")
                for c in ("stage", "GPipe in flight", "1F1B in flight", "GPipe saved bytes", "1F1B saved bytes",
                          "ratio"):
                    t.add_column(c, justify="right")
                for s in range(p):
                    g, f = out["gpipe"][1][s], out["1f1b"][1][s]
                    t.add_row(str(s), str(out["gpipe"][0][s]), str(out["1f1b"][0][s]), f"{g:,}", f"{f:,}",
                              f"{g / f:.2f}")
                console.print(t)
    elif a.what == "tpbytes":
        t = Table(title="TP bytes per block per step (forward + backward, one rank) vs 4 all-reduces")
        for c in (TP, "all-reduce calls", "measured bytes", "4 x 2(N-1)/N x B*T*D*4"):
            t.add_column(c, justify="right")
        for n, sent, calls, act in measure_tp_block_bytes(stages):
            t.add_row(str(n), str(calls), f"{sent:,}", f"{4 * (2 * (n - 1) * act // n):,}")
        console.print(t)
    elif a.what == "timeline":
        for p in stages:
            for m in [int(x) for x in a.micro.split(",")]:
                facts, chunks = schedule_facts(a.schedule), default_chunks(a.schedule)
                ev = simulate(a.schedule, p, m, chunks, t_f=1.0 / chunks, t_b=2.0 / chunks)
                idle = facts.idle(p, m, chunks, 1.0, 3.0)  # the table's bubble at the simulator's unit costs
                theory = (f"the table's {idle / (3 * m + idle):.4f}, 1F1B's (p-1)/(m+p-1) = "
                          f"{gpipe_bubble(p, m):.4f}")
                print(f"{a.schedule}, p={p}, m={m} (forward 1, backward 2 time units per micro-batch"
                      f"{', split into B 1 and W 1' if facts.split_backward else ''}"
                      f"{', 2 chunks per rank' if chunks > 1 else ''}): simulated bubble "
                      f"{bubble_fraction(ev):.4f}, {theory}, peak in flight {peak_in_flight(ev)}")
                print(ascii_timeline(ev, 1.0 / chunks))
    else:
        for pair in (pp_pair, tp_pair):
            console.print(pair(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
