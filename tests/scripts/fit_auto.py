"""Under `shardwise run`: two fits in one script with ``devices="auto"``; each rank prints whether the model it
passed in ends trained (tests/fit/test_first_hour.py reads the lines)."""
from __future__ import annotations

import functools
import sys

import torch

import shardwise as sw
from shardwise.workloads import digits


def main() -> None:
    work = digits()
    for strategy in ("ddp", "zero3"):  # two fits in one script: each joins a group of its own (the second used to hang)
        model = work.make_model()
        trainer = sw.Trainer(strategy, accelerator="cpu", progress=False)  # devices: "auto", the world size
        result = trainer.fit(model, work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-2),
                             batch_size=64, max_steps=3)
        same = all(torch.equal(v, result.state_dict[k]) for k, v in model.state_dict().items())
        # One write per line: the two ranks share stdout, and print's text and newline are two writes unbuffered.
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "x"
        sys.stdout.write(f"rank {rank} {strategy} devices={trainer.devices} trained={same}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
