"""What each logger costs the step: the seconds the training thread spends logging a step, and the step time.

One rank in this process (``Trainer("single")``), the DDP pair's model (4 x Linear(1024) MLP, global batch 64,
AdamW), ``log_every_n_steps=1`` (every step logged: the worst case), for each logger in turn and for none,
alternating the order over ``--reps`` repetitions. Per run: the median over the steps of the time
``StepLog.write`` held the training thread ("blocked"), and the median step time (``FitResult.stats``). Each
logger runs twice: as the Trainer runs it (its writes on a background thread) and ``--inline`` (the writes on the
training thread, as before the background writer), for the before/after comparison.

    python benchmarks/logger_cost.py [--reps 5] [--steps 40] [--loggers csv jsonl tensorboard mlflow wandb]
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from typing import Any

import torch

# The model and data of the fault-tolerance cost benchmark beside it (run as a script, this folder is on sys.path):
# both benchmarks time the same step.
from ft_cost import data, mlp
from torch import nn

import shardwise as sw
from shardwise.fit import progress


class Inline:
    """A logger's calls made on the training thread (what the step log did before its background writer)."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger

    def __getattr__(self, name: str) -> Any:
        return getattr(self.logger, name)

    def log_checkpoint(self, path: str, step: int) -> None:
        pass


def make(name: str, root: str) -> Any:
    return {"csv": lambda: sw.loggers.CSV(os.path.join(root, "csv")),
            "jsonl": lambda: sw.loggers.JSONL(os.path.join(root, "m.jsonl")),
            "tensorboard": lambda: sw.loggers.TensorBoard(os.path.join(root, "tb")),
            "mlflow": lambda: sw.loggers.MLflow(tracking_uri=sw.loggers.sqlite_uri(os.path.join(root, "ml.db"))),
            "wandb": lambda: sw.loggers.WandB(mode="offline", dir=root)}[name]()


BLOCKED: list[float] = []
_write = progress.StepLog.write


def timed_write(self: progress.StepLog, *args: Any, **kw: Any) -> None:
    start = time.perf_counter()
    _write(self, *args, **kw)
    BLOCKED.append(time.perf_counter() - start)


def run(name: str, inline: bool, steps: int) -> tuple[float, float]:
    """(median blocked seconds per logged step, median step seconds) of one run."""
    progress.StepLog.write = timed_write  # type: ignore[method-assign]
    progress.Background = Inline if inline else sw.loggers.Background  # type: ignore[attr-defined,misc]
    BLOCKED.clear()
    with tempfile.TemporaryDirectory() as tmp:
        logger = None if name == "none" else make(name, tmp)
        result = sw.Trainer("single", accelerator="cpu", progress=False, logger=logger, log_every_n_steps=1).fit(
            mlp(), data(), nn.functional.mse_loss, functools.partial(torch.optim.AdamW, lr=1e-4), batch_size=64,
            max_steps=steps)
    return (statistics.median(BLOCKED) if BLOCKED else 0.0), result.stats[0]["step_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--loggers", nargs="*", default=["csv", "jsonl", "tensorboard", "mlflow", "wandb"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    contenders = [("none", False)] + [(n, inline) for n in args.loggers for inline in (True, False)]
    got: dict[tuple[str, bool], list[tuple[float, float]]] = {c: [] for c in contenders}
    for rep in range(args.reps):
        for c in (contenders if rep % 2 == 0 else contenders[::-1]):
            got[c].append(run(c[0], c[1], args.steps))
            print(f"rep {rep} {c[0]} {'inline' if c[1] else 'background'}: blocked {got[c][-1][0] * 1e3:.3f} ms, "
                  f"step {got[c][-1][1] * 1e3:.2f} ms", flush=True)
    base = statistics.median(s for _, s in got[("none", False)])
    print(f"none: step {base * 1e3:.2f} ms (median of {args.reps} runs' medians)")
    for (name, inline), runs in got.items():
        if name == "none":
            continue
        blocked = statistics.median(b for b, _ in runs)
        step = statistics.median(s for _, s in runs)
        print(f"{name:12s} {'inline    ' if inline else 'background'} blocked {blocked * 1e3:8.3f} ms/step "
              f"({100 * blocked / base:6.2f}% of the step), step {step * 1e3:.2f} ms ({step / base:.3f}x none)",
              flush=True)
    print(f"load average at end: {open('/proc/loadavg').read().split()[:3]}", flush=True)


if __name__ == "__main__":
    main()
