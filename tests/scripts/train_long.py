"""Trains digits under ddp on 2 spawned ranks for a long time, checkpointing every step (a launcher to kill)."""
from __future__ import annotations

import functools
import sys

import torch

import shardwise as sw
from shardwise.workloads import digits

if __name__ == "__main__":
    work = digits()
    sw.Trainer("ddp", 2, accelerator="cpu", progress=False, checkpoint_dir=sys.argv[1], checkpoint_every=1,
               checkpoint_keep=None).fit(work.make_model(), work.train, work.loss_fn,
                                         functools.partial(torch.optim.AdamW, lr=1e-3), batch_size=64,
                                         max_steps=100_000)
