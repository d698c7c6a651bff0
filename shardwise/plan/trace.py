"""Trace a module on the meta device: parameters, activations and FLOPs without allocating memory.

Meta tensors carry shapes and dtypes but no storage, so a 70B-parameter
factory builds in milliseconds. One forward and backward pass on a meta input
then tells us three things:

* every leaf module's output size (forward hooks), the per-layer view;
* what autograd actually keeps for the backward pass (saved-tensor hooks),
  which is the activation memory of one micro-batch: it sees the tensors
  that functional calls inside ``forward`` save too, which hooks on modules miss;
* the FLOPs of forward plus backward (``torch.utils.flop_counter``).

Attention traced on the meta device takes the math path and so keeps the
score matrix, as an implementation without flash attention would.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from shardwise.data import leaves
from shardwise.plan.model import ModelSpec, Trace

DTYPES: dict[str, torch.dtype] = {"long": torch.long, "int64": torch.long, "int": torch.int32, "int32": torch.int32,
                                  "float": torch.float32, "float32": torch.float32, "fp32": torch.float32,
                                  "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "half": torch.float16}


def load_factory(spec: str) -> Callable[[], object]:
    """The function named by ``path.py:factory``."""
    path, sep, fn_name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ValueError(f"expected path.py:factory, got {spec!r}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file {path!r} does not exist")
    mod_name = f"_shardwise_plan_{os.path.splitext(os.path.basename(path))[0]}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look their module up here
    module_spec.loader.exec_module(module)
    factory: Callable[[], object] | None = getattr(module, fn_name, None)
    if not callable(factory):
        raise AttributeError(f"{path} has no function {fn_name!r}")
    return factory


def build_on_meta(factory: Callable[[], object]) -> nn.Module:
    """Call ``factory`` with meta as the default device; a (model, ...) tuple yields its model."""
    with torch.device("meta"):
        out = factory()
    parts = out if isinstance(out, (tuple, list)) else (out,)
    model = next((o for o in parts if isinstance(o, nn.Module)), None)
    if model is None:
        raise TypeError("the factory returned no torch.nn.Module")
    return model


def meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers live on meta (no data is copied)."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def trace_module(model: nn.Module, input_shape: Sequence[int], input_dtype: torch.dtype | str = torch.float32,
                 ) -> Trace:
    """Run one forward and backward pass of a meta ``model`` on a meta input of ``input_shape``."""
    dtype = DTYPES[input_dtype] if isinstance(input_dtype, str) else input_dtype
    if any(t.device.type != "meta" for t in (*model.parameters(), *model.buffers())):
        model = meta_copy(model)
    shape = tuple(int(d) for d in input_shape)
    x = torch.zeros(shape, dtype=dtype, device="meta")
    state_ids = {id(t) for t in (*model.parameters(), *model.buffers())}

    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Views (reshapes, transposes) of one tensor count once; parameters are model states, not activations.
        base = t._base if t._base is not None else t
        if id(base) not in state_ids:
            saved[id(base)] = base
        return t

    outputs: list[tuple[str, int]] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(mod: nn.Module, _inp: object, out: object) -> None:
        outputs.append((names.get(mod, type(mod).__name__) or type(mod).__name__, _tensor_bytes(out)))

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
            first = out if isinstance(out, torch.Tensor) else leaves(out)[0]
            if first.requires_grad:
                first.float().sum().backward()
    finally:
        for h in handles:
            h.remove()
    total = sum(_nbytes(t) for t in saved.values())
    floats = sum(_nbytes(t) for t in saved.values() if t.is_floating_point())
    return Trace(input_shape=shape, input_dtype=str(dtype).replace("torch.", ""), batch=shape[0] if shape else 1,
                 saved_bytes=total, saved_float_bytes=floats, layer_outputs=tuple(outputs),
                 flops=float(counter.get_total_flops()))


def trace_factory(spec: str, input_shape: Sequence[int], input_dtype: torch.dtype | str = torch.float32,
                  name: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` for ``path.py:factory``, traced on the meta device."""
    model = build_on_meta(load_factory(spec))
    return spec_from_trace(model, trace_module(model, input_shape, input_dtype), name or spec)


def spec_from_trace(model: nn.Module, trace: Trace, name: str) -> ModelSpec:
    base = ModelSpec.from_module(model, name=name)
    # The trace measures activations directly; a config shape would only be used for tp/pp splits.
    return ModelSpec(name=name, params=base.params, largest_layer_params=base.largest_layer_params,
                     param_numels=base.param_numels, trace=trace)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensor_bytes(out: object) -> int:
    return sum(_nbytes(t) for t in leaves(out))
