"""Per-rank memory and all-to-all traffic of expert parallelism (the table in docs/experts.md).

Run: ``python benchmarks/moe_table.py`` (about a minute on 2 CPU cores). Prints one Markdown row per layout:
parameter and optimizer bytes of rank 0, the dispatch bytes rank 0 sent per step, and the slots dispatched and
dropped over the run (every rank).
"""
from __future__ import annotations

import functools

import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.workloads import CharText, stdlib_text

STEPS = 4


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64, n_experts=8, top_k=2))


def main() -> None:
    rows = [("ddp", "ddp", 2), ("ep=2", sw.Parallel(ep=2), 2), ("ddp", "ddp", 4), ("ep=4", sw.Parallel(ep=4), 4),
            ("ep=2, zero=3", sw.Parallel(ep=2, zero=3), 4),
            ("ep=2, cf=1.0", sw.Parallel(ep=2, capacity_factor=1.0), 2)]
    print("| layout | ranks | params bytes/rank | optimizer bytes/rank | ep_dispatch bytes/step (rank 0) "
          f"| slots dispatched ({STEPS} steps, all ranks) | dropped |")
    print("|---|---|---|---|---|---|---|")
    for name, strategy, devices in rows:
        r = sw.Trainer(strategy, devices, accelerator="cpu", progress=False).fit(
            gpt(), CharText(stdlib_text(50_000), 64), lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3),
            batch_size=16, max_steps=STEPS)
        s = r.stats[0]
        counts = {k: sum(x["counters"].get(k, 0) for x in r.stats) for k in ("moe_dispatched", "moe_dropped")}
        print(f"| {name} | {devices} | {s['params_bytes']:,} | {s.get('optimizer_bytes', 0):,} | "
              f"{s['comm_by_name'].get('ep_dispatch', 0) // STEPS:,} | {counts['moe_dispatched']:,} | "
              f"{counts['moe_dropped']:,} |", flush=True)


if __name__ == "__main__":
    main()
