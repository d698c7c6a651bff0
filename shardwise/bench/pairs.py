"""The benchmark pairs: ours against PyTorch's implementation of the same idea."""
from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Callable

import torch
from rich.table import Table
from torch import nn
from torch.nn import functional as F

from shardwise.bench.harness import Contender, run_pair, same_shape_target, summarize
from shardwise.comm.topology import Topology
from shardwise.workloads import mlp1024

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def ours_ddp(model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    from shardwise.parallel.ddp import DDPModule

    return DDPModule(model, topo.comm("dp")), ADAMW(model.parameters())


def torch_ddp(model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel

    ids = [topo.device.index] if topo.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=topo.group("dp")), ADAMW(model.parameters())


def _fmt_mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def pair_table(title: str, summary: dict, formula_bytes: float | None, formula_label: str) -> Table:
    ours, theirs = summary["names"]
    t = Table(title=title)
    for col in ("implementation", "median step", "throughput vs torch", "peak RSS increase",
                "memory vs torch", "sent / rank / step", formula_label):
        t.add_column(col, justify="left" if col == "implementation" else "right")
    base_t = summary[theirs]["step_time_s"]
    base_m = max(1, summary[theirs]["peak_rss_delta_bytes"])
    for n in (ours, theirs):
        s = summary[n]
        sent = s["sent_per_step"]
        t.add_row(n, f"{1e3 * s['step_time_s']:.2f} ms", f"{base_t / s['step_time_s']:.3f}x",
                  _fmt_mib(s["peak_rss_delta_bytes"]), f"{s['peak_rss_delta_bytes'] / base_m:.3f}x",
                  "(not observable)" if sent is None else f"{sent:,.0f} B",
                  "" if formula_bytes is None else f"{formula_bytes:,.0f} B")
    return t


def ddp_pair(a: argparse.Namespace) -> Table:
    work = mlp1024()
    model = work.make_model()
    n = a.nproc
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    res = run_pair((Contender("shardwise DDP", ours_ddp), Contender("torch DDP", torch_ddp, counts_bytes=False)),
                   model, (1024,), same_shape_target, F.mse_loss, nprocs=n, local_batch=a.batch // n,
                   reps=a.reps, steps=a.steps, accelerator=a.accelerator)
    return pair_table(f"DDP: 4 x Linear(1024) MLP, {n} ranks, global batch {a.batch}, AdamW",
                      summarize(res), 2 * (n - 1) / n * grad_bytes, "2(N-1)/N x grad bytes")


def _lazy(target: str) -> Callable[[argparse.Namespace], Table]:
    """A pair that lives in another module, imported only when asked for (they pull in pipelining, DTensor...)."""
    def run(a: argparse.Namespace) -> Table:
        mod, _, fn = target.partition(":")
        return getattr(importlib.import_module(mod), fn)(a)  # type: ignore[no-any-return]
    return run


PAIRS: dict[str, Callable[[argparse.Namespace], Table]] = {
    "ddp": ddp_pair,
    "zero1": _lazy("shardwise.bench.zero:zero1_pair"),
    "zero3": _lazy("shardwise.bench.zero:zero3_pair"),
    "fsdp": _lazy("shardwise.bench.zero:fsdp_pair"),
    "pp": _lazy("shardwise.bench.mp:pp_pair"),
    "tp": _lazy("shardwise.bench.mp:tp_pair"),
    "fsdp-tp": _lazy("shardwise.bench.compose:fsdp_tp_pair"),
    "dp-vs-ddp": _lazy("shardwise.bench.classic:dp_vs_ddp"),
    "ps-vs-ddp": _lazy("shardwise.bench.classic:ps_vs_ddp"),
    "allreduce": _lazy("shardwise.bench.classic:allreduce_algorithms"),
}
