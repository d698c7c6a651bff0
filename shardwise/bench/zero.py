"""Benchmark pairs for the sharded strategies: ours against PyTorch's own, same ranks, same data.

* ``zero1``: our ZeRO-1 against ``torch.distributed.optim.ZeroRedundancyOptimizer``
  (with torch DDP for the gradients, its documented use);
* ``zero3`` and ``fsdp``: ours against FSDP2 ``torch.distributed.fsdp.fully_shard``
  applied to the same units (bottom-up, then the root), on the CPU/gloo path
  that FSDP2 supports.

Each pair runs the 4 x Linear(1024) MLP and a small GPT. Both sides use
AdamW(lr=1e-3) in fp32. Our bytes are counted; torch's are not observable.

``python -m shardwise.bench.zero bytes 2 4`` prints counted per-rank bytes of
real Trainer runs next to the ZeRO formulas; ``python -m shardwise.bench.zero
collectives`` times gloo's reduce-scatter and all-gather against the pairwise
exchange (both in docs/zero.md).
"""
from __future__ import annotations

import argparse
import functools
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn import functional as F

from shardwise.bench.harness import (
    NOT_SEEN,
    NOT_SEEN_NOTE,
    PAIRED_NOTE,
    Contender,
    PairResult,
    merged,
    over_runs,
    paired,
    ratio_text,
    run_pair,
    same_shape_target,
    spawn_collect,
    summarize,
)
from shardwise.bench.tables import Column, table, wide
from shardwise.comm.topology import Topology
from shardwise.dims import DP
from shardwise.fit.trainer import Trainer
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.parallel.dp import torch_dp
from shardwise.parallel.dp.fsdp_units import unit_modules
from shardwise.parallel.dp.sharding import all_gather, reduce_scatter
from shardwise.strategies.dp.fsdp import FSDP
from shardwise.strategies.dp.zero import ZeRO1, ZeRO2
from shardwise.strategies.registry import resolve
from shardwise.workloads import digits, mlp1024

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
GPT_CFG = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128)


class TokenGPT(nn.Module):
    """A GPT fed by the harness's float inputs: each value is turned into a token id."""

    def __init__(self, cfg: GPTConfig = GPT_CFG) -> None:
        super().__init__()
        self.gpt = GPT(cfg)
        self.vocab = cfg.vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x.abs() * 1000).long() % self.vocab
        return self.gpt(idx)  # type: ignore[no-any-return]


def _token_target(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, GPT_CFG.vocab_size, x.shape, generator=g)


# ---- contenders ---------------------------------------------------------------
def ours_zero1(model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    return ZeRO1().setup(model, ADAMW, topo)


def torch_zero1(model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    ddp = torch_dp.torch_ddp(model, topo)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                  process_group=topo.group(DP), lr=1e-3)
    return ddp, opt


def ours_sharded(strategy: str, model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Our ``strategy`` ("zero3", "fsdp") set up on ``model`` (bind the name with functools.partial)."""
    return resolve(strategy).setup(model, ADAMW, topo)


def torch_fully_shard(strategy: str, model: nn.Module, topo: Topology) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 on the same units our ``strategy`` picks, every unit resharded after forward (as ours)."""
    units = unit_modules(model, resolve(strategy).wrap)  # type: ignore[attr-defined]
    torch_dp.fully_shard_units(units, torch_dp.dp_mesh(topo), reshard_after_forward=True)
    return model, ADAMW(model.parameters())


# ---- tables -------------------------------------------------------------------
def _workloads() -> list[tuple[str, nn.Module, tuple[int, ...], Callable[..., torch.Tensor],
                               Callable[..., torch.Tensor]]]:
    torch.manual_seed(0)
    return [("MLP", mlp1024().make_model(), (1024,), same_shape_target, F.mse_loss),
            ("GPT", TokenGPT(), (GPT_CFG.block_size,), _token_target, lm_loss)]


MODELS_NOTE = (f"MLP: 4 x Linear(1024); GPT: {GPT_CFG.n_layer} x {GPT_CFG.n_embd}, T={GPT_CFG.block_size}, fed "
               "token ids made from the harness's float inputs.")
COLUMNS = (Column("model", left=True), Column("implementation", left=True), Column("median step"),
           Column("vs torch"), Column("paired vs torch"), Column("peak RSS +"), Column("RSS vs torch"),
           Column("sent/rank/step"), Column("formula", detail=True))


def zero_rows(label: str, results: list[PairResult], factor: int, grad_bytes: int) -> list[list[str]]:
    """The two rows (ours, torch's) of one workload: ratios against torch's, which is second."""
    ours, theirs = results[0].names
    res = summarize(results)
    n = len(results)
    base_t = res[theirs]["step_time_s"]
    base_m = max(1, res[theirs]["peak_rss_delta_bytes"])
    rows = []
    for name in (ours, theirs):
        s = res[name]
        sent = s["sent_per_step"]
        rows.append([label, name, f"{1e3 * s['step_time_s']:.2f} ms", f"{base_t / s['step_time_s']:.3f}x",
                     ratio_text(*paired([r.step_times for r in results], name, theirs)),
                     f"{s['peak_rss_delta_bytes'] / 2**20:.2f} MiB", f"{s['peak_rss_delta_bytes'] / base_m:.3f}x",
                     NOT_SEEN if sent is None else f"{sent:,.0f} B", f"{factor * (n - 1) / n * grad_bytes:,.0f} B"])
    return rows


def zero_table(title: str, rows: list[list[str]], factor: int, note: str, wide_: bool = False) -> Table:
    caption = (f"{MODELS_NOTE} {note} vs torch: torch's median step over this one's (above 1: faster). {PAIRED_NOTE} "
               f"{NOT_SEEN_NOTE} formula: {factor}(N-1)/N x gradient bytes.")
    return table(title, COLUMNS, rows, wide_, caption)


def _pair_rows(title: str, a: argparse.Namespace, ours: Contender, theirs: Contender, factor: int,
               note: str = "") -> Table:
    """Run the pair on both workloads; one table, two rows per workload."""
    n = a.nproc
    rows = []
    for label, model, in_shape, target, loss in _workloads():
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        res = merged(over_runs(getattr(a, "runs", 1), lambda: run_pair(
            (ours, theirs), model, in_shape, target, loss, nprocs=n, local_batch=a.batch // n, reps=a.reps,
            steps=a.steps, accelerator=a.accelerator, exact_rss=True)))
        rows += zero_rows(label, res, factor, grad_bytes)
    return zero_table(f"{title}: {n} ranks, global batch {a.batch}, AdamW fp32", rows, factor, note, wide(a))


def zero1_pair(a: argparse.Namespace) -> Table:
    """Our ZeRO-1 against torch DDP + ZeroRedundancyOptimizer."""
    return _pair_rows("ZeRO-1", a, Contender("shardwise zero1", ours_zero1),
                      Contender("torch ZeRO-1", torch_zero1, counts_bytes=False), 2,
                      "torch ZeRO-1: torch's DDP + ZeroRedundancyOptimizer.")


def zero3_pair(a: argparse.Namespace) -> Table:
    """Our ZeRO-3 (size-based units) against FSDP2 fully_shard on the same units (``--hand-built``)."""
    return _pair_rows("ZeRO-3", a, Contender("shardwise zero3", functools.partial(ours_sharded, "zero3")),
                      Contender("torch fully_shard", functools.partial(torch_fully_shard, "zero3"),
                                counts_bytes=False), 3)


def fsdp_pair(a: argparse.Namespace) -> Table:
    """Our FSDP (a unit per block/layer) against FSDP2 fully_shard on the same units (``--hand-built``)."""
    return _pair_rows("FSDP", a, Contender("shardwise fsdp", functools.partial(ours_sharded, "fsdp")),
                      Contender("torch fully_shard", functools.partial(torch_fully_shard, "fsdp"),
                                counts_bytes=False), 3)


PAIRS: dict[str, Callable[[argparse.Namespace], Table]] = {
    "zero1": zero1_pair, "zero3": zero3_pair, "fsdp": fsdp_pair}


# ---- counted bytes against the ZeRO paper's formulas ---------------------------------
def _even_mlp() -> nn.Module:
    """A digits classifier whose every parameter numel divides by 2 and 4 (no padding: formulas hold exactly)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 12))


def _formula(strategy: str, offload: str, p: int, n: int) -> tuple[int, int, int, int]:
    """(device params, device grads, device optimizer, host) bytes per rank: Rajbhandari et al. 2020, section 5."""
    stage = {"ddp": 0, "zero1": 1, "zero2": 2}.get(strategy, 3)
    params = p if stage < 3 else p // n
    grads = p if stage < 2 else p // n
    opt = 2 * p if stage == 0 else 2 * p // n  # AdamW: exp_avg and exp_avg_sq
    if offload == "none":
        return params, grads, opt, 0
    host = p // n + (grads if stage >= 2 else 0) + opt  # master row + gradient shard + states
    dev_params = 0 if offload == "all" else params
    return dev_params, (0 if stage >= 2 else grads), 0, host


def bytes_table(devices: list[int], steps: int = 3) -> Table:
    """Counted model-state bytes and bytes sent per rank (``result.stats`` of real Trainer runs), and the formulas."""
    work = digits()
    p = 4 * sum(q.numel() for q in _even_mlp().parameters())
    t = Table(title=f"Per-rank bytes, AdamW fp32, P = {p:,} B of parameters (digits MLP 64-128-64-12), "
                    f"after {steps} steps; formula / counted")
    for col in ("strategy", "N", "params", "grads", "optimizer", "host (offload)", "sent / step",
                "sent formula"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    runs: list[tuple[str, Any, str]] = [
        ("ddp", "ddp", "none"), ("zero1", "zero1", "none"), ("zero2", "zero2", "none"),
        ("zero3", "zero3", "none"), ("fsdp", "fsdp", "none"),
        ("zero2 offload=optimizer", ZeRO2(offload="optimizer"), "optimizer"),
        ("fsdp offload=all", FSDP(offload="all"), "all")]
    for n in devices:
        for label, strategy, offload in runs:
            name = strategy if isinstance(strategy, str) else strategy.name
            res = Trainer(strategy, n, accelerator="cpu", progress=False).fit(
                _even_mlp(), work.train, work.loss_fn, ADAMW, batch_size=64, max_steps=steps)
            s = max(res.stats, key=lambda d: d["model_state_bytes"])
            host = sum(v for k, v in s.items() if k.startswith("host_") and k.endswith("_bytes"))
            fp, fg, fo, fh = _formula(name, offload, p, n)
            factor = 3 if name in ("zero3", "fsdp", "hsdp") else 2
            t.add_row(label, str(n), f"{fp:,} / {s['params_bytes']:,}", f"{fg:,} / {s['grads_bytes']:,}",
                      f"{fo:,} / {s['optimizer_bytes']:,}", f"{fh:,} / {host:,}",
                      f"{s['comm_bytes_per_step']:,.0f}", f"{factor}(N-1)/N x P = {factor * (n - 1) * p // n:,}")
    return t


# ---- the collectives themselves: native against pairwise exchange -------------------
def _collectives_worker(rank: int, device: torch.device, mib: int, reps: int, path: str) -> None:
    topo = Topology.create(device)
    comm = topo.comm(DP)
    n = mib * 2**20 // 4
    full = torch.randn(n, device=device)
    piece = torch.empty(n // comm.size, device=device)
    gathered = torch.empty(n, device=device)

    def timed(fn: Callable[[], Any]) -> float:
        times = []
        for i in range(reps + 2):
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rows = {}
    for how in ("native", "p2p"):
        rows[f"reduce-scatter {how}"] = timed(lambda: reduce_scatter(comm, piece, full, "rs", how).wait())  # type: ignore[union-attr]
        rows[f"all-gather {how}"] = timed(lambda: all_gather(comm, gathered, piece, "ag", how).wait())  # type: ignore[union-attr]
    rows["all-reduce native"] = timed(lambda: comm.all_reduce(full, "ar"))
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(rows, f)


def collectives_table(nproc: int = 2, mib: int = 16, reps: int = 15) -> Table:
    """Median time of one reduce-scatter / all-gather of ``mib`` MiB, backend-native against pairwise exchange."""
    rows = spawn_collect(_collectives_worker, nproc, mib, reps)
    t = Table(title=f"{mib} MiB fp32 over {nproc} ranks, median of {reps}")
    t.add_column("operation")
    t.add_column("median", justify="right")
    for k, v in rows.items():
        t.add_row(k, f"{1e3 * v:.2f} ms")
    return t


if __name__ == "__main__":
    what, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("bytes", [])
    if what == "bytes":
        Console(width=200).print(bytes_table([int(a) for a in args] or [2, 4]))
    elif what == "collectives":
        Console(width=200).print(collectives_table(*(int(a) for a in args)))
    else:
        raise SystemExit("usage: python -m shardwise.bench.zero bytes [N ...] | collectives [nproc [MiB [reps]]]")
