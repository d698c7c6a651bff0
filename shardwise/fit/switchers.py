"""What a switcher from Lightning types, answered: each of its Trainer arguments, its model and its compiled model.

``sw.Trainer`` takes Lightning's common Trainer arguments that keep their meaning here (``max_steps``,
``benchmark``, ``enable_model_summary`` are its own; ``enable_progress_bar``, ``num_nodes=1``,
``num_sanity_val_steps=0`` and ``enable_checkpointing`` are translated below); each other one is refused in one
line that names what does its work here, before any process starts, instead of Python's "unexpected keyword
argument". A LightningModule is told by its methods (``training_step`` and ``configure_optimizers``) without
importing Lightning, and a ``torch.compile`` wrapper is unwrapped with a warning.
"""
from __future__ import annotations

import difflib
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

# Lightning's Trainer arguments that have no parameter here, and what does their work ("{v}": the value given).
REFUSED = {
    "val_check_interval": "is fit(val_every=N) here: validate every N optimizer steps (an epoch is "
                          "len(dataset) // batch_size of them)",
    "check_val_every_n_epoch": "is fit(val_every=N) here, in optimizer steps: N = {v!r} x (len(dataset) // "
                               "batch_size)",
    "default_root_dir": "is checkpoint_dir={v!r} here: checkpoints there, and the logs of logger='csv' (or another "
                        "name) under <checkpoint_dir>/logs",
    "min_epochs": "has no equivalent here: a run trains until max_epochs or max_steps, or until a callback stops "
                  "it (shardwise.EarlyStopping's patience, info.stop)",
    "min_steps": "has no equivalent here: a run trains until max_epochs or max_steps, or until a callback stops it "
                 "(shardwise.EarlyStopping's patience, info.stop)",
    "max_time": "has no equivalent here: bound the run with max_steps= or max_epochs=, or stop it from a callback "
                "(info.stop) when its time is up",
    "limit_test_batches": "has no equivalent here: test on a part of the set, trainer.test(model, "
                          "torch.utils.data.Subset(dataset, range(n)), ...)",
    "limit_predict_batches": "has no equivalent here: predict a part of the set, trainer.predict(model, "
                             "torch.utils.data.Subset(dataset, range(n)), ...)",
    "use_distributed_sampler": "has no equivalent here: each rank reads its part of every global batch, without a "
                               "sampler; Trainer(shuffle=False) keeps the dataset's order",
    "num_nodes": "is the launcher's here: it starts the nodes (shardwise run --nnodes {v!r}, or srun), and "
                 "devices='auto' (the default) takes its world size",
    "num_sanity_val_steps": "has no equivalent here: the model, the loss and the validation metrics are checked "
                            "on meta before any process starts, and fast_dev_run=True runs one step and one "
                            "validation batch",
    "enable_checkpointing": "disagrees with checkpoint_dir=, which says whether and where checkpoints are written, "
                            "e.g. Trainer(checkpoint_dir='checkpoints', checkpoint_every=100)",
}
# Accepted because the value means what the run does anyway (no sanity pass, one node, no checkpoint_dir).
NOTHING_TO_DO = {"num_sanity_val_steps": 0, "num_nodes": 1}


def lightning_arguments(given: Mapping[str, Any], ours: Iterable[str], checkpoint_dir: Any) -> dict[str, Any]:
    """Trainer keyword arguments that are not its own: Lightning's, as our arguments (the returned dict), or
    refused in one line (ValueError) that names ours; any other name is Python's TypeError, with the nearest
    names."""
    out: dict[str, Any] = {}
    for name, value in given.items():
        if name == "enable_progress_bar":
            if not value:
                out["progress"] = False
        elif name == "enable_checkpointing" and bool(value) == (checkpoint_dir is not None):
            continue  # True with checkpoint_dir, False without: what the run does
        elif name in NOTHING_TO_DO and value == NOTHING_TO_DO[name]:
            continue
        elif name in REFUSED:
            raise ValueError(f"Trainer({name}={value!r}) {REFUSED[name].format(v=value)}")
        else:
            known = [*ours, *REFUSED, "enable_progress_bar"]
            near = difflib.get_close_matches(name, known, n=1)
            raise TypeError(f"Trainer() got an unexpected keyword argument {name!r}"
                            + (f"; did you mean {near[0]!r}?" if near else ""))
    return out


def looks_like_lightning(model: Any) -> bool:
    """Whether ``model`` is a LightningModule, told by its methods: ``training_step`` and ``configure_optimizers``
    of its own class (Lightning need not be installed, nor imported here)."""
    return isinstance(model, nn.Module) and all(
        callable(getattr(type(model), m, None)) for m in ("training_step", "configure_optimizers"))


def refuse_lightning_module(model: Any) -> None:
    """A LightningModule given to ``fit`` without the loss and optimizer, which ``sw.Trainer`` takes apart: say
    exactly what to pass."""
    if looks_like_lightning(model):
        raise TypeError(f"{type(model).__name__} is a LightningModule (it has training_step and "
                        "configure_optimizers): shardwise's fit takes the pieces apart: fit(model, dataset, "
                        "loss_fn=fn(output, target), optimizer=functools.partial(torch.optim.AdamW, lr=...), "
                        "batch_size=...), or fit(..., training_step=fn(model, batch) -> loss, optimizer=...) for a "
                        "step of your own; the model's forward is used as it is (docs: migrate/lightning)")


def uncompiled(model: Any, what: str) -> Any:
    """The module inside a ``torch.compile(model)`` wrapper (an ``OptimizedModule``: its ``_orig_mod``, which
    holds the same parameters), with a warning naming ``Trainer(compile=True)``; any other model as it is."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing can be compiled yet
    wrapper = getattr(dynamo, "OptimizedModule", None)
    if wrapper is None or not isinstance(model, wrapper):
        return model
    warnings.warn(f"{what} got a torch.compile(model) wrapper: it runs the model inside it (its _orig_mod, the "
                  "same parameters), uncompiled; pass the model itself, with Trainer(compile=True) to compile each "
                  "block after the strategy wraps it", stacklevel=3)
    return model._orig_mod


__all__ = ["lightning_arguments", "looks_like_lightning", "refuse_lightning_module", "uncompiled"]
