"""Rank 1 raises at step 3 (a bug in user code, say). Run as `shardwise run --nproc 2 raise_at_step.py`
or as a plain `python raise_at_step.py` (the Trainer spawns the ranks); the job must end in seconds."""
from __future__ import annotations

import functools

import torch

import shardwise as sw
from shardwise.strategies.registry import resolve
from shardwise.workloads import digits


class RaiseAt:
    def __init__(self, inner, rank: int, step: int) -> None:
        self.inner, self.rank, self.step = inner, rank, step

    def __call__(self, model, micro, loss_fn, topo, *run):
        if topo.rank == self.rank and topo.diag is not None and topo.diag.step == self.step:
            raise ValueError(f"bad batch at step {self.step}")
        return self.inner(model, micro, loss_fn, topo, *run)


def main() -> None:
    strategy = resolve("ddp")
    strategy.train_step = RaiseAt(strategy.train_step, 1, 3)  # type: ignore[method-assign]
    work = digits()
    sw.Trainer(strategy, 2, accelerator="cpu", progress=False).fit(
        work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3),
        batch_size=64, max_steps=20)


if __name__ == "__main__":
    main()
