"""fit, then validate, test and predict on one Trainer, each forward writing its process id under argv[1].

tests/fit/test_kept_ranks.py runs it as a user runs a script (`python kept_ranks.py DIR`): the ranks of every
call are started from here, and the calls after the first run on the ranks the first one started.
"""
import functools
import os
import sys

import torch
from torch import nn

import shardwise as sw


class Pids(nn.Module):
    """A classifier whose forward leaves its process id under the call's folder (``PIDS_DIR/<call>``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        open(os.path.join(os.environ["PIDS_DIR"], str(os.getpid())), "w").close()
        return self.net(x)


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g))


def call(name: str, fn, *args, **kwargs):
    os.environ["PIDS_DIR"] = os.path.join(sys.argv[1], name)  # the ranks take this process's environment
    os.makedirs(os.environ["PIDS_DIR"])
    return fn(*args, **kwargs)


def main() -> None:
    trainer = sw.Trainer("ddp", devices=2, accelerator="cpu", progress=False)
    model, loss = Pids(), nn.functional.cross_entropy
    call("fit", trainer.fit, model, data(), loss, functools.partial(torch.optim.SGD, lr=0.1), batch_size=8,
         max_steps=2)
    call("validate", trainer.validate, model, data(), loss, batch_size=8)
    call("test", trainer.test, model, data(), loss, batch_size=8)
    call("predict", trainer.predict, model, data(), batch_size=8)
    print(os.getpid())


if __name__ == "__main__":
    main()
