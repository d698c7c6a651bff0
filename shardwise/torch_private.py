"""Every private torch API shardwise patches or calls, in one place, each with why.

torch promises nothing about a name that starts with an underscore or lives in
a ``_``-prefixed module: any minor release may move it. So they are written
only here (callers import from this module), pyproject.toml bounds torch above
by the next minor version not yet tested, and tests/test_torch_private.py
checks each one's existence and the signature or shape relied on, so that an
upgrade that moves one fails there, by name, instead of deep inside a run.
This module imports only torch and the standard library.

=========================================================================  =====================================
private API                                                                what for (the caller)
=========================================================================  =====================================
``DynamicRendezvousHandler._create_tcp_store_server(self, addr, port)``    replaced, in the launcher process only,
(torch.distributed.elastic.rendezvous.dynamic_rendezvous)                  so that torchrun's agent hosts the
                                                                           workers' store on 127.0.0.1
                                                                           (:func:`host_rendezvous_stores`;
                                                                           ``launch.loopback_rendezvous``)
``torch.distributed.distributed_c10d._get_default_store()``                the job's store under c10d's
                                                                           prefixes, where rank records go
                                                                           (:func:`c10d_default_store`;
                                                                           ``comm.diagnostics.default_store``)
``torch.utils.data._utils.worker._worker_info``                            set to None while a user's stream is
                                                                           read in our DataLoader workers, so it
                                                                           yields all of itself
                                                                           (:func:`as_main_process`; ``data``)
``torch.autograd.Variable._execution_engine.queue_callback(fn)``           DDP's end-of-backward work, run once
                                                                           when autograd's pass ends
                                                                           (:func:`at_backward_end`;
                                                                           ``parallel.ddp``)
``torch._C._current_graph_task_id()``                                      whether a forward runs inside a
                                                                           backward pass: activation
                                                                           checkpointing's recompute
                                                                           (:func:`recomputing`; ``scalars``,
                                                                           ``fit.profiler``)
``profile.profiler.kineto_results.events()``, each event's ``name()``,     the exact peak of torch's CPU
``nbytes()`` and ``start_ns()`` (``torch._C._autograd._ProfilerResult``)   allocator from the profiler's memory
                                                                           records (:func:`memory_records`;
                                                                           ``stats.AllocatedPeak``)
``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and         one attention block with its
``..._backward``                                                           log-sum-exp, for ring attention on
                                                                           CPU (:data:`FLASH_ATTENTION_CPU`;
                                                                           ``parallel.cp_attention``)
``torch.nn.modules.batchnorm._BatchNorm``                                  the base of every BatchNorm
                                                                           (BatchNorm1d/2d/3d, lazy, torch's
                                                                           SyncBatchNorm): :data:`BatchNormBase`
                                                                           (``verify``, ``parallel.sync_bn``,
                                                                           ``fit.steps``)
``torch._amp_foreach_non_finite_check_and_unscale_``                       torch.amp.GradScaler's fused unscale
                                                                           and inf/NaN check, one pass per device
                                                                           and dtype (:data:`UNSCALE_AND_CHECK`;
                                                                           ``precision.unscale_grads``)
=========================================================================  =====================================

Also relied on, and checked by the tests, though not routed through here: the
``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``
protocol of ``torch.distributed._checkpointable`` that ``checkpoint.pieces.Pieces``
implements, and the module ``torch._dynamo`` that the worker pool preloads.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data._utils import worker as _loader_worker

# ---- rendezvous ----------------------------------------------------------------------------------------


def host_rendezvous_stores(make_store: Callable[[], dist.TCPStore]) -> bool:
    """Make every torchrun agent of this process host its workers' store with ``make_store()`` instead of on
    every interface: ``DynamicRendezvousHandler._create_tcp_store_server`` replaced, for this process (the
    launcher) only. False where torchelastic's rendezvous or that method is missing (nothing replaced)."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
        )
    except ImportError:
        return False

    def on_loopback(self: Any, master_addr: str, master_port: int) -> dist.TCPStore:
        return make_store()

    if not hasattr(DynamicRendezvousHandler, "_create_tcp_store_server"):
        return False
    DynamicRendezvousHandler._create_tcp_store_server = on_loopback  # type: ignore[method-assign]
    return True


def c10d_default_store() -> Any:
    """The default process group's store, as c10d wraps it (PrefixStores), or None where torch moved it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # pragma: no cover - private API moved
        return None


# ---- data --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def as_main_process() -> Iterator[None]:
    """Hide DataLoader worker info (``torch.utils.data.get_worker_info()`` is None) for the block: inside our
    workers a user's stream then yields all of itself, as in the main process."""
    saved = getattr(_loader_worker, "_worker_info", None)
    _loader_worker._worker_info = None
    try:
        yield
    finally:
        _loader_worker._worker_info = saved


# ---- autograd ----------------------------------------------------------------------------------------


def at_backward_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` once when the current autograd pass ends (the engine's callback queue; inside a backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def in_backward() -> bool:
    """Whether this thread is running an autograd backward pass (the engine's current graph task)."""
    return torch._C._current_graph_task_id() != -1


def recomputing() -> bool:
    """Whether a forward running now is activation checkpointing's recompute: inside a backward pass with grad
    mode on, where ``torch.utils.checkpoint`` (reentrant or not, and so our per-block wrapper) re-runs a
    block's forward. A backward pass's own hooks run with grad mode off (unless ``create_graph=True``)."""
    return torch.is_grad_enabled() and in_backward()


# ---- the profiler ------------------------------------------------------------------------------------


def memory_records(prof: torch.profiler.profile) -> list[int]:
    """The size of every allocation (> 0) and free (< 0) the stopped profiler ``prof`` recorded
    (``profile_memory=True``), in time order: its ``[memory]`` events, which have a size and no duration."""
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    return [e.nbytes() for e in memory]


# ---- kernels and classes -----------------------------------------------------------------------------

# Private aten ops, with the same schema in torch 2.11 (its generated ATen/ops headers) and 2.13:
# (query, key, value, dropout_p, is_causal, *, attn_mask, scale) -> (output, logsumexp (B, H, T)), float64
# included; the backward takes grad_out first and out, logsumexp after value. Older kernels assume as many
# kv heads as query heads (parallel.cp_attention expands them).
FLASH_ATTENTION_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_ATTENTION_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# The base class of every BatchNorm (what a model's batch-coupled layers are found by).
BatchNormBase = nn.modules.batchnorm._BatchNorm

# (grads, found_inf (1,) float32, inv_scale (1,) float32) -> None, in place: the grads multiplied by inv_scale,
# found_inf set to 1 if any is inf/NaN. CPU and CUDA kernels for float16/bfloat16/float32/float64 (torch >= 2.3).
UNSCALE_AND_CHECK = torch._amp_foreach_non_finite_check_and_unscale_


__all__ = ["UNSCALE_AND_CHECK", "BatchNormBase", "FLASH_ATTENTION_CPU", "FLASH_ATTENTION_CPU_BACKWARD", "as_main_process",
           "at_backward_end", "c10d_default_store", "host_rendezvous_stores", "in_backward", "memory_records",
           "recomputing"]
