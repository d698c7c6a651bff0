"""Soak: a long run with periodic checkpoints; resident memory must stay flat.

    python benchmarks/soak.py --steps 1200 --every 100

Prints RSS of rank 0 (from the per-step JSONL metrics) at a few points and the
least-squares slope over the second half of the run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time

import torch

import shardwise as sw
from shardwise.workloads import digits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--devices", type=int, default=2)
    a = p.parse_args()
    work = digits()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        t0 = time.perf_counter()
        res = sw.Trainer(a.strategy, a.devices, accelerator="cpu", progress=False, metrics_path=metrics,
                         checkpoint_dir=os.path.join(tmp, "ck"), checkpoint_every=a.every).fit(
            work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3),
            batch_size=work.batch_size, max_steps=a.steps)
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in open(metrics)]
        n_ck = len(os.listdir(os.path.join(tmp, "ck")))
    rss = [r["rss_bytes"] for r in rows]
    half = rows[len(rows) // 2:]
    xs = [r["step"] for r in half]
    ys = [r["rss_bytes"] for r in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print(f"{a.strategy} on {a.devices} ranks, {a.steps} steps, checkpoint every {a.every} ({n_ck} kept), "
          f"{wall:.0f} s, final loss {res.losses[-1]:.4f}")
    for s in (0, 99, len(rss) // 4, len(rss) // 2, 3 * len(rss) // 4, len(rss) - 1):
        print(f"  step {rows[s]['step']:5d}: rank-0 RSS {rss[s] / 2**20:8.2f} MiB")
    print(f"  RSS slope over the second half: {slope:.1f} bytes/step "
          f"({slope * 1000 / 2**20:.3f} MiB per 1000 steps); max-min over the second half "
          f"{(max(ys) - min(ys)) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
