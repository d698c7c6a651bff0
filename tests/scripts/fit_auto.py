"""Under `shardwise run`: two fits in one script with ``devices="auto"``; each rank prints whether the model it
passed in ends trained: rank 0's, which holds the run's full state dict; the other rank gets none and keeps its
model as it was (tests/test_first_hour.py reads the lines)."""
from __future__ import annotations

import copy
import functools
import os
import sys

import torch

import shardwise as sw
from shardwise.workloads import digits


def main() -> None:
    work = digits()
    for strategy in ("ddp", "zero3"):  # two fits in one script: each joins a group of its own (the second used to hang)
        model = work.make_model()
        before = copy.deepcopy(model.state_dict())
        trainer = sw.Trainer(strategy, accelerator="cpu", progress=False)  # devices: "auto", the world size
        result = trainer.fit(model, work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-2),
                             batch_size=64, max_steps=3)
        if result.state_dict:
            trained = all(torch.equal(v, result.state_dict[k]) for k, v in model.state_dict().items())
        else:
            trained = "kept" if all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) else "changed"
        # One write per line: the two ranks share stdout, and print's text and newline are two writes unbuffered.
        rank = os.environ.get("RANK", "x")  # (the trainer has left the group it created)
        sys.stdout.write(f"rank {rank} {strategy} devices={trainer.devices} trained={trained}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
