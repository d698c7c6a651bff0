"""Train the 8x8 digits classifier; the strategy and device count are the only switches.

    python examples/digits.py --strategy ddp --devices 2        # spawns 2 processes itself
    shardwise run --nproc 2 examples/digits.py --strategy ddp   # under torchrun: joins the group
"""
from __future__ import annotations

import argparse
import functools
import json
import os

import torch

import shardwise as sw
from shardwise.verify import accuracy
from shardwise.workloads import digits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--out", default=None, help="write the losses as JSON here (rank 0)")
    a = p.parse_args()
    work = digits()
    trainer = sw.Trainer(strategy=a.strategy, devices=a.devices, accelerator="cpu",
                         checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every)
    result = trainer.fit(work.make_model(), work.train, work.loss_fn,
                         optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                         batch_size=work.batch_size, max_steps=a.steps)
    if int(os.environ.get("RANK", "0")) == 0:
        model = work.make_model()
        model.load_state_dict(result.state_dict)
        print(f"final loss {result.losses[-1]:.4f}, test accuracy {100 * accuracy(model, work.test):.1f}%")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result.losses, f)


if __name__ == "__main__":
    main()
