"""Megatron sequence parallelism: the activations between the tensor-parallel layers split along the sequence.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2. Under plain tensor parallelism the norms,
residual sums and dropout of each block run on the whole (B, S, H) activation
on every rank of the tp group. Under sequence parallelism each rank keeps
``S / t`` tokens of those activations, and each all-reduce of a Megatron pair
becomes a reduce-scatter plus an all-gather of the same bytes:

* where an activation enters the tensor-parallel layers (attention, MLP, the
  output head), it is all-gathered along the sequence; the backward
  reduce-scatters its gradient, which replaces ``f``'s all-reduce;
* a row-parallel layer reduce-scatters its partial sums along the sequence
  (its all-gather is in backward), which replaces ``g``;
* the region starts after the embedding (a vocabulary-parallel embedding
  reduce-scatters its lookups, position embeddings keep this rank's rows; or
  the first block splits its input) and ends at the final norm, whose output
  is all-gathered for the head;
* norm weights (and row-parallel biases) inside the region see only this
  rank's tokens: their gradients are summed over tp in every backward, so
  every rank holds the whole, equal gradient. They stay replicated, so
  gradient clipping (:func:`shardwise.parallel.tp.apply.counts_in_norm`) counts
  them once, on tp rank 0, as under plain tp.

Which modules play which part is per model family, in the plan's
:class:`~shardwise.parallel.tp.plans.SequenceLayout`;
:func:`shardwise.parallel.tp.apply.apply_tp` builds the layers and calls
:func:`apply_sequence_parallel` for the hooks. Collectives are named
``tp.sp_gather``, ``tp.sp_reduce_scatter`` and ``tp.sp_scatter`` (they replace
plain tp's ``tp.f`` and ``tp.g``: per layer, the same bytes) and
``sp_grads.<module>`` for the norm gradients (traffic plain tp does not have);
all of it crosses the tp group and counts under its label.

Dropout inside the region (GPT-2's residual dropout) draws from the default
generator, which the Trainer seeds alike on every rank: each tp rank applies
the same mask pattern to its own part of the sequence. Every element is still
dropped with probability p, but the masks of the t parts are equal, so a run
does not reproduce single-device dropout (neither does dropout inside plain tp's
head-split attention). Megatron instead runs the region under a generator
forked per tp rank; that is not done here.

Memory: the colwise layers save the all-gathered (B, S, H) input for their
weight gradients (Megatron keeps the S/t part and all-gathers it again in
backward, one more all-gather per gathered input); here the bytes per layer stay
exactly plain tp's, and the saving is the norms' and residuals' activations.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise.comm import Comm
from shardwise.comm.autograd import all_reduce_grad, gather_from_sequence, scatter_to_sequence
from shardwise.parallel.tp.plans import Plan, SequenceLayout, module_pattern


def sequence_layout(plan: Plan) -> SequenceLayout:
    """The plan's layout, or a ValueError naming what to do."""
    if plan.sequence is None:
        raise ValueError(f"sequence parallel: the '{plan.name}' tensor-parallel plan has no sequence layout (which "
                         "modules start and end the sequence-parallel region); built-in layouts exist for "
                         "shardwise's GPT and Hugging Face GPT-2 and Llama; give your Plan a "
                         "SequenceLayout(gather=..., norms=..., exit=..., ...), or sequence_parallel=False")
    return plan.sequence


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any], where: str) -> tuple[torch.Tensor, bool]:
    """A module's input activation: its first positional argument, else ``hidden_states`` (Hugging Face's
    name; LlamaDecoderLayer passes it by keyword). Returns it and whether it was positional."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], True
    h = kwargs.get("hidden_states")
    if isinstance(h, torch.Tensor):
        return h, False
    raise TypeError(f"sequence parallel: module '{where}' got no tensor as its first argument nor as "
                    "'hidden_states': the sequence layout cannot find the activation to split or gather")


def _on_input(fn: Callable[[torch.Tensor], torch.Tensor], where: str) -> Callable[..., Any]:
    """A forward pre-hook (with kwargs) that replaces the module's input activation by ``fn`` of it."""
    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, positional = _first_input(args, kwargs, where)
        if positional:
            return (fn(x), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(x)}
    return hook


def _on_output(fn: Callable[[torch.Tensor], torch.Tensor], where: str) -> Callable[..., Any]:
    def hook(mod: nn.Module, args: tuple[Any, ...], out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"sequence parallel: module '{where}' returns {type(out).__name__}, not a tensor; the "
                            "sequence layout can only split or gather a module's tensor output")
        return fn(out)
    return hook


def apply_sequence_parallel(model: nn.Module, layout: SequenceLayout, comm: Comm,
                            keep: Callable[[str], bool] | None = None) -> list[RemovableHandle]:
    """Install the region's boundaries and the norms' gradient sums on ``model`` (already tensor-parallel).

    The layers' own part (column-parallel without ``f``, row-parallel and embedding reduce-scatters) is set
    when :func:`shardwise.parallel.tp.apply.apply_tp` builds them. ``keep(name)`` limits the hooks to this
    pipeline stage's modules; when the layout is not ``stage_safe`` and a stage holds only part of the model,
    this raises. Returns the hooks' handles.
    """
    if keep is not None and not keep("") and not layout.stage_safe:
        raise ValueError("sequence parallel: this model's sequence layout starts at the first block, whose "
                         "positions and causal mask the whole model's forward computes; the pipeline's stage "
                         "adapters would compute them from a split sequence. Use sequence_parallel with pp=1 "
                         "for this model")
    named = list(model.named_modules())

    def matching(pattern: str) -> list[tuple[str, nn.Module]]:
        rx = module_pattern(pattern)
        hits = [(n, m) for n, m in named if rx.match(n)]
        if not hits:
            raise ValueError(f"sequence parallel: layout pattern '{pattern}' matches no module of "
                             f"{type(model).__name__}")
        return [(n, m) for n, m in hits if keep is None or keep(n)]

    handles: list[RemovableHandle] = []
    for pattern in layout.scatter_inputs:
        for name, mod in matching(pattern):
            handles.append(mod.register_forward_pre_hook(
                _on_input(lambda x: scatter_to_sequence(x, comm, "tp.sp_scatter"), name), with_kwargs=True))
    for pattern in layout.scatter_outputs:
        # dim -2: a position embedding's (T, H) or (1, T, H) output, its rows are the sequence.
        for name, mod in matching(pattern):
            handles.append(mod.register_forward_hook(
                _on_output(lambda y: scatter_to_sequence(y, comm, "tp.sp_scatter", dim=-2), name)))
    for pattern in layout.gather:
        for name, mod in matching(pattern):
            handles.append(mod.register_forward_pre_hook(
                _on_input(lambda x: gather_from_sequence(x, comm, "tp.sp_gather"), name), with_kwargs=True))
    to_head = layout.exit_to_head
    for name, mod in matching(layout.exit):
        handles.append(mod.register_forward_hook(
            _on_output(lambda y: gather_from_sequence(y, comm, "tp.sp_gather", reduce_grad=to_head), name)))
    for pattern in layout.norms:
        for name, mod in matching(pattern):
            for attr, p in mod.named_parameters(recurse=False):
                if p.requires_grad:
                    handles.append(all_reduce_grad(p, comm, f"sp_grads.{name}.{attr}"))
    return handles


__all__ = ["apply_sequence_parallel", "sequence_layout"]
