"""Train the 8x8 digits classifier; the strategy, the accelerator and the device count are the switches.

    python examples/digits.py --strategy ddp --devices 2        # spawns 2 processes itself
    python examples/digits.py --accelerator cuda --devices 2    # one process per GPU
    shardwise run --nproc 2 examples/digits.py --strategy ddp   # under torchrun: joins the group

``--accelerator auto`` (the default) trains on CUDA when there is a GPU and on the CPU otherwise.
"""
from __future__ import annotations

import argparse
import functools
import json
import os

import torch

import shardwise as sw
from shardwise.workloads import digits


def accuracy(model: torch.nn.Module, dataset: torch.utils.data.TensorDataset) -> float:
    """The share of ``dataset``'s samples whose largest logit is the label."""
    x, y = dataset.tensors
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--accelerator", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "2")),
                   help="processes, one per device (under torchrun: its world size)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--out", default=None, help="write the losses as JSON here (rank 0)")
    a = p.parse_args()
    work = digits()
    trainer = sw.Trainer(strategy=a.strategy, devices=a.devices, accelerator=a.accelerator,
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
