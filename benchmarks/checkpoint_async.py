"""Checkpoints in the foreground against checkpoints in the background (``Trainer(checkpoint_async=...)``).

A GPT of about 100M parameters (14 blocks of width 768, character vocabulary) trains with AdamW on one rank
and saves every ``--every`` steps, once with each mode, the modes alternating over ``--reps`` repetitions. Per
mode: the seconds each save blocked the loop (median over saves and repetitions), the seconds a write took,
the median step time without a write in flight and beside one (their ratio: the slowdown a write causes), from
``FitResult.stats``. A save holds parameters and both Adam moments: 12 bytes per parameter.

    python benchmarks/checkpoint_async.py [--layers 14] [--steps 9] [--every 3] [--reps 2] [--dir /tmp/ck]
"""
from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
from typing import Any

import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig, count_parameters, lm_loss
from shardwise.workloads import CharText, stdlib_text


def run(args: argparse.Namespace, asynchronous: bool, directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=args.block, n_layer=args.layers, n_head=12, n_embd=768)
    model = GPT(cfg)
    shutil.rmtree(directory, ignore_errors=True)
    result = sw.Trainer("single", 1, accelerator="cpu", progress=False, checkpoint_dir=directory,
                        checkpoint_every=args.every, checkpoint_keep=1, checkpoint_async=asynchronous).fit(
        model, CharText(stdlib_text(200_000), args.block), lm_loss, functools.partial(torch.optim.AdamW, lr=1e-4),
        batch_size=args.batch, max_steps=args.steps)
    return {**result.stats[0], "params": count_parameters(model)}


def _median(values: list[float | None]) -> float:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="shardwise-ckpt-bench-")
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for rep in range(args.reps):
        for mode in ((False, True) if rep % 2 == 0 else (True, False)):
            runs[mode].append(run(args, mode, f"{root}/{'async' if mode else 'sync'}"))
            got = runs[mode][-1]
            print(f"rep {rep} {'async' if mode else 'sync'}: blocked {got['checkpoint_blocked_s']}, write "
                  f"{got['checkpoint_write_s']}, step {got['step_time_without_write_s']} / beside a write "
                  f"{got['step_time_beside_write_s']}", flush=True)
    print(f"parameters {runs[False][0]['params']:,}, checkpoint {runs[False][0]['params'] * 12 / 1e9:.2f} GB, "
          f"saves per run {len(runs[False][0]['checkpoint_blocked_s'])}, reps {args.reps}")
    print("| mode | blocked per save | write | step without a write | step beside a write | slowdown |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, rows in runs.items():
        blocked = _median([b for r in rows for b in r["checkpoint_blocked_s"]])
        write = _median([w for r in rows for w in r["checkpoint_write_s"]])
        alone = _median([r["step_time_without_write_s"] for r in rows])
        beside = _median([r["step_time_beside_write_s"] for r in rows])
        print(f"| {'async' if mode else 'sync'} | {blocked:.3f} s | {write:.3f} s | {alone:.3f} s | {beside:.3f} s "
              f"| {beside / alone:.2f}x |")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
