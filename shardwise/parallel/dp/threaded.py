"""Single-process data parallel: scatter, replicate, run in threads, gather.

One process drives every device. Each forward pass

1. **scatters** the batch: it is cut along dim 0 into one slice per device;
2. **replicates** the model: the parameters on the primary device are copied to
   every device through an autograd function whose backward *sums* the
   replicas' gradients back onto the primary device (the gradient reduction
   happens there, inside the ordinary ``loss.backward()``);
3. **applies** the replicas in parallel, one Python thread per device;
4. **gathers** the outputs onto the primary device, concatenated along dim 0,
   where the loss is computed over the whole batch.

This is the design of ``torch.nn.DataParallel``, written here on our own. Li
et al. 2020 ("PyTorch Distributed", VLDB) explain why it loses to DDP on GPUs:
the replicas are rebuilt every step, the primary device does all the
scattering, gathering and reduction, and one interpreter's GIL serialises the
Python work of all the threads. On a CPU "device list" the replicas are
threads sharing the same cores, so it shows the overheads without any of the
parallel hardware.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

DeviceLike = int | str | torch.device


# ---- scatter ---------------------------------------------------------------------
def scatter(obj: Any, devices: Sequence[torch.device]) -> list[Any]:
    """Cut every tensor in ``obj`` along dim 0 into (at most) one slice per device and move it there.

    Tuples, lists and dicts are walked; other objects are passed to every
    replica unchanged. Returns one entry per device that got data: a batch
    smaller than the device count uses fewer devices.
    """
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise ValueError("cannot scatter a 0-dimensional tensor over devices; inputs need a batch dimension")
        parts = obj.chunk(len(devices))
        return [p.to(d, non_blocking=True) for p, d in zip(parts, devices)]
    if isinstance(obj, (tuple, list)) and obj:
        columns = [scatter(v, devices) for v in obj]
        k = min(len(c) for c in columns)
        rows = [[c[i] for c in columns] for i in range(k)]
        return [type(obj)(r) if isinstance(obj, tuple) else r for r in rows]
    if isinstance(obj, dict) and obj:
        keys = list(obj)
        columns = [scatter(obj[key], devices) for key in keys]
        k = min(len(c) for c in columns)
        return [dict(zip(keys, (c[i] for c in columns))) for i in range(k)]
    return [obj for _ in devices]


# ---- replicate --------------------------------------------------------------------
class _Broadcast(torch.autograd.Function):
    """Copies of the parameters on every device; backward sums their gradients on the primary device.

    Always real copies, also for a CPU replica (``.to`` would return the
    parameter itself): then every replica owns its tensors and the reduction
    below is the only place gradients meet, as on separate devices.
    """

    @staticmethod
    def forward(ctx: Any, devices: tuple[torch.device, ...], *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.n_params = len(params)
        ctx.n_devices = len(devices)
        ctx.homes = [p.device for p in params]
        ctx.set_materialize_grads(False)
        return tuple(p.detach().to(d, copy=True) for d in devices for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        out: list[torch.Tensor | None] = []
        for j in range(ctx.n_params):
            total = None
            # Replica order, so the sum is the same bits every run.
            for i in range(ctx.n_devices):
                g = grads[i * ctx.n_params + j]
                if g is None:
                    continue
                g = g.to(ctx.homes[j], non_blocking=True)
                total = g.clone() if total is None else total.add_(g)
            out.append(total)
        return (None, *out)


def _shallow_copy(module: nn.Module, params: dict[int, torch.Tensor], buffers: dict[int, torch.Tensor],
                  memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:  # shared submodules stay shared in the replica
        return memo[id(module)]
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    memo[id(module)] = replica
    replica._parameters = {}
    replica._buffers = {k: (buffers[id(b)] if b is not None else None) for k, b in module._buffers.items()}
    replica._modules = {k: (_shallow_copy(m, params, buffers, memo) if m is not None else None)
                        for k, m in module._modules.items()}
    for k, p in module._parameters.items():
        # Replica weights are non-leaf tensors (gradients flow back through
        # _Broadcast), so they are plain attributes, not registered Parameters.
        object.__setattr__(replica, k, params[id(p)] if p is not None else None)
    return replica


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One differentiable copy of ``module`` per device (shared and tied parameters stay tied).

    Gradients of all replicas are summed into the original parameters'
    ``.grad``. The first replica uses the original buffers when it sits on
    their device, so in-place buffer updates (batch-norm statistics) persist;
    the others get copies, as in ``torch.nn.DataParallel``.
    """
    params = [p for p in module.parameters()]
    copies = _Broadcast.apply(tuple(devices), *params) if params else ()
    buffers = list(module.buffers())
    replicas = []
    for i, d in enumerate(devices):
        pmap = {id(p): copies[i * len(params) + j] for j, p in enumerate(params)}
        bmap = {id(b): (b if (i == 0 and b.device == d) else b.detach().to(d, copy=True)) for b in buffers}
        replicas.append(_shallow_copy(module, pmap, bmap, {}))
    return replicas


# ---- parallel apply -----------------------------------------------------------------
def _device_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
                   devices: Sequence[torch.device]) -> list[Any]:
    """Run ``replicas[i](*args_i, **kwargs_i)`` on ``devices[i]``, one thread per replica.

    Grad mode and autocast are thread-local in PyTorch, so the caller's are
    re-entered in every thread. An exception in a replica is re-raised here,
    naming the replica and its device.
    """
    grad = torch.is_grad_enabled()
    amp = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in {d.type for d in devices}}
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)

    def run(i: int) -> None:
        dev = devices[i]
        enabled, dtype = amp[dev.type]
        try:
            with torch.set_grad_enabled(grad), _device_context(dev), \
                    torch.autocast(dev.type, dtype=dtype, enabled=enabled):
                args, kwargs = inputs[i]
                results[i] = replicas[i](*args, **kwargs)
        except BaseException as e:  # re-raised in the caller's thread below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"shardwise-dp-{i}") for i in range(1, len(replicas))]
    for t in threads:
        t.start()
    if replicas:
        run(0)  # the caller's thread drives the first replica itself
    for t in threads:
        t.join()
    for i, e in enumerate(errors):
        if e is not None:
            raise RuntimeError(f"DP replica {i} on {devices[i]} failed: {type(e).__name__}: {e}") from e
    return results


# ---- gather --------------------------------------------------------------------------
def gather(outputs: Sequence[Any], device: torch.device) -> Any:
    """Concatenate the replicas' outputs along dim 0 on ``device`` (differentiably).

    0-dimensional outputs (a scalar per replica) are stacked into a vector.
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        moved = [o.to(device, non_blocking=True) for o in outputs]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved, dim=0)
    if isinstance(first, (tuple, list)):
        items = [gather([o[i] for o in outputs], device) for i in range(len(first))]
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*items)
        return type(first)(items)
    if isinstance(first, dict):
        return type(first)((k, gather([o[k] for o in outputs], device)) for k in first)
    if first is None:
        return None
    raise TypeError(f"DP cannot gather model outputs of type {type(first).__name__}")


class DataParallelModule(nn.Module):
    """Wrap ``module`` (on ``devices[0]``) so that every forward runs on all ``devices`` at once."""

    def __init__(self, module: nn.Module, devices: Sequence[torch.device]) -> None:
        super().__init__()
        if not devices:
            raise ValueError("DP needs at least one device")
        self.module = module
        self.devices = [torch.device(d) for d in devices]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.devices) == 1:
            return self.module(*args, **kwargs)
        arg_parts = scatter(tuple(args), self.devices) if args else []
        kw_parts = scatter(kwargs, self.devices) if kwargs else []
        k = min(len(p) for p in (arg_parts, kw_parts) if p) if (args or kwargs) else len(self.devices)
        inputs = [(tuple(arg_parts[i]) if args else (), dict(kw_parts[i]) if kwargs else {}) for i in range(k)]
        devices = self.devices[:k]
        replicas = replicate(self.module, devices)
        return gather(parallel_apply(replicas, inputs, devices), self.devices[0])


__all__ = ["DataParallelModule", "gather", "parallel_apply", "replicate", "scatter"]
