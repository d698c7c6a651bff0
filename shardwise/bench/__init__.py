"""`shardwise bench`: each of our implementations next to PyTorch's own, same run."""
from __future__ import annotations

import argparse
import datetime as _dt
import platform

from rich.console import Console
from rich.table import Table

from shardwise.bench.pairs import PAIRS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", default="ddp", help=f"comma-separated, from: {', '.join(PAIRS)} (or 'all')")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions per contender")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--plot", dest="plot_dir", default=None, metavar="DIR",
                   help="also save each comparison's PNG picture under DIR")


def run(a: argparse.Namespace) -> int:
    console = Console(width=max(140, Console().width))
    names = list(PAIRS) if a.pairs == "all" else a.pairs.split(",")
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        console.print(f"unknown pair(s) {unknown}; valid: {', '.join(PAIRS)}")
        return 2
    console.print(f"{_dt.date.today()} on {platform.node()} ({platform.processor() or platform.machine()}), "
                  f"{a.nproc} ranks, {a.reps} alternating repetitions x {a.steps} steps, medians")
    for n in names:
        table = PAIRS[n](a)
        console.print(table)
    if getattr(a, "plot_dir", None):
        from shardwise import plots

        for path in plots.write_all(a.plot_dir, max_devices=a.nproc, steps=a.steps):
            console.print(f"wrote {path}")
    return 0


__all__ = ["add_arguments", "run", "Table"]
