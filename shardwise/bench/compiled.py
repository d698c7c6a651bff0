"""The compile pair: our GPT eager against the same GPT with every block compiled (``compile=True``).

Both contenders run in the same rank, alternating which goes first; each repetition builds a fresh copy of the
model, and the compiled one compiles its blocks in place (:func:`shardwise.parallel.compiling.compile_blocks`,
inductor). The first repetition's warm-up steps pay the compilation; later ones find dynamo's cache, so the
timed steps are steady-state steps of both.
"""
from __future__ import annotations

import argparse
import copy
import pickle

import torch
from rich.table import Table
from torch import nn

from shardwise.bench.harness import (
    PAIRED_NOTE,
    PairResult,
    alternate,
    gather_results,
    measure,
    optimizer_step,
    paired,
    ratio_text,
    spawn_collect,
)
from shardwise.comm.topology import Topology
from shardwise.models import GPT, GPTConfig, count_parameters, lm_loss
from shardwise.parallel.compiling import compile_blocks

ADAMW_LR = 1e-3
CONFIG = GPTConfig(vocab_size=128, block_size=128, n_layer=4, n_head=4, n_embd=256)


def _build(compiled: bool, base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(base)
    if compiled:
        compile_blocks(model)
    return model, torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)


def _worker(rank: int, device: torch.device, blob: bytes, path: str) -> None:
    job = pickle.loads(blob)
    topo = Topology.create(device)
    torch.manual_seed(0)
    base = GPT(CONFIG).to(device)
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randint(0, CONFIG.vocab_size, (job["batch"], CONFIG.block_size), generator=g).to(device)
    y = torch.randint(0, CONFIG.vocab_size, (job["batch"], CONFIG.block_size), generator=g).to(device)
    cuda = device.type == "cuda"

    def time_one(name: str) -> tuple[float, float, float]:
        return measure(lambda: optimizer_step(*_build(name == "compiled", base), lm_loss, x, y),
                       topo, cuda, job["warmup"], job["steps"])

    res = alternate((_Named("eager"), _Named("compiled")), job["reps"], lambda c: time_one(c.name))
    gather_results(res, topo, path)


class _Named:
    """A contender of :func:`alternate`: only its name is read."""

    counts_bytes = False

    def __init__(self, name: str) -> None:
        self.name = name


def compile_pair(a: argparse.Namespace) -> Table:
    """``shardwise bench --pairs compile``: step time of the GPT eager and compiled, one rank."""
    job = dict(batch=a.batch, reps=a.reps, warmup=3, steps=a.steps)
    res: list[PairResult] = spawn_collect(_worker, 1, pickle.dumps(job), accelerator=a.accelerator)
    return compile_table(res[0], a.batch)


def compile_table(r: PairResult, batch: int) -> Table:
    """One rank's eager and compiled repetitions: medians, and the paired speed-up (eager over compiled)."""
    eager, compiled = r.median_time("eager"), r.median_time("compiled")
    t = Table(title=f"compile: GPT {count_parameters(GPT(CONFIG)) / 1e6:.1f}M parameters ({CONFIG.n_layer} blocks of "
                    f"{CONFIG.n_embd}, sequence {CONFIG.block_size}), batch {batch}, AdamW, inductor, one rank")
    for col in ("implementation", "median step", "speed-up vs eager (paired)"):
        t.add_column(col, justify="left" if col == "implementation" else "right")
    t.add_row("eager", f"{1e3 * eager:.2f} ms", "1.000x")
    t.add_row("compiled blocks", f"{1e3 * compiled:.2f} ms", ratio_text(*paired([r.step_times], "compiled", "eager")))
    # Each repetition's medians, in order: how much the machine's load moved them (the ratio is paired).
    t.caption = "per repetition, eager / compiled: " + ", ".join(
        f"{1e3 * e:.0f}/{1e3 * c:.0f} ms" for e, c in zip(r.step_times["eager"], r.step_times["compiled"])) + \
        f". {PAIRED_NOTE}"
    return t
