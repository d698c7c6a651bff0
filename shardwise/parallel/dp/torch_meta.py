"""A meta-device model under torch's engines: memory for what each rank holds, initialised one module at a time.

FSDP2 shards a model on the meta device as it shards a real one; ``Module.to_empty`` then gives memory to each
rank's shards only (torchtitan's recipe). DDP wraps whole tensors, so each meta tensor gets whole memory in
place. Either way every module is initialised as our FSDP initialises it
(:mod:`shardwise.parallel.dp.fsdp_module`): full-size, in module order, on every rank, by ``param_init_fn`` or the
module's own ``reset_parameters()``. The same seed so gives the same weights as the model built on a device (its
constructor runs the same initialisers in the same order), and every rank's random stream moves alike. A rank
keeps what it holds of each tensor (its FSDP2 shard, or the tensor itself) and drops the full copy before the
next module: no rank holds more than one module's full parameters beside its shards.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.parallel.dtensor import dim0_run

Init = Callable[[nn.Module], None]


@torch.no_grad()
def init_meta(model: nn.Module, device: torch.device, init: Init | None = None,
              shards_on: torch.device | str | None = None) -> None:
    """Give ``model``'s meta tensors memory on ``device`` and initialise them module by module with ``init``
    (None: each module's ``reset_parameters()``); FSDP2's shards get theirs on ``shards_on`` (default
    ``device``; the CPU under ``CPUOffloadPolicy``)."""
    todo = _meta_modules(model)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        model.to_empty(device=shards_on or device)  # FSDP2 points its shards at the new memory (unpadded views)
        _buffers_to(model, device)
    done: set[int] = set()
    for name, m, params, bufs in todo:
        if init is None and not hasattr(m, "reset_parameters"):
            raise ValueError(f"module '{name}' ({type(m).__name__}) has tensors on the meta device but no "
                             "reset_parameters(); pass param_init_fn= to initialise it")
        for k in bufs:
            b = m._buffers[k]
            m._buffers[k] = torch.empty(b.shape, dtype=b.dtype, device=device)  # type: ignore[union-attr]
        _init_module(m, params, device, init or (lambda mod: mod.reset_parameters()), done)  # type: ignore[operator]


def _meta_modules(model: nn.Module) -> list[tuple[str, nn.Module, list[str], list[str]]]:
    """Each module with tensors of its own on the meta device: (name, module, their parameter and buffer keys)."""
    out: list[tuple[str, nn.Module, list[str], list[str]]] = []
    for name, m in model.named_modules():
        params = [k for k, p in m._parameters.items() if p is not None and p.device.type == "meta"]
        bufs = [k for k, b in m._buffers.items() if b is not None and b.device.type == "meta"]
        if params or bufs:
            out.append((name, m, params, bufs))
    return out


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Buffers on the training device (FSDP2 shards parameters only; offloaded shards left the buffers on the CPU)."""
    for m in model.modules():
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = b.to(device)


def _init_module(m: nn.Module, params: list[str], device: torch.device, init: Init, done: set[int]) -> None:
    """Run ``init`` on ``m`` with full-size parameters, then keep this rank's part of each one initialised here
    first (a parameter tied to an earlier module keeps that module's values, as under our FSDP)."""
    held = {k: m._parameters[k] for k in params}
    for k, p in held.items():
        if p is not None and not _give_memory(p, device, done):
            m._parameters[k] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
    try:
        init(m)
    finally:
        full = dict(m._parameters)
        m._parameters.update(held)
    for k, p in held.items():
        if p is not None and id(p) not in done:
            _keep_shard(p, full[k])  # type: ignore[arg-type]
            done.add(id(p))


def _give_memory(p: nn.Parameter, device: torch.device, done: set[int]) -> bool:
    """Give a plain meta parameter whole memory in place (the same object: ties, hooks stay); whether ``p``
    itself is what ``init`` should write (False: an FSDP2 shard, or a tied parameter already initialised)."""
    if isinstance(p, DTensor) or id(p) in done:
        return False
    if p.device.type == "meta":
        fresh = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, fresh)
    return True


def _keep_shard(p: nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's FSDP2 shard of ``p`` out of its full value (nothing to do for a whole tensor)."""
    if full is p:
        return
    start, data = dim0_run(p)
    data.view(-1).copy_(full.reshape(-1)[start:start + data.numel()])


__all__ = ["init_meta"]
