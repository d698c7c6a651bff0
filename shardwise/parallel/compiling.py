"""Compiling a model block by block (``torch.compile``), before any strategy wraps it.

Each block (every entry of the model's ModuleLists, as activation checkpointing picks them) is compiled in
place with ``Module.compile()``: the module stays where it is, so parameter names, state-dict keys,
tensor-parallel plans, FSDP units and checkpoints keep the model's own names (``torch.compile(model)``
returns a wrapper whose keys all start with ``_orig_mod.``). Compiling per block rather than the whole model is
torchtitan's choice too: the blocks share one code object, so one graph serves all of them, and what a
strategy runs between blocks (FSDP's gathers, pipeline sends) stays outside the graphs.

The compiled graphs are traced on the first step, after the strategy put its layers in (tensor-parallel
linears, sharded parameters). Ranks on one host share inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``,
by default inductor's own per-user one), so the ranks after the first find the kernels compiled. What the fit
compiled, and every recompilation with dynamo's reason, is counted (:func:`compile_report`), not hidden.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from torch import nn

from shardwise.parallel.checkpointing import blocks
from shardwise.torch_private import compilations, forget_compilations, inductor_cache_dir, run_outside_graphs

DEFAULT_BACKEND = "inductor"
# What a compiled block calls but must run eagerly, between its graphs: communication (byte counts, handles),
# the autograd functions and hooks of the wrappers (a unit's gathered or sharded state, tensor-parallel caches).
# Inside a graph, dynamo would guard on that state and recompile every time it changes.
EAGER_MODULES = ["shardwise.comm", "shardwise.parallel.dp.fsdp_module", "shardwise.parallel.dp.fsdp_units",
                 "shardwise.parallel.tp.layers", "shardwise.parallel.tp.sequence_parallel",
                 "shardwise.parallel.cp.apply", "shardwise.parallel.cp.attention", "shardwise.parallel.ep",
                 "shardwise.parallel.dp.zero_module"]


def backend_of(compile: bool | str) -> str | None:
    """The ``torch.compile`` backend an option value asks for: ``True`` is inductor, a string names one
    (``"aot_eager"``: dynamo and AOTAutograd without code generation), ``False`` none."""
    if compile is True:
        return DEFAULT_BACKEND
    if compile is False:
        return None
    if isinstance(compile, str) and compile:
        return compile
    raise ValueError(f"compile must be True, False or a torch.compile backend name, got {compile!r}")


def compile_blocks(model: nn.Module, backend: str = DEFAULT_BACKEND,
                   classes: Iterable[type[nn.Module]] | None = None, fresh: bool = False) -> list[nn.Module]:
    """Compile each block of ``model`` in place (names unchanged); returns the blocks (none is an error).

    Call it before the strategy wraps the model and after activation checkpointing (the checkpointed forward
    is what gets compiled, recomputation included). Clears this process's record of compilations, so that
    :func:`compile_report` counts this model's; ``fresh`` drops the process's compiled code too (a rank of the
    Trainer compiles its own; a user's process keeps what it compiled elsewhere)."""
    chosen = blocks(model, classes)
    if not chosen:
        raise ValueError("compile found no blocks: the model has no nn.ModuleList of blocks to compile one by one; "
                         "compile the model yourself before passing it (model.compile()), or leave compile off")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())  # every rank names the same one
    run_outside_graphs(EAGER_MODULES)
    forget_compilations(everything=fresh)
    for b in chosen:
        b.compile(backend=backend)
    return chosen


def compile_report() -> dict[str, Any]:
    """What this process compiled since :func:`compile_blocks`: graphs compiled, recompilations, and the
    distinct reasons dynamo gave for them (a shape or dtype that changed, a guard that failed)."""
    done = compilations()
    reasons = [why for _, why in done if why]
    return {"compile_frames": len(done), "compile_recompiles": len(reasons),
            "compile_recompile_reasons": list(dict.fromkeys(reasons))[:5]}


def recompile_warning(report: dict[str, Any]) -> str | None:
    """One line about the recompilations of a fit (None without any): each costs a compile, and a storm of
    them (a shape that changes every step) makes a compiled run slower than an eager one."""
    n = report["compile_recompiles"]
    if not n:
        return None
    first = report["compile_recompile_reasons"][0]
    return (f"shardwise: the compiled blocks recompiled {n} time(s) during the fit (first reason: {first}); each "
            "costs a compile: keep shapes fixed (drop_last batches, a fixed sequence length), or see "
            "TORCH_LOGS=recompiles")


__all__ = ["DEFAULT_BACKEND", "backend_of", "compile_blocks", "compile_report", "recompile_warning"]

