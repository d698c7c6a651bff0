"""A hand-written training loop with `sw.setup`: you keep the loop, shardwise does the parallelism.

    shardwise run --nproc 2 examples/setup_loop.py --strategy ddp
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import shardwise as sw
from shardwise.workloads import digits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    sw.init(accelerator="cpu")
    work = digits()
    model, optimizer = sw.setup(work.make_model(), functools.partial(torch.optim.AdamW, lr=1e-3),
                                strategy=a.strategy, accelerator="cpu")
    sampler = DistributedSampler(work.train, seed=0)
    loader = DataLoader(work.train, batch_size=work.batch_size // dist.get_world_size(), sampler=sampler)
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = work.loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: last loss {loss.item():.4f}")
    sw.teardown()


if __name__ == "__main__":
    main()
