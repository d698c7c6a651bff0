"""Benchmark pair ``fsdp-tp``: our ``Parallel(dp=2, tp=2, zero=3)`` against PyTorch's FSDP2 + DTensor TP.

Theirs is the torchtitan recipe on a 2-D DeviceMesh ``("dp", "tp")``:
``parallelize_module`` with the same column/row split as our ``gpt_plan``
first (the attention modules told their per-rank head count), then
``fully_shard`` on every block over the dp sub-mesh, then on the root. Both
sides get the same GPT weights and the same global batch of token ids, sharded
over dp (every tp rank of a replica reads the same shard). The timing loop,
alternation, medians and heap trimming are those of
:mod:`shardwise.bench.harness` / :mod:`shardwise.bench.pp.mp`.
"""
from __future__ import annotations

import argparse
import functools
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import parallel as dtensor_tp

from shardwise.bench.harness import (
    PairResult,
    alternate,
    gather_results,
    merged,
    over_runs,
    pair_table,
    spawn_collect,
)
from shardwise.bench.pp.mp import StepContender, _summary_worst, _time
from shardwise.bench.tables import wide
from shardwise.comm.topology import Topology
from shardwise.dims import DP, TP
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.strategies.base import Strategy
from shardwise.strategies.parallel import Parallel

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
CFG = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=128)
ZERO = 3  # ZeRO stage over dp on our side: 3 = FSDP units (Parallel(zero=3))
LossStep = Callable[[], torch.Tensor]  # one optimizer step; returns this rank's loss


def gpt(cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def strategy_step(strat: Strategy, model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor) -> LossStep:
    """One optimizer step of ``strat`` on this rank's ``(x, y)``, driven as the Trainer's loop drives it."""
    pm, opt = strat.setup(model, ADAMW, topo)

    def step() -> torch.Tensor:
        loss = strat.train_step(pm, [(x, y)], lm_loss, topo)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss  # type: ignore[return-value]
    return step


def ours_fsdp_tp(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int = 1) -> LossStep:
    return strategy_step(Parallel(dp=topo.size(DP), tp=topo.size(TP), zero=ZERO), model, topo, x, y)


def torch_fsdp_tp(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int = 1) -> LossStep:
    mesh = topo.mesh[DP, TP]  # type: ignore[index]
    tp = mesh[TP].size()
    model = model.to(topo.device)
    # gpt_plan's split without sequence parallelism: vocabulary-parallel embedding, logits gathered.
    dtensor_tp.parallelize_module(model, mesh[TP], {
        "tok_emb": dtensor_tp.RowwiseParallel(input_layouts=Replicate()),
        "head": dtensor_tp.ColwiseParallel(output_layouts=Replicate())})
    for block in model.blocks:  # type: ignore[union-attr]
        dtensor_tp.parallelize_module(block, mesh[TP], {
            "attn.q": dtensor_tp.ColwiseParallel(), "attn.k": dtensor_tp.ColwiseParallel(),
            "attn.v": dtensor_tp.ColwiseParallel(), "attn.proj": dtensor_tp.RowwiseParallel(),
            "mlp.fc1": dtensor_tp.ColwiseParallel(), "mlp.fc2": dtensor_tp.RowwiseParallel()})
        block.attn.n_head //= tp  # local heads, as torchtitan adjusts n_heads
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh[DP], reshard_after_forward=True)
    fully_shard(model, mesh=mesh[DP], reshard_after_forward=True)
    opt = ADAMW(model.parameters())
    # The root returns the gathered logits as a view; lm_loss only reshapes them (no in-place op to lose a hook).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    def step() -> torch.Tensor:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def local_batch(topo: Topology, batch: int, cfg: GPTConfig = CFG,
                seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's dp shard of one global batch of ``batch`` random token sequences (inputs, next tokens)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    n, r = topo.size(DP), topo.coord(DP)
    mine = tokens.chunk(n)[r]
    return mine[:, :-1].to(topo.device), mine[:, 1:].to(topo.device)


def _worker(rank: int, device: torch.device, blob: bytes, path: str) -> None:
    job = pickle.loads(blob)
    topo = Topology.create(device, dp=job[DP], tp=job[TP])
    x, y = local_batch(topo, job["batch"], job["model"].cfg)
    res = alternate(job["contenders"], job["reps"], lambda c: _time(
        c, job["model"], topo, x, y, 1, job["warmup"], job["steps"]))
    gather_results(res, topo, path)


def run_fsdp_tp(model: GPT, dp: int, tp: int, batch: int, reps: int = 5, warmup: int = 3, steps: int = 10,
                accelerator: str = "cpu") -> list[PairResult]:
    contenders = (
        StepContender("shardwise Parallel", ours_fsdp_tp),  # type: ignore[arg-type]
        StepContender("torch fully_shard + TP", torch_fsdp_tp, counts_bytes=False),  # type: ignore[arg-type]
    )
    job = dict(contenders=contenders, model=model, dp=dp, tp=tp, batch=batch, reps=reps, warmup=warmup, steps=steps)
    out: list[PairResult] = spawn_collect(_worker, dp * tp, pickle.dumps(job), accelerator=accelerator)
    return out


def expected_sent(model: nn.Module, dp: int, tp: int, batch: int, zero: int = ZERO) -> float:
    """Our bytes per rank per step: tp all-reduces of (B/dp, T, D) activations (per block 2 forward and
    2 backward, q/k/v sharing one ``f``; the embedding's forward and the head's backward), the logits'
    all-gather, and ZeRO over dp on the local parameters (2 x (N-1)/N for stages 1-2, 3 x for stage 3)."""
    cfg: GPTConfig = model.cfg  # type: ignore[assignment]
    rows = batch // dp * cfg.block_size
    tp_bytes = (4 * cfg.n_layer + 2) * 2 * (tp - 1) / tp * rows * cfg.n_embd * 4 \
        + (tp - 1) / tp * rows * cfg.vocab_size * 4
    replicated = ("ln", "pos_emb", "proj.bias", "fc2.bias")  # what gpt_plan leaves whole on every tp rank
    local = sum(p.numel() // (1 if any(r in n for r in replicated) else tp) for n, p in model.named_parameters())
    return tp_bytes + (3 if zero == 3 else 2) * (dp - 1) / dp * local * 4


def fsdp_tp_pair(a: argparse.Namespace) -> Table:
    tp = 2
    if a.nproc % tp or a.batch % (a.nproc // tp):
        raise SystemExit(f"fsdp-tp: --nproc {a.nproc} must be a multiple of tp={tp}, and --batch a multiple of dp")
    dp = a.nproc // tp
    model = gpt()
    runs = over_runs(getattr(a, "runs", 1), lambda: run_fsdp_tp(model, dp, tp, a.batch, a.reps, steps=a.steps,
                                                                accelerator=a.accelerator))
    title = (f"FSDP x TP: GPT {CFG.n_layer} x {CFG.n_embd} ({CFG.n_head} heads, vocab {CFG.vocab_size}, "
             f"T={CFG.block_size}), dp={dp} x tp={tp}, global batch {a.batch}, AdamW")
    return pair_table(title, runs, _summary_worst(merged(runs)), expected_sent(model, dp, tp, a.batch),
                      f"TP + ZeRO-{ZERO} formula", wide(a))


def _losses_worker(rank: int, device: torch.device, cfg: GPTConfig, steps: int, batch: int, path: str) -> None:
    topo = Topology.create(device, dp=2, tp=2)
    x, y = local_batch(topo, batch, cfg)
    out: dict[str, Any] = {}
    for name, build in (("ours", ours_fsdp_tp), ("torch", torch_fsdp_tp)):
        step = build(gpt(cfg), topo, x, y)
        out[name] = [float(step()) for _ in range(steps - 1)]
        sent0 = topo.stats.sent
        out[name].append(float(step()))
        out[name + "_sent"] = topo.stats.sent - sent0  # torch's traffic bypasses our Comm: 0
    everyone = topo.comm("world").all_gather_object(out, name="bench.losses")
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(everyone, f)


def compare_losses(cfg: GPTConfig = CFG, steps: int = 3, batch: int = 8) -> list[dict[str, Any]]:
    """Per rank, both sides' losses over ``steps`` steps from the same weights and data (dp=2 x tp=2),
    and the bytes our side sent in its last step."""
    return spawn_collect(_losses_worker, 4, cfg, steps, batch)  # type: ignore[no-any-return]


__all__ = ["CFG", "compare_losses", "expected_sent", "fsdp_tp_pair", "gpt", "local_batch", "ours_fsdp_tp",
           "run_fsdp_tp", "torch_fsdp_tp"]
