"""Every private torch API shardwise patches or calls, in one place, each with why.

torch promises nothing about a name that starts with an underscore or lives in
a ``_``-prefixed module: any minor release may move it. So they are written
only here (callers import from this module), pyproject.toml bounds torch above
by the next minor version not yet tested, and tests/base/test_torch_private.py
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
                                                                           ``parallel.dp.ddp``)
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
                                                                           ``parallel.cp.attention``)
``torch.nn.modules.batchnorm._BatchNorm``                                  the base of every BatchNorm
                                                                           (BatchNorm1d/2d/3d, lazy, torch's
                                                                           SyncBatchNorm): :data:`BatchNormBase`
                                                                           (``commands.verify``,
                                                                           ``parallel.dp.sync_bn``,
                                                                           ``fit.steps``)
``torch._amp_foreach_non_finite_check_and_unscale_``                       torch.amp.GradScaler's fused unscale
                                                                           and inf/NaN check, one pass per device
                                                                           and dtype (:data:`UNSCALE_AND_CHECK`;
                                                                           ``precision.unscale_grads``)
``torch._dynamo.trace_rules.add(module)``                                  compiled blocks call our communication
                                                                           and wrappers' hooks eagerly, between
                                                                           graphs (:func:`run_outside_graphs`;
                                                                           ``parallel.compiling``)
``torch._dynamo.utils.get_compilation_metrics()`` (``co_name``,            what a fit compiled and why it
``recompile_reason``), ``clear_compilation_metrics()``,                    recompiled (:func:`compilations`;
``torch._dynamo.reset()``                                                  ``parallel.compiling``)
``torch._inductor.runtime.cache_dir_utils.default_cache_dir()``            inductor's cache, named for every rank
                                                                           (:func:`inductor_cache_dir`)
``torch.distributed.tensor._redistribute._gen_transform_infos``            emptied when torch's engines start in
(``cache_clear()``), ``torch.distributed.tensor.debug``'s                  a process that ran DTensors in an
``_clear_python_sharding_prop_cache()`` and                                earlier process group
``_clear_fast_path_sharding_prop_cache()``                                 (:func:`forget_dtensor_plans`;
                                                                           ``strategies.torch_engine``'s
                                                                           ``wrappers``)
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
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []  # type: ignore[union-attr]
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    return [e.nbytes() for e in memory]  # type: ignore[union-attr]


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


# ---- torch.compile (torch._dynamo and torch._inductor take seconds to import: loaded when compile is used) --
_OUTSIDE: set[str] = set()


def run_outside_graphs(modules: list[str]) -> None:
    """torch.compile never traces the functions of ``modules`` (packages or modules, by import name): a compiled
    block that calls one breaks its graph there and runs it eagerly. Communication and the wrappers' hooks keep
    Python state (byte counts, a unit's sharded or gathered state) that a traced copy would guard on, and so
    recompile each time it changes; they join dynamo's skip list, where torch's own distributed code is."""
    from torch._dynamo import trace_rules

    for m in modules:
        if m not in _OUTSIDE:
            trace_rules.add(m)
            _OUTSIDE.add(m)


def forget_compilations(everything: bool) -> None:
    """Start this process's record of compilations afresh; with ``everything``, its compiled code too
    (``torch._dynamo.reset()``: a rank process that runs fit after fit compiles each one's blocks itself)."""
    import torch._dynamo
    from torch._dynamo import utils

    if everything:
        torch._dynamo.reset()
    utils.clear_compilation_metrics()


def compilations() -> list[tuple[str, str | None]]:
    """(code name, recompile reason or None) of each compilation this process recorded since it was cleared."""
    from torch._dynamo import utils

    return [(m.co_name or "", m.recompile_reason) for m in utils.get_compilation_metrics()]


def inductor_cache_dir() -> str:
    """Inductor's default cache directory (``TORCHINDUCTOR_CACHE_DIR`` when set)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def forget_dtensor_plans() -> None:
    """Empty DTensor's caches of redistribution steps and sharding propagation. They are keyed by DTensor specs,
    whose ``DeviceMesh`` equals a mesh of an earlier process group with the same ranks, shape and names (mesh
    equality ignores the groups), and they hold meshes: a second run in one process (a worker that trains fit
    after fit, a notebook) would reuse the first group's, gone by then ("Could not resolve the process group
    registered under the name N", measured: the tests' worker pool, a 4-rank tp x HSDP run, then tp x FSDP)."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_fast_path_sharding_prop_cache, _clear_python_sharding_prop_cache

    _redistribute._gen_transform_infos.cache_clear()
    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()  # the C++ dispatch's own cache of the same


__all__ = ["UNSCALE_AND_CHECK", "BatchNormBase", "FLASH_ATTENTION_CPU", "FLASH_ATTENTION_CPU_BACKWARD",
           "as_main_process",
           "at_backward_end", "c10d_default_store", "compilations", "forget_compilations",
           "forget_dtensor_plans", "host_rendezvous_stores",
           "in_backward", "inductor_cache_dir", "memory_records", "recomputing", "run_outside_graphs"]

