"""The cost of fault tolerance: a step with the quorum against the same step without, and a SIGKILL's delay.

``ddp`` on ``--groups`` ranks (one replica group each), the DDP pair's model (4 x Linear(1024) MLP, global batch
64, AdamW), with ``fault_tolerance=True`` and without, alternating over ``--reps`` repetitions: the median step
time of each run (``FitResult.stats``, the slowest rank), then the median over repetitions and the median of the
paired ratios. Then one run in which rank 1 dies by SIGKILL once ``--kill-after`` steps are committed: the
seconds from the kill to the next committed step (wall-clock times written by the ranks).

    python benchmarks/ft_cost.py [--groups 2 4] [--reps 3] [--steps 12] [--kill-after 4]
"""
from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import tempfile
import time

import torch
from torch import nn

import shardwise as sw


def mlp(width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())])


def data(width: int = 1024) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(1024, width, generator=g), torch.randn(1024, width, generator=g))


class Clock(sw.Callback):
    """Rank ``victim`` writes the time and dies by SIGKILL after ``after`` steps; the others write the time of
    every committed step."""

    def __init__(self, path: str, victim: int, after: int) -> None:
        self.path, self.victim, self.after = path, victim, after

    def on_step_end(self, info: sw.callbacks.CallbackInfo) -> None:
        if info.rank == self.victim and info.step == self.after:
            with open(f"{self.path}.kill", "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        elif info.rank != self.victim:
            with open(f"{self.path}.{info.rank}", "a") as f:
                f.write(f"{info.step} {time.time()!r}\n")


def run(groups: int, steps: int, ft: bool, callbacks: list[sw.Callback] | None = None) -> float:
    options = {"fault_tolerance": sw.FaultTolerance(timeout_s=10.0)} if ft else {}
    result = sw.Trainer("ddp", groups, accelerator="cpu", progress=False, max_processes_per_core=None,
                        callbacks=callbacks, **options).fit(
        mlp(), data(), nn.functional.mse_loss, functools.partial(torch.optim.AdamW, lr=1e-4), batch_size=64,
        max_steps=steps)
    return max(s["step_time_s"] for s in result.stats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-after", type=int, default=4)
    args = parser.parse_args()
    for groups in args.groups:
        plain, ft, ratios = [], [], []
        for rep in range(args.reps):
            order = (False, True) if rep % 2 == 0 else (True, False)
            got = {mode: run(groups, args.steps, mode) for mode in order}
            plain.append(got[False])
            ft.append(got[True])
            ratios.append(got[True] / got[False])
        without, with_ft = statistics.median(plain), statistics.median(ft)
        print(f"groups={groups}: step without {without * 1e3:.2f} ms, with fault tolerance {with_ft * 1e3:.2f} ms, "
              f"ratio of medians {with_ft / without:.4f}, paired ratio {statistics.median(ratios):.4f} "
              f"(each: {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t")
        run(4, args.kill_after + 4, True, [Clock(path, 1, args.kill_after)])
        killed = float(open(f"{path}.kill").read())
        after = [float(t) for line in open(f"{path}.0") for s, t in [line.split()] if int(s) > args.kill_after]
        print(f"SIGKILL of rank 1 of 4 after step {args.kill_after}: next committed step {min(after) - killed:.3f} s "
              "later", flush=True)


if __name__ == "__main__":
    main()
