"""What a checkpoint records about the run that wrote it, and the checks of a resume against that record.

:func:`run_info` is the record (batch size, precision, optimizer and its parameter groups, model class and
Hugging Face config) that :mod:`shardwise.checkpoint.store` writes into every manifest; :func:`check_resume`
refuses, before any process starts, to continue a checkpoint under another global batch, optimizer or
parameter groups, and :func:`check_directory` a ``checkpoint_dir`` nothing can be written to.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.store import MANIFEST, latest_valid, read_manifest
from shardwise.step import unwrap


def run_info(model: nn.Module, optimizer: torch.optim.Optimizer, batch_size: int, precision: str,
             groups: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it, for the checks of a resume and for export.

    ``optimizer`` is a probe built from the run's optimizer factory (its class
    and hyperparameters), ``groups`` its parameter groups as they start
    (:meth:`shardwise.optim.param_groups.GroupPlan.record`); for a Hugging Face model, its class and config, so
    ``shardwise checkpoint export`` can write a directory ``from_pretrained`` loads.
    """
    m = unwrap(model)
    info: dict[str, Any] = {
        "batch_size": batch_size, "precision": precision,
        "optimizer": {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                      "defaults": {k: v for k, v in optimizer.defaults.items()
                                   if isinstance(v, (int, float, str, bool, type(None), list, tuple))},
                      **({"groups": groups} if groups is not None else {})},
        "model": {"class": f"{type(m).__module__}.{type(m).__qualname__}"},
    }
    config = getattr(m, "config", None)
    if config is not None and hasattr(config, "to_dict") and hasattr(m, "save_pretrained"):
        info["model"]["hf_config"] = config.to_dict()
    return info


def check_directory(directory: str) -> None:
    """Refuse, before any process starts, a checkpoint directory that is a file or cannot be written: a file is
    created and removed in it (or in its nearest existing ancestor, where it will be made)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"checkpoint_dir={directory!r} is a file, not a directory")
    probe = directory
    while not os.path.exists(probe):  # the nearest existing ancestor is where the directory will be made
        parent = os.path.dirname(os.path.abspath(probe))
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(f"checkpoint_dir={directory!r} cannot be created: {probe!r} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"checkpoint_dir={directory!r} cannot be written ({probe!r} is not writable)")
    try:  # os.access reads permission bits, which root passes everywhere (/sys, /proc, ...): write to be sure
        fd, path = tempfile.mkstemp(prefix=".shardwise-probe-", dir=probe)
    except OSError as e:
        raise ValueError(f"checkpoint_dir={directory!r} cannot be written (creating a file in {probe!r} failed: "
                         f"{e.strerror})") from None
    os.close(fd)
    os.remove(path)


def check_resume(directory: str, info: dict[str, Any], max_steps: int, explicit: bool = False) -> str | None:
    """Before any process starts: whether the newest intact checkpoint in ``directory`` (or ``directory``
    itself, a checkpoint) can continue this run.

    Refuses a checkpoint past ``max_steps`` (nothing would train), another
    global batch size (the data order and the optimisation would change), or
    another optimizer class (its states would not match). Other optimizer
    hyperparameters or precision are refused too, naming each change, unless
    the resume is ``explicit`` (``resume="must"`` or a path): then a warning
    names them. Returns the path (None without a checkpoint).
    """
    path = latest_valid(directory) if not os.path.exists(os.path.join(directory, MANIFEST)) else directory
    if path is None:
        return None
    manifest = read_manifest(path)
    step, saved = int(manifest["step"]), manifest.get("run")
    if step > max_steps:
        raise ValueError(f"the newest checkpoint {path} is at step {step}, past max_steps={max_steps}: its weights "
                         f"are those of a longer run; raise max_steps to at least {step}, or pass resume='never' (or "
                         "another checkpoint_dir) to start over")
    if not saved:
        return path
    if saved["batch_size"] != info["batch_size"]:
        raise ValueError(f"checkpoint {path} was written with batch_size={saved['batch_size']}, this run has "
                         f"batch_size={info['batch_size']}: the global batch fixes the data order and the "
                         "optimisation, so a resumed run would not continue the same training; use "
                         f"batch_size={saved['batch_size']} (or resume='never' to start over)")
    was, now = saved["optimizer"], info["optimizer"]
    if was["class"] != now["class"]:
        raise ValueError(f"checkpoint {path} was written with optimizer {was['class']}, this run uses "
                         f"{now['class']}: the optimizer states in the checkpoint do not fit another optimizer; "
                         f"use {was['class']} (or resume='never' to start over)")
    changed = _changed(was["defaults"], now["defaults"], "")
    if "groups" in was and "groups" in now:
        _check_groups(path, was["groups"], now["groups"])
        for i, (w, n) in enumerate(zip(was["groups"], now["groups"])):  # what the defaults' change does not say
            changed += [f"group {i} {c}" for c in _changed(w["hyper"], n["hyper"], "") if c not in changed]
    if info.get("precision") is not None and saved.get("precision") not in (None, info["precision"]):
        changed.append(f"precision {saved['precision']!r} -> {info['precision']!r}")
    if changed and not explicit:
        raise ValueError(f"checkpoint {path} was written by another configuration ({', '.join(changed)}): "
                         "resume='auto' continues only the same run; pass resume='never' (or another "
                         "checkpoint_dir) to train from scratch, or resume='must' to continue this run with the new "
                         "values")
    if changed:
        warnings.warn(f"resuming {path} with other optimizer settings ({', '.join(changed)}): the steps after "
                      f"{step} use the new values, so the run is not the one the checkpoint started",
                      stacklevel=5)  # the user's fit line (fit -> checks.validate -> checks.check_resume -> here)
    return path


def _changed(was: dict[str, Any], now: dict[str, Any], where: str) -> list[str]:
    return [f"{where}{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now))
            if json.loads(json.dumps(now.get(k))) != was.get(k)]


def _sizes(groups: list[dict[str, Any]]) -> str:
    return ", ".join(str(len(g["params"])) for g in groups)


def _check_groups(path: str, was: list[dict[str, Any]], now: list[dict[str, Any]]) -> None:
    """Refuse a resume whose parameter groups hold other parameters than the saved run's."""
    if [g["params"] for g in was] == [g["params"] for g in now]:
        return
    raise ValueError(f"checkpoint {path} was written with other parameter groups: {len(was)} groups of "
                     f"{_sizes(was)} parameters there, {len(now)} groups of {_sizes(now)} here; each group's "
                     "settings (a learning rate changed during the run) belong to its parameters, so build the "
                     "saved run's groups (or pass resume='never' to start over)")
