"""The one recipe that prepares a model (and, for training, its optimizer) for a rank, in one order.

``fit`` (:class:`shardwise.fit.job.Job`), ``sw.setup`` (:mod:`shardwise.loop.prepared`) and the evaluation
passes (:mod:`shardwise.fit.infer`) each call :func:`prepare_rank` on their rank, with the options they have
(:class:`Recipe`), so the model each builds from the same options is the same. The order, and why:

1. the model's shapes and tied weights, read on the unsplit model (checkpoints and ``init_from`` name tensors
   as the unsplit model does);
2. activation checkpointing, then synchronised BatchNorm, on the unsplit model (both replace modules the
   strategy then wraps);
3. the cast (``"bf16-true"``: the weights, and so their gradients and optimizer states, in bf16);
4. compiled blocks, before the strategy's wrappers (names unchanged);
5. the strategy's setup, through the factory that regroups the optimizer
   (:class:`~shardwise.optim.param_groups.GroupedFactory`), around ``init_from``'s meta-device model
   (:func:`~shardwise.init_from.before_setup`, then :func:`~shardwise.init_from.after_setup`: memory first);
6. the optimizer's groups finished on the tensors this rank holds, named as in the unsplit model.

What comes before (the checks of the options, the topology) and after (a checkpoint resumed, pretrained
weights read) differs between the callers and stays theirs.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise import precision as precision_mod
from shardwise.checkpoint.store import model_shapes, tied_aliases
from shardwise.comm.topology import Topology
from shardwise.init_from import InitFrom, after_setup, before_setup
from shardwise.optim.param_groups import GroupedFactory, GroupPlan
from shardwise.parallel.checkpointing import apply_activation_checkpointing
from shardwise.parallel.compiling import compile_blocks
from shardwise.step import OptimizerFactory
from shardwise.strategies.base import Strategy
from shardwise.strategies.torch_engine.choice import synced_batchnorm


@dataclass(frozen=True)
class Recipe:
    """The options of :func:`prepare_rank` (each off by default: evaluation uses only the precision)."""

    precision: str = "32"
    sync_batchnorm: bool = False
    activation_checkpointing: bool | tuple[type[nn.Module], ...] = False
    compile: str | None = None  # the torch.compile backend of the blocks (strategies.base.compile_backend)
    fresh_compile: bool = False  # drop the process's compiled code first (a Trainer's rank compiles its own)
    init: InitFrom | None = None  # init_from: a meta-device model given memory around the strategy's setup


@dataclass
class Built:
    """What :func:`prepare_rank` built on this rank."""

    model: nn.Module  # the strategy's model (wrapped, sharded, split)
    optimizer: torch.optim.Optimizer
    bare: nn.Module  # the unsplit model the strategy was given (sync BatchNorm may have replaced the root)
    shapes: dict[str, list[int]]  # every tensor's full shape, by the unsplit model's names
    aliases: dict[str, str]  # tied weights: each other name -> the name the checkpoint keeps


def frozen_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """An optimizer for a pass that never steps (evaluation): the strategies build the model with one."""
    return torch.optim.SGD(params, lr=0.0)


def prepare_rank(model: nn.Module, strategy: Strategy, topo: Topology, recipe: Recipe,
                 optimizer_fn: OptimizerFactory = frozen_optimizer, groups: GroupPlan | None = None) -> Built:
    """``model`` (unsplit, on any device or on meta) prepared by ``strategy`` for this rank of ``topo``, and the
    optimizer ``optimizer_fn`` builds over what it holds, its parameter groups those of ``groups`` (decided on
    the unsplit model; None: the factory's own). The steps and their order are the module docstring's."""
    shapes, aliases = model_shapes(model), tied_aliases(model)
    model = _prepared_modules(model, strategy, topo, recipe)
    grouped = GroupedFactory(optimizer_fn, groups)
    inner, optimizer = before_setup(recipe.init, model, strategy, topo).setup(model, grouped, topo)
    after_setup(recipe.init, inner, topo, model)
    grouped.finish(strategy.param_names(inner))
    return Built(inner, optimizer, model, shapes, aliases)


def _prepared_modules(model: nn.Module, strategy: Strategy, topo: Topology, recipe: Recipe) -> nn.Module:
    """Steps 2 to 4 on the unsplit model; returns its root (which sync BatchNorm may replace)."""
    if recipe.activation_checkpointing:
        chosen = recipe.activation_checkpointing
        apply_activation_checkpointing(model, chosen if isinstance(chosen, tuple) else None)  # True: every block
    if recipe.sync_batchnorm:
        model = synced_batchnorm(model, strategy, topo)
    precision_mod.cast_model(recipe.precision, model)
    if recipe.compile is not None:
        compile_blocks(model, recipe.compile, fresh=recipe.fresh_compile)
    return model


__all__ = ["Built", "Recipe", "frozen_optimizer", "prepare_rank"]
