"""Train the 8x8 digits classifier from a YAML file: the model, the data, the loss, the optimizer and every
Trainer and fit option are in examples/configured.yaml, and any of them can be overridden by a flag.

    python examples/configured.py --config examples/configured.yaml --trainer.devices 2    # spawns 2 processes
    shardwise run --nproc 2 examples/configured.py --config examples/configured.yaml      # under torchrun
    python examples/configured.py --config examples/configured.yaml --trainer.devices 2 \\
        --trainer.strategy zero3 --fit.max_steps 20 --out losses.json                     # flags win over the file
    python examples/configured.py --config examples/configured.yaml --print_config       # every key, resolved

``sw.configured(main)`` builds the run the file describes and calls ``main`` with it; ``main``'s own parameters
(``out``) are keys of the file and flags as well. With ``--trainer.checkpoint_dir DIR`` the resolved
configuration is kept as ``DIR/config.yaml``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

import shardwise as sw


def main(trainer: sw.Trainer, fit: Callable[[], sw.FitResult], model: torch.nn.Module,
         val_dataset: torch.utils.data.TensorDataset, out: str | None = None) -> None:
    """Train; rank 0 prints the final loss and the accuracy on ``val_dataset``.

    Args:
        out: write the losses as JSON here (rank 0).
    """
    result = fit()  # the model passed in ends trained, under every strategy and launch
    if int(os.environ.get("RANK", "0")) == 0:
        x, y = val_dataset.tensors
        with torch.no_grad():
            correct = float((model(x).argmax(-1) == y).float().mean())
        print(f"{trainer.options.strategy.name}, devices={trainer.devices}: final loss {result.losses[-1]:.4f}, "
              f"val loss {result.val_metrics[-1]['val_loss']:.4f}, test accuracy {100 * correct:.1f}%")
        if out:
            with open(out, "w") as f:
                json.dump(result.losses, f)


if __name__ == "__main__":
    sw.configured(main)
