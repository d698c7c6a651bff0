"""The benchmark pairs: ours against PyTorch's implementation of the same idea."""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import importlib
import platform
from collections.abc import Callable

import torch
from rich.table import Table
from torch import nn
from torch.nn import functional as F

from shardwise.bench.harness import (
    Contender,
    merged,
    over_runs,
    pair_table,
    run_pair,
    same_shape_target,
    summarize,
)
from shardwise.bench.tables import WIDTH, wide
from shardwise.comm.topology import Topology
from shardwise.commands import plots
from shardwise.console import make_console
from shardwise.dims import CP, DP, PP, TP
from shardwise.parallel.dp import torch_dp
from shardwise.parallel.dp.ddp import DDPModule
from shardwise.workloads import mlp1024

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def ours_ddp(model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    return DDPModule(model, topo.comm(DP)), ADAMW(model.parameters())


def torch_ddp(model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    return torch_dp.torch_ddp(model, topo), ADAMW(model.parameters())


def ddp_pair(a: argparse.Namespace) -> Table:
    """The hand-built ddp pair (``--hand-built``): our DDPModule against torch's DDP, outside the Trainer."""
    work = mlp1024()
    model = work.make_model()
    n = a.nproc
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    contenders = (Contender("shardwise DDP", ours_ddp), Contender("torch DDP", torch_ddp, counts_bytes=False))
    runs = over_runs(getattr(a, "runs", 1), lambda: run_pair(
        contenders, model, (1024,), same_shape_target, F.mse_loss, nprocs=n, local_batch=a.batch // n, reps=a.reps,
        steps=a.steps, accelerator=a.accelerator))
    return pair_table(f"DDP: 4 x Linear(1024) MLP, {n} ranks, global batch {a.batch}, AdamW", runs,
                      summarize(merged(runs)), 2 * (n - 1) / n * grad_bytes, "2(N-1)/N x grad bytes", wide(a))


def _lazy(target: str) -> Callable[[argparse.Namespace], Table]:
    """A pair that lives in another module, imported only when asked for (they pull in pipelining, DTensor...)."""
    def run(a: argparse.Namespace) -> Table:
        mod, _, fn = target.partition(":")
        return getattr(importlib.import_module(mod), fn)(a)  # type: ignore[no-any-return]
    return run


def _switch_or(name: str, hand_built: Callable[[argparse.Namespace], Table]) -> Callable[[argparse.Namespace], Table]:
    """Pair ``name`` as an engine switch of one Trainer setup (:mod:`shardwise.bench.engines`) when its
    :data:`~shardwise.bench.engines.SWITCHES` has it and the run did not ask for ``--hand-built``; else
    ``hand_built``."""
    def run(a: argparse.Namespace) -> Table:
        engines = importlib.import_module("shardwise.bench.engines")
        if name in engines.SWITCHES and not getattr(a, "hand_built", False):
            return engines.switch_pair(name, a)  # type: ignore[no-any-return]
        return hand_built(a)
    return run


def no_hand_built(name: str) -> Callable[[argparse.Namespace], Table]:
    """The ``--hand-built`` side of a pair that only ever ran as an engine switch: refused, saying so."""
    def run(a: argparse.Namespace) -> Table:
        raise SystemExit(f"{name}: no hand-built pair; run it without --hand-built (an engine switch)")
    return run


# Every pair by name; the hand-built ones that engine="torch" covers run as engine switches (_switch_or).
PAIRS: dict[str, Callable[[argparse.Namespace], Table]] = {
    "ddp": _switch_or("ddp", ddp_pair),
    "zero1": _switch_or("zero1", _lazy("shardwise.bench.zero:zero1_pair")),
    "zero2": _switch_or("zero2", no_hand_built("zero2")),
    "zero3": _switch_or("zero3", _lazy("shardwise.bench.zero:zero3_pair")),
    "fsdp": _switch_or("fsdp", _lazy("shardwise.bench.zero:fsdp_pair")),
    PP: _switch_or(PP, _lazy("shardwise.bench.pp.mp:pp_pair")),
    TP: _switch_or(TP, _lazy("shardwise.bench.pp.mp:tp_pair")),
    "fsdp-tp": _switch_or("fsdp-tp", _lazy("shardwise.bench.compose:fsdp_tp_pair")),
    "dp-vs-ddp": _lazy("shardwise.bench.classic:dp_vs_ddp"),
    "ps-vs-ddp": _lazy("shardwise.bench.classic:ps_vs_ddp"),
    "allreduce": _lazy("shardwise.bench.classic:allreduce_algorithms"),
    CP: _lazy("shardwise.bench.cp:cp_pair"),
    "zb": _lazy("shardwise.bench.pp.zbv:zb_pairs"),  # ZB-H1, then ZBV and DualPipeV
    "moe": _lazy("shardwise.bench.moe:moe_pair"),
    "compile": _lazy("shardwise.bench.compiled:compile_pair"),  # eager against compiled blocks, one rank
    "diloco": _lazy("shardwise.bench.diloco:diloco_pair"),  # DiLoCo against DDP (the baseline there)
}


def run(a: argparse.Namespace) -> int:
    """``shardwise bench``: each pair of ``a.pairs`` (or ``all``) as a table; ``a.plot_dir``: also the PNGs."""
    console = make_console(min_width=300 if wide(a) else WIDTH)  # --wide: no table squeezed
    names = list(PAIRS) if a.pairs == "all" else a.pairs.split(",")
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        console.print(f"unknown pair(s) {unknown}; valid: {', '.join(PAIRS)}")
        return 2
    console.print(f"{_dt.date.today()} on {platform.node()} ({platform.processor() or platform.machine()}), "
                  f"{a.nproc} ranks, {a.reps} alternating repetitions x {a.steps} steps, medians"
                  + (f", {a.runs} runs" if getattr(a, "runs", 1) > 1 else ""))
    for n in names:
        table = PAIRS[n](a)
        console.print(table)
    if getattr(a, "plot_dir", None):
        for path in plots.write_all(a.plot_dir, max_devices=a.nproc, steps=a.steps):
            console.print(f"wrote {path}")
    return 0
