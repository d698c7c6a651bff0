"""The DiLoCo pair: ``sw.DiLoCo`` (one rank per replica, a sync every H steps) against our DDP on the same ranks.

The second contender is the baseline of the table's ratio columns (there: DDP, not torch). The bytes column is
each one's counted traffic per step; the formula is DiLoCo's: 2 (N-1)/N of the model's bytes, once every H steps.
"""
from __future__ import annotations

import argparse
import functools

import torch
from rich.table import Table
from torch import nn
from torch.nn import functional as F

from shardwise.bench.harness import Contender, merged, over_runs, pair_table, run_pair, same_shape_target, summarize
from shardwise.bench.tables import wide
from shardwise.comm.topology import Topology
from shardwise.strategies.diloco import DiLoCo
from shardwise.strategies.dp.ddp import DDP
from shardwise.workloads import mlp1024

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
SYNC_EVERY = 10


def _diloco(model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    return DiLoCo("ddp", replicas=topo.world_size, sync_every=SYNC_EVERY).setup(model, ADAMW, topo)


def _ddp(model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    return DDP().setup(model, ADAMW, topo)


def diloco_pair(a: argparse.Namespace) -> Table:
    """DiLoCo (H = 10, one rank per replica) against DDP, on the 4 x Linear(1024) MLP."""
    model = mlp1024().make_model()
    n = a.nproc
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    contenders = (Contender(f"shardwise DiLoCo H={SYNC_EVERY}", _diloco), Contender("shardwise DDP", _ddp))
    runs = over_runs(getattr(a, "runs", 1), lambda: run_pair(
        contenders, model, (1024,), same_shape_target, F.mse_loss, nprocs=n, local_batch=a.batch // n, reps=a.reps,
        steps=a.steps, accelerator=a.accelerator))
    return pair_table(f"DiLoCo (H={SYNC_EVERY}, {n} replicas of one rank) against DDP (the baseline of the ratios): "
                      f"4 x Linear(1024) MLP, global batch {a.batch}, AdamW", runs, summarize(merged(runs)),
                      2 * (n - 1) / n * grad_bytes / SYNC_EVERY, "DiLoCo: 2(N-1)/N x grad bytes / H", wide(a))
