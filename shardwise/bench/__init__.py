"""`shardwise bench`: each of our implementations next to PyTorch's own, same run."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from shardwise.dims import CP, PP, TP

if TYPE_CHECKING:
    from rich.table import Table

# The pairs' names, for the command line's help without importing torch (shardwise.bench.pairs does);
# tests/commands/test_cli_output.py checks that they are PAIRS' keys.
PAIR_NAMES = ("ddp", "zero1", "zero2", "zero3", "fsdp", PP, TP, "fsdp-tp", "dp-vs-ddp", "ps-vs-ddp", "allreduce", CP,
              "zb", "moe", "compile", "diloco")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", default="ddp", metavar="NAMES",
                   help=f"comma-separated, from: {', '.join(PAIR_NAMES)} (or 'all'; default: ddp)")
    p.add_argument("--nproc", type=int, default=2, metavar="N", help="rank processes of each run (default: 2)")
    p.add_argument("--reps", type=int, default=5, metavar="N",
                   help="alternating repetitions per contender (default: 5)")
    p.add_argument("--steps", type=int, default=10, metavar="N", help="timed steps per repetition (default: 10)")
    p.add_argument("--batch", type=int, default=64, metavar="N", help="global batch (default: 64)")
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"],
                   help="cpu (gloo) or cuda (NCCL) (default: cpu)")
    p.add_argument("--runs", type=int, default=1, metavar="N",
                   help="launch each pair N times; its caption gives each launch's paired ratio and their median "
                        "and middle half (default: 1)")
    p.add_argument("--wide", action="store_true",
                   help="every column (formulas, CPU time, ...); by default each table fits 120 columns")
    p.add_argument("--hand-built", action="store_true",
                   help="for the pairs that switch engines under one Trainer setup (ddp, zero1, zero3, fsdp, "
                        "tp, fsdp-tp), race "
                        "hand-built torch code instead, outside the Trainer")
    p.add_argument("--plot", dest="plot_dir", default=None, metavar="DIR",
                   help="also save each comparison's PNG picture under DIR")


def run(a: argparse.Namespace) -> int:
    """``shardwise bench``: the pairs ``a.pairs`` names, one table each (:func:`shardwise.bench.pairs.run`)."""
    # torch and the pairs load when a benchmark runs, not for `shardwise --help`
    from shardwise.bench.pairs import run as run_pairs

    return run_pairs(a)


def __getattr__(name: str) -> Any:
    if name == "Table":  # kept importable from here, as before
        from rich.table import Table
        return Table
    raise AttributeError(f"module 'shardwise.bench' has no attribute {name!r}")


__all__ = ["PAIR_NAMES", "add_arguments", "run", "Table"]
