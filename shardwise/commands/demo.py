"""`shardwise demo`: every strategy on the digits classifier, one table."""
from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from shardwise.commands import plots
from shardwise.commands.verify import accuracy, compare
from shardwise.console import make_console
from shardwise.dims import DP, PP, TP
from shardwise.fit.trainer import Trainer
from shardwise.strategies.base import Strategy
from shardwise.strategies.parallel import Parallel
from shardwise.strategies.registry import available_strategies
from shardwise.workloads import digits


def _three_d() -> Strategy:
    """dp=2 x tp=2 x pp=2 with ZeRO-1 over dp on the digits MLP: stage 0 is net.0, stage 1 net.2..net.4,
    whose two Linear layers are split Megatron-style (column then row)."""
    return Parallel(dp=2, tp=2, pp=2, zero=1, split_points=["net.2"],
                    tp_plan={"net.2": "colwise", "net.4": "rowwise"}, microbatches=2)


# (label, strategy name or factory, devices) in the order shown. With --devices
# other than 2, the rows of 2 devices use that many instead; the others keep theirs.
DEMO_RUNS: list[tuple[str, str | Callable[[], Strategy], int]] = [
    ("single", "single", 1), ("ddp", "ddp", 2), (DP, DP, 2), ("ps", "ps", 3), ("zero1", "zero1", 2),
    ("zero2", "zero2", 2), ("zero3", "zero3", 2), ("fsdp", "fsdp", 2), ("hsdp", "hsdp", 4), (TP, TP, 2),
    (PP, PP, 2), ("3d+zero1", _three_d, 8),
]


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(steps: int = 60, devices: int = 2, rtol: float = 1e-4, console: Console | None = None,
         plot_dir: str | None = None) -> int:
    console = console or make_console()
    work = digits()
    table = Table(title=f"shardwise demo: 8x8 digits MLP, {steps} steps, global batch {work.batch_size}, AdamW")
    for col in ("strategy", "devices", "final loss", "test acc", "equal to single", "median step",
                "peak RSS / rank", "sent / rank / step"):
        table.add_column(col, justify="right" if col not in ("strategy",) else "left", overflow="fold")
    ref = None
    ok = True
    valid = available_strategies()
    finished: dict[str, tuple[object, int, int]] = {}  # label -> (result, devices, batch), for --plot
    for name, spec, n in DEMO_RUNS:
        if isinstance(spec, str) and spec not in valid:
            continue
        n = n if n != 2 else devices
        strategy = spec if isinstance(spec, str) else spec()
        t0 = time.perf_counter()
        res = Trainer(strategy, n, accelerator="cpu", progress=False).fit(
            work.make_model(), work.train, work.loss_fn, work.optimizer(), work.batch_size, steps)
        model = work.make_model()
        model.load_state_dict(res.state_dict)
        if ref is None:
            ref = res
        cmp = compare(ref, res)
        same = cmp.within(rtol)
        ok &= same
        table.add_row(name, str(n), f"{res.losses[-1]:.4f}", f"{100 * accuracy(model, work.test):.1f}%",
                      "yes" if same else f"NO (loss rel {cmp.max_loss_rel:.1e})",
                      f"{1e3 * max(s['step_time_s'] for s in res.stats):.2f} ms",
                      _mib(max(s["peak_rss_bytes"] for s in res.stats)),
                      f"{max(s['comm_bytes_per_step'] for s in res.stats) / 1024:.1f} KiB")
        # A plain line (console.log would pad it to the console's width and add demo.py:NN in a pipe).
        console.print(f"{time.strftime('%H:%M:%S')} {name} on {n} device(s) done in {time.perf_counter() - t0:.1f} s",
                      highlight=False)
        finished[name] = (res, n, work.batch_size)
    console.print(table)
    if plot_dir is not None:
        for path in plots.write_demo(plot_dir, finished):
            console.print(f"wrote {path}")
    console.print("3d+zero1: dp=2 x tp=2 x pp=2 on one mesh, ZeRO-1 over dp, tp inside pipeline stage 1.")
    console.print(f"'equal to single': largest relative difference of any step's loss and any final "
                  f"weight below {rtol:g}.")
    return 0 if ok else 1
