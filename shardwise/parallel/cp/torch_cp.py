"""PyTorch's context parallelism for ``engine="torch"``: ``context_parallel`` around each step's micro-batches.

``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=, buffer_seq_dims=, no_restore_buffers=)``
does two things while its block runs (torchtitan's use, and ours):

* it cuts each buffer along its sequence dimension, in place. With S divisible by ``2C`` its load balancer is
  head-tail: cp rank r keeps chunks r and ``2C-1-r`` of ``2C``, the chunks our own context parallelism holds
  (:func:`~shardwise.parallel.cp.attention.chunk_ids`), so evaluation's outputs join the same way. The buffers
  are every tensor of the batch with two or more dimensions (inputs and targets, cut along dim 1 as
  :func:`~shardwise.parallel.cp.apply.shard_batch` cuts them) and the positions ``0..S-1``; each is a copy, so the
  loader's batch stays whole. The positions a rank keeps are its tokens' places in the whole sequence: a forward
  pre-hook passes them as ``position_ids`` to the outermost modules that take them (learned positions, RoPE).
* it replaces ``F.scaled_dot_product_attention`` by its ring attention: query, key and value become DTensors
  sharded on dim 2 over the cp mesh, and the key/value blocks travel (all-gathered, torch's default rotate
  method; ``set_rotate_method`` is global and left alone) with outputs merged by log-sum-exp, in forward and in
  backward, which must therefore run inside the block too. Only SDPA's flash, efficient and cuDNN kernels have a
  ring form, and those are CUDA's: on CPU torch 2.13 finds no sharding strategy for
  ``aten._scaled_dot_product_flash_attention_for_cpu``, and the math kernel (float64's only one) has none.

shardwise's :class:`~shardwise.models.Attention` calls ``F.scaled_dot_product_attention(is_causal=True)``
already. A Hugging Face model's attention modules are switched (:func:`use_torch_sdpa`) to transformers' own
"sdpa" function under a registered name whose mask function builds no mask: attention is causal by
``is_causal``, where transformers would read the head-tail ``position_ids`` as packed sequences and build a
block mask the ring cannot take. Key/value heads are repeated to the query heads first, so grouped-query
attention reaches SDPA as plain multi-head attention (``enable_gqa`` with unequal heads is not accepted by every
SDPA kernel, and a kernel refused falls back to math); the ring then moves every head's keys and values.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.comm.topology import Topology
from shardwise.data import Kwargs
from shardwise.dims import CP, DP_SHARD_CP, PP, TP
from shardwise.parallel.cp.apply import hf_attention_modules, position_takers, use_hf_attention
from shardwise.parallel.cp.attention import RING

# The SDPA kernels torch's ring attention has a form of (CUDA's; flash and cuDNN in half precision only).
RING_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
TORCH_HF_ATTENTION = "shardwise_torch_cp"  # transformers' "sdpa" function, registered under this name, no mask
# Why torch's context parallelism runs on CUDA only (torch 2.13; refused on CPU before any process starts).
CONTEXT_PARALLEL_CUDA_ONLY = ("torch's context_parallel runs its ring attention through SDPA's flash, efficient and "
                              "cuDNN kernels, which are CUDA's, and has no sharding strategy for the CPU's "
                              "(aten._scaled_dot_product_flash_attention_for_cpu)")


def refuse_torch_cp(cp_mode: str, *, tp: int, pp: int, replicate: int, zero: int, sequence_parallel: bool) -> None:
    """Refuse what torch's context parallelism does not run of a ``sw.Parallel`` with cp > 1: torch's ring only,
    split by nothing but dp, gradients through DDP (``zero=0``) or FSDP2 (``zero=3``) without replicas."""
    if cp_mode != RING:
        raise ValueError(f"engine='torch' has no engine for cp_mode={cp_mode!r}: torch's context_parallel "
                         "is ring attention only; use cp_mode='ring', or engine='shardwise'")
    others = {TP: tp, PP: pp, "replicate": replicate}
    split = {k: v for k, v in others.items() if v != 1}
    if split or sequence_parallel or zero not in (0, 3):
        given = ", ".join(f"{k}={v}" for k, v in {**split, "zero": zero}.items())
        raise ValueError(f"engine='torch' runs context parallelism only with dp yet (sw.Parallel(cp=N, dp=M) with "
                         f"zero=0: torch's DDP over dp x cp, or zero=3: FSDP2 over dp x cp), got {given}"
                         f"{', sequence_parallel=True' if sequence_parallel else ''}; engine='shardwise' "
                         "runs it")


def refuse_float64(name: str, model: nn.Module) -> None:
    """Refuse strategy ``name`` on a model with float64 parameters: no kernel of :data:`RING_KERNELS` takes them."""
    if any(p.dtype == torch.float64 for p in model.parameters()):
        raise ValueError(f"engine='torch' cannot run strategy {name!r} on a float64 model: torch's ring "
                         "attention has forms of SDPA's flash, efficient and cuDNN kernels only, and none takes "
                         "float64 (efficient: float32 and half; flash, cuDNN: half); use float32 or half "
                         "precision, or engine='shardwise'")


def cp_mesh(topo: Topology) -> DeviceMesh:
    """The 1-D mesh of this rank's cp group: the run's mesh sliced, or a mesh of one in a process group of one."""
    if topo.mesh is None:
        return init_device_mesh(topo.device.type, (1,), mesh_dim_names=(CP,))
    return topo.mesh[CP]


def dp_shard_cp_mesh(topo: Topology) -> DeviceMesh:
    """The 1-D mesh FSDP2 shards over under cp: the dp_shard x cp ranks (torchtitan's ``dp_shard_cp``), which hold
    one replica's parameters and see other tokens; a mesh of one in a process group of one."""
    if topo.mesh is None:
        return init_device_mesh(topo.device.type, (1,), mesh_dim_names=(DP_SHARD_CP,))
    # From the group itself: slicing the run's mesh at a flattened dim warns that torch will drop it.
    return DeviceMesh.from_group(topo.group(DP_SHARD_CP), topo.device.type, mesh_dim_names=(DP_SHARD_CP,))  # type: ignore[arg-type]


# ---- the batch ------------------------------------------------------------------------------------
def sequence_copies(x: Any, out: list[torch.Tensor]) -> Any:
    """``x`` with every tensor of two or more dimensions copied (appended to ``out``, in order): the buffers
    ``context_parallel`` cuts in place along dim 1. Other leaves are passed unchanged."""
    if isinstance(x, torch.Tensor):
        if x.dim() < 2:
            return x
        out.append(x.clone())
        return out[-1]
    if isinstance(x, dict):
        if "attention_mask" in x:  # checked before start too (check_context_parallel)
            raise ValueError("context parallel: batches with an attention_mask (padding) are not supported; "
                             "pack sequences to the full length instead")
        parts = [(k, sequence_copies(v, out)) for k, v in x.items()]
        return Kwargs(parts) if isinstance(x, Kwargs) else dict(parts)
    if isinstance(x, (list, tuple)):
        return type(x)(sequence_copies(v, out) for v in x)
    return x


def positions_of(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """``0..S-1`` as a (1, S) buffer, S the batch's sequence length: cut with the tokens, it says where they are."""
    if not buffers:
        raise ValueError("context parallel: the batch has no tensor with a sequence dimension (two or more "
                         "dimensions) to split")
    return torch.arange(buffers[0].shape[1], device=buffers[0].device).unsqueeze(0)


# ---- the model ------------------------------------------------------------------------------------
@dataclass
class TorchContextParallel:
    """One rank's cp mesh and the positions of the tokens it holds while a block of :meth:`sharded` runs."""

    mesh: DeviceMesh
    positions: torch.Tensor | None = None

    def prepare(self, model: nn.Module) -> nn.Module:
        """Pass positions to ``model``'s position takers and switch a Hugging Face model to SDPA, in place."""
        use_torch_sdpa(model)
        for m in position_takers(model):
            m.register_forward_pre_hook(functools.partial(_with_positions, self), with_kwargs=True)
        return model

    @contextlib.contextmanager
    def sharded(self, micro_batches: Sequence[tuple[Any, Any]]) -> Iterator[list[tuple[Any, Any]]]:
        """This rank's tokens of every micro-batch, with torch's ring attention on, for the block's forwards and
        backwards (one ``context_parallel`` block for the step: its micro-batches share one sequence length)."""
        buffers: list[torch.Tensor] = []
        local = [(sequence_copies(x, buffers), sequence_copies(y, buffers)) for x, y in micro_batches]
        positions = positions_of(buffers)
        buffers.append(positions)
        with _context_parallel(self.mesh, buffers):
            self.positions = positions
            try:
                yield local
            finally:
                self.positions = None


@contextlib.contextmanager
def _context_parallel(mesh: DeviceMesh, buffers: list[torch.Tensor]) -> Iterator[None]:
    # The buffers are this step's copies: nothing reads them whole afterwards, so none is restored. SDPA may pick
    # only the kernels torch's ring has a form of (torchtitan restricts it the same way): the math kernel has none,
    # and what it would compute on DTensors of head-tail chunks is not the ring's attention; a model it would need
    # fails here, naming the kernels, rather than training on something else.
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                          no_restore_buffers=set(buffers)), sdpa_kernel(RING_KERNELS):
        yield


def _with_positions(cp: TorchContextParallel, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if cp.positions is not None and kwargs.get("position_ids") is None:  # outside a block: the model's own
        kwargs["position_ids"] = cp.positions
    return args, kwargs


def use_torch_sdpa(model: nn.Module) -> nn.Module:
    """Switch a Hugging Face model's attention to transformers' "sdpa" function without a mask (module
    docstring); a model without such attention modules (shardwise's GPT calls SDPA itself) is left alone."""
    use_hf_attention(hf_attention_modules(model), TORCH_HF_ATTENTION, _hf_sdpa)
    return model


def _hf_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention with key/value heads repeated to the query heads and no mask (causal)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa

    if use_gqa_in_sdpa(None, key, value):  # it would pass enable_gqa with fewer kv heads: repeat them here
        groups = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


__all__ = ["CONTEXT_PARALLEL_CUDA_ONLY", "RING_KERNELS", "TORCH_HF_ATTENTION", "TorchContextParallel", "cp_mesh",
           "dp_shard_cp_mesh", "positions_of", "refuse_float64", "refuse_torch_cp", "sequence_copies", "use_torch_sdpa"]
