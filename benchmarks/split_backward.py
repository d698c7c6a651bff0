"""Our B/W split against torch.distributed.pipelining's, in one process: where the zero-bubble gap is not.

One stage (4 x Linear(1024) with ReLU, micro-batch 32, fp32, one thread): the
plain backward, our ``backward_input`` + ``WeightGrad.backward_weight``
(shardwise.parallel.pp.split_backward), and torch's ``stage_backward_input`` +
``stage_backward_weight`` (torch.distributed.pipelining._backward, a private
module: the helpers its zero-bubble schedules call). The three alternate
every repetition; medians after 5 warm-up repetitions.

    python benchmarks/split_backward.py [--reps 30] [--batch 32]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from shardwise.parallel.pp.split_backward import backward_input

Timed = Callable[[nn.Module, torch.Tensor], tuple[float, float]]


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())])


def _forward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    y = model(x)
    return x, y, torch.ones_like(y)


def plain(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    _, y, g = _forward(model, x)
    t0 = time.perf_counter()
    y.backward(g)
    return time.perf_counter() - t0, 0.0


def ours(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    x, y, g = _forward(model, x)
    t0 = time.perf_counter()
    _, weight = backward_input(y, g, [x], list(model.parameters()))
    t1 = time.perf_counter()
    weight.backward_weight()
    return t1 - t0, time.perf_counter() - t1


def torchs(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    x, y, g = _forward(model, x)
    t0 = time.perf_counter()
    _, groups = stage_backward_input([y], [g], [x], model.parameters())
    t1 = time.perf_counter()
    stage_backward_weight(model.parameters(), groups)
    return t1 - t0, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(a.batch, 1024)
    contenders: dict[str, Timed] = {"plain backward": plain, "shardwise B + W": ours, "torch B + W": torchs}
    models = {n: make() for n in contenders}
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in contenders}
    for _ in range(a.reps):
        for n, f in contenders.items():  # alternating, so drifts hit all three alike
            times[n].append(f(models[n], x))
            models[n].zero_grad(set_to_none=True)
    base = None
    for n, v in times.items():
        b = statistics.median(t for t, _ in v[5:])
        w = statistics.median(t for _, t in v[5:])
        base = base or b + w
        print(f"{n:16s} B {b * 1e3:7.3f} ms  W {w * 1e3:7.3f} ms  total {(b + w) * 1e3:7.3f} ms  "
              f"({(b + w) / base:.3f}x the plain backward)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
