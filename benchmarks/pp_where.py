"""Where the pp pair's step time goes: our 1F1B and torch's ``Schedule1F1B`` under the PyTorch profiler.

The pair's model, batch and micro-batches (``shardwise bench --pairs pp``: 4 x Linear(1024), 4 micro-batches),
2 ranks; each contender warms up, then runs ``--steps`` steps under ``torch.profiler`` (CPU activities), in the
same ranks, one after the other, ``--reps`` times alternating which goes first. Prints, per rank and contender,
the wall time per step and the operators with the most self CPU time per step, summed over the repetitions::

    PYTHONPATH=. python benchmarks/pp_where.py --batch 256 --steps 10 --reps 2
"""
from __future__ import annotations

import argparse
import copy
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from shardwise.bench.harness import spawn_collect
from shardwise.bench.pp.mp import mlp, ours_1f1b, pp_sizes, torch_1f1b
from shardwise.comm.topology import Topology
from shardwise.dims import PP, WORLD

CONTENDERS = {"shardwise 1F1B": ours_1f1b, "torch Schedule1F1B": torch_1f1b}


def _worker(rank: int, device: torch.device, batch: int, steps: int, reps: int, top: int, path: str) -> None:
    import pickle

    p = torch.distributed.get_world_size()
    topo = Topology.create(device, dp=1, tp=1, pp=p)
    depth, m = pp_sizes(p)
    base = mlp(1024, depth)
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g)
    wall: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, float]] = {n: defaultdict(float) for n in CONTENDERS}
    barrier = topo.comm(WORLD).barrier
    names = list(CONTENDERS)
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            step = CONTENDERS[name](copy.deepcopy(base), topo, x, y, m)
            for _ in range(3):
                barrier()
                step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    barrier()
                    t0 = time.perf_counter()
                    step()
                    wall[name] += time.perf_counter() - t0
            for e in prof.key_averages():
                ops[name][e.key] += e.self_cpu_time_total / 1e3  # ms
    n = steps * reps
    out = {name: (wall[name] / n * 1e3, sorted(((k, v / n) for k, v in ops[name].items()),
                                               key=lambda kv: -kv[1])[:top]) for name in CONTENDERS}
    everyone = topo.comm(WORLD).all_gather_object(out, name="pp_where")
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(everyone, f)
    topo.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    ranks = spawn_collect(_worker, 2, a.batch, a.steps, a.reps, a.top)
    for r, res in enumerate(ranks):
        for name, (ms, top) in res.items():
            print(f"rank {r} ({PP} stage {r}), {name}: {ms:.2f} ms per step (wall, under the profiler); "
                  "self CPU per step:")
            for k, v in top:
                print(f"    {v:9.2f} ms  {k}")


if __name__ == "__main__":
    main()
