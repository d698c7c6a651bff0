"""Checkpoints in the foreground against checkpoints in the background (``Trainer(checkpoint_async=...)``), and
against DCP's own ``async_save``.

A GPT of about 100M parameters (14 blocks of width 768, character vocabulary) trains with AdamW on one rank
and saves every ``--every`` steps, once with each mode, the modes alternating over ``--reps`` repetitions. Per
mode: the seconds each save blocked the loop (median over saves and repetitions), the seconds a write took,
the median step time without a write in flight and beside one (their ratio: the slowdown a write causes), from
``FitResult.stats``. A save holds parameters and both Adam moments: 12 bytes per parameter. ``--dcp`` adds a third
contender: ``torch.distributed.checkpoint.async_save`` of the model's and the optimizer's state dicts in a plain loop
of the same model, optimizer and batches, timed the same way (blocked: the wait for the save in flight plus the
call, which stages the copy; the steps that started with a write in flight against the others).

    python benchmarks/checkpoint_async.py [--layers 14] [--steps 9] [--every 3] [--reps 2] [--dcp] [--dir /tmp/ck]
"""
from __future__ import annotations

import argparse
import functools
import itertools
import shutil
import statistics
import tempfile
import time
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


def run_dcp(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """DCP's ``async_save`` every ``args.every`` steps of a plain loop (one process, no group), timed as the
    Trainer times its saves and steps."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=args.block, n_layer=args.layers, n_head=12, n_embd=768))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = CharText(stdlib_text(200_000), args.block)
    batches = itertools.cycle(torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True))
    shutil.rmtree(directory, ignore_errors=True)
    blocked, writes, alone, beside, future, started = [], [], [], [], None, 0.0
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        in_flight = future is not None and not future.done()
        t = time.perf_counter()
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        (beside if in_flight else alone).append(time.perf_counter() - t)
        if step % args.every == 0:
            t = time.perf_counter()
            if future is not None:
                future.result()
                writes.append(time.perf_counter() - started)
            future = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                    checkpoint_id=f"{directory}/step_{step:08d}")
            started = time.perf_counter()
            blocked.append(started - t)
    if future is not None:
        future.result()
        writes.append(time.perf_counter() - started)
    return {"checkpoint_blocked_s": blocked, "checkpoint_write_s": writes,
            "step_time_without_write_s": statistics.median(alone[1:] or alone),
            "step_time_beside_write_s": statistics.median(beside) if beside else None}


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
    p.add_argument("--dcp", action="store_true", help="also time DCP's own async_save in a plain loop")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="shardwise-ckpt-bench-")
    modes = ["sync", "async"] + (["dcp-async"] if args.dcp else [])
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for rep in range(args.reps):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            got = run_dcp(args, f"{root}/{mode}") if mode == "dcp-async" else run(args, mode == "async",
                                                                                    f"{root}/{mode}")
            runs[mode].append(got)
            print(f"rep {rep} {mode}: blocked {got['checkpoint_blocked_s']}, write "
                  f"{got['checkpoint_write_s']}, step {got['step_time_without_write_s']} / beside a write "
                  f"{got['step_time_beside_write_s']}", flush=True)
    print(f"parameters {runs['sync'][0]['params']:,}, checkpoint {runs['sync'][0]['params'] * 12 / 1e9:.2f} GB, "
          f"saves per run {len(runs['sync'][0]['checkpoint_blocked_s'])}, reps {args.reps}")
    print("| mode | blocked per save | write | step without a write | step beside a write | slowdown |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, rows in runs.items():
        blocked = _median([b for r in rows for b in r["checkpoint_blocked_s"]])
        write = _median([w for r in rows for w in r["checkpoint_write_s"]])
        alone = _median([r["step_time_without_write_s"] for r in rows])
        beside = _median([r["step_time_beside_write_s"] for r in rows])
        print(f"| {mode} | {blocked:.3f} s | {write:.3f} s | {alone:.3f} s | {beside:.3f} s "
              f"| {beside / alone:.2f}x |")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
