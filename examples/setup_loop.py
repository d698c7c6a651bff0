"""A hand-written training loop with `sw.setup`: you keep the loop, shardwise does the parallelism.

    shardwise run --nproc 2 examples/setup_loop.py --strategy zero3
    python examples/setup_loop.py --devices 2 --strategy zero3   # the same: relaunches itself under shardwise run
    python examples/setup_loop.py                      # a group of one: the same code on one process
    python examples/setup_loop.py --accelerator cuda   # on a GPU (default auto: CUDA when present)

`model.state_dict()` is the full model (a collective: every rank calls it),
`sw.clip_grad_norm_` clips the global norm under every strategy, `sw.save` /
`sw.load` write and read the Trainer's checkpoints (any layout), and under
pipeline parallelism (`--strategy pp`) `model.train_step` runs the schedule.
See docs/loop.md.
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.workloads import digits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp", help="any strategy name (ddp, zero1, zero2, zero3, fsdp, tp, pp)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip the global gradient norm to this")
    p.add_argument("--save", default=None, help="write a checkpoint here at the end (sw.save)")
    p.add_argument("--accelerator", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                   help="processes, one per device; from plain python, more than 1 relaunches this script "
                        "under `shardwise run --nproc N`")
    a = p.parse_args()
    if a.devices > 1 and "WORLD_SIZE" not in os.environ:  # a hand-written loop needs a launcher for its ranks
        cmd = [sys.executable, "-m", "shardwise", "run", "--nproc", str(a.devices), __file__, *sys.argv[1:]]
        sys.exit(subprocess.call(cmd))
    sw.init(accelerator=a.accelerator)
    work = digits()
    torch.manual_seed(0)
    model, optimizer = sw.setup(work.make_model(), functools.partial(torch.optim.AdamW, lr=1e-3),
                                strategy=a.strategy, accelerator=a.accelerator)
    loader = sw.prepare_dataloader(work.train, batch_size=work.batch_size, model=model)  # GLOBAL batch
    step = 0
    for epoch in range(a.epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if a.strategy == "pp":
                loss = model.train_step(x, y, work.loss_fn)  # forward and backward over the schedule
            else:
                loss = work.loss_fn(model(x), y)
                loss.backward()
            sw.clip_grad_norm_(model, a.max_norm)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        mean = sw.all_reduce_mean(loss.detach(), model)  # the global batch's loss, on every rank
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: last loss {mean.item():.4f}")
    if a.save:
        sw.save(model, optimizer, a.save, step=step)
    state = model.state_dict()  # the full model, on every rank
    if dist.get_rank() == 0:
        print(f"{len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters in the full state dict")
    sw.teardown()


if __name__ == "__main__":
    main()
