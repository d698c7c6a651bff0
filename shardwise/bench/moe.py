"""Benchmark pair ``moe``: expert parallelism against data parallelism, and dropless against capacity routing.

The issue's requirement (issue 26): "dropless against capacity routing on CPU,
and ep=2/4 step time against ddp". PyTorch has no expert parallelism of its
own to compare with, so the baseline is our ``Parallel(dp=N)`` (DDP), where
every rank holds every expert and routes its own tokens locally. Against it:

* ``Parallel(ep=N)``: the experts of every MoE layer split over the N ranks
  (``E / N`` each), tokens sent to their experts' ranks and back by all-to-all
  (:mod:`shardwise.parallel.ep`), dropless;
* at N = 2 also ``Parallel(ep=2, capacity_factor=cf)`` for cf = 1.0 and 1.25:
  each expert takes at most ``ceil(cf * T * k / E)`` slots of a rank's T
  tokens, the rest are dropped (counted in ``stats.counters["moe_dropped"]``).

Every contender trains the same MoE GPT from the same weights on the same global
batch (each rank its ``1/N`` of the sequences: ep is carved from the data-parallel
ranks, so tokens per rank are the same as under ddp). The contenders of one
world size run in the same spawned ranks; repetitions rotate which goes first,
and the heap is trimmed before each (:func:`shardwise.stats.release_free_heap`),
as in :mod:`shardwise.bench.cp`. Medians over a repetition's timed steps, then
over repetitions, then the slowest rank (the largest for bytes).

Columns besides the step time: the model state a rank holds (parameters,
gradients and AdamW states at the high point of a step, counted as the Trainer
counts ``stats["model_state_bytes"]``), the peak RSS increase, the bytes of the
token all-to-alls per rank per step (``ep_dispatch`` + ``ep_combine`` and their
gradients, as our ``Comm`` counts them: off-rank rows only), all bytes sent
per rank per step, and over all ranks per step the routed slots
(``moe_dispatched``, ``k`` per token per MoE layer) and those dropped. Under
ddp nothing goes through the dispatcher, so nothing is counted there.
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import pickle
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.table import Table
from torch import nn

from shardwise.bench.compose import local_batch
from shardwise.bench.harness import spawn_collect, timed_steps
from shardwise.bench.tables import Column, table, wide
from shardwise.comm.topology import Topology
from shardwise.dims import EP, WORLD
from shardwise.fit.steps import count_state
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.stats import current_rss_bytes, peak_rss_bytes, release_free_heap, reset_peak_rss
from shardwise.strategies.parallel import Parallel

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
# 8 experts, top-2, each expert the width of a dense MLP (2 x n_embd): the experts are ~90% of the parameters, so
# splitting them shows in the state per rank. Measured on 2 loaded cores: 70-310 ms a step, the pair 68-161 s.
CFG = GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128, n_experts=8, top_k=2,
                moe_intermediate=256, aux_loss_coef=0.01)
SEQUENCES = 8  # the global batch, in sequences of CFG.block_size tokens: 1024 tokens, divides over 2 and 4 ranks
WORLDS = (2, 4)  # ep=2 at 2 processes, ep=4 at 4 (each against ddp at the same count)
CAPACITIES = (1.0, 1.25)  # capacity factors compared with dropless at ep=2
TOKEN_EXCHANGES = ("ep_dispatch", "ep_combine", "ep_dispatch_grad", "ep_combine_grad")
Step = Callable[[], None]


@dataclass(frozen=True)
class MoEContender:
    """One way to train on N ranks: ``ep`` 1 is ddp (every expert on every rank); ``capacity_factor`` None is
    dropless."""

    ep: int
    capacity_factor: float | None = None

    @property
    def key(self) -> str:
        if self.ep == 1:
            return "ddp"
        return f"{EP}{self.ep}" + ("" if self.capacity_factor is None else f"-cf{self.capacity_factor:g}")

    @property
    def label(self) -> str:
        if self.ep == 1:
            return "dp=N (DDP)"
        cf = "dropless" if self.capacity_factor is None else f"cf={self.capacity_factor:g}"
        return f"ep={self.ep}, {cf}"

    def strategy(self, n: int) -> Parallel:
        return Parallel(dp=n, ep=self.ep, capacity_factor=self.capacity_factor)


def contenders_for(n: int, capacities: tuple[float, ...] = CAPACITIES) -> tuple[MoEContender, ...]:
    """ddp and dropless ep=N; at N = 2 (the issue's capacity comparison) also the capacity factors."""
    extra = tuple(MoEContender(n, cf) for cf in capacities) if n == 2 else ()
    return (MoEContender(1), MoEContender(n), *extra)


def gpt(cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


@dataclass
class Sample:
    """One contender's repetition on one rank."""

    step_time_s: float              # median over the timed steps
    rss: int                        # peak RSS increase over the RSS before the build
    sent: float                     # bytes sent per step, all groups
    by_name: dict[str, float]       # bytes sent per step by operation name (ep_dispatch, ddp, ...)
    counters: dict[str, float]      # per step: moe_dispatched, moe_dropped (this rank's tokens)
    state_bytes: int | None         # model state at a step's high point (counted in the first repetition only)


def _per_step(after: dict[str, int], before: dict[str, int], steps: int) -> dict[str, float]:
    return {k: (v - before.get(k, 0)) / steps for k, v in after.items() if v != before.get(k, 0)}


def measure_one(c: MoEContender, model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, warmup: int,
                steps: int, count_states: bool) -> Sample:
    """Build ``c`` from a copy of ``model``, run ``warmup`` untimed and ``steps`` timed steps on ``(x, y)``.

    Bytes and counters are taken over the timed steps only (the warm-up steps route other tokens' worth of
    slots: the weights move). The model state is counted after the timing, in one more step, at its high point
    (after ``opt.step``, before the gradients are freed), where ``Trainer.fit`` counts it.
    """
    gc.collect()
    release_free_heap()  # what the previous contender freed must not lower this one's RSS increase
    reset_peak_rss()
    before = current_rss_bytes()
    strat = c.strategy(topo.world_size)
    pm, opt = strat.setup(copy.deepcopy(model), ADAMW, topo)

    def step() -> None:
        strat.train_step(pm, [(x, y)], lm_loss, topo)
        opt.step()
        opt.zero_grad(set_to_none=True)

    barrier = topo.comm(WORLD).barrier
    cuda = x.device.type == "cuda"
    timed_steps(step, warmup, barrier, cuda)
    s0 = topo.stats.snapshot()
    times = timed_steps(step, steps, barrier, cuda)
    s1 = topo.stats.snapshot()
    mem = peak_rss_bytes() - before
    state = None
    if count_states:
        strat.train_step(pm, [(x, y)], lm_loss, topo)
        opt.step()
        state = sum(count_state(strat, pm, opt).values())
        opt.zero_grad(set_to_none=True)
    # The model, optimizer and step closure go with this frame; the next contender's gc.collect + trim frees them.
    return Sample(statistics.median(times), mem, (s1["sent"] - s0["sent"]) / steps,
                  _per_step(s1["by_name"], s0["by_name"], steps), _per_step(s1["counters"], s0["counters"], steps),
                  state)


def _worker(rank: int, device: torch.device, blob: bytes, path: str) -> None:
    job = pickle.loads(blob)
    n = torch.distributed.get_world_size()
    contenders: tuple[MoEContender, ...] = job["contenders"]
    # One topology per ep size: the ep/edp groups come from the topology's dims, not from Parallel(ep=...).
    topos = {ep: Topology.create(device, dp=n, ep=ep) for ep in sorted({c.ep for c in contenders})}
    model: GPT = job["model"]
    # ep is carved from dp: under every contender, rank r holds the same 1/N of the sequences.
    x, y = local_batch(topos[1] if 1 in topos else next(iter(topos.values())), job["sequences"], model.cfg)
    out: dict[str, dict[str, Any]] = {c.key: {"samples": [], "tokens": x.numel()} for c in contenders}
    for rep in range(job["reps"]):  # rotate which contender goes first
        k = rep % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            sample = measure_one(c, model, topos[c.ep], x, y, job["warmup"], job["steps"], count_states=rep == 0)
            out[c.key]["samples"].append(asdict(sample))  # the gather below sends JSON: plain dicts
    everyone = topos[min(topos)].comm(WORLD).all_gather_object(out, name="bench.gather")
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(everyone, f)
    for topo in topos.values():
        topo.close()


def run_moe(model: GPT, nproc: int, sequences: int = SEQUENCES, reps: int = 5, warmup: int = 2, steps: int = 5,
            accelerator: str = "cpu",
            contenders: tuple[MoEContender, ...] | None = None) -> list[dict[str, dict[str, Any]]]:
    """Every contender (default :func:`contenders_for`) on ``nproc`` ranks over a global batch of ``sequences``
    sequences; per rank, per contender key: ``samples`` (each repetition's :class:`Sample`, as a dict: read them
    with :func:`samples`) and ``tokens`` (the tokens the rank holds)."""
    if sequences % nproc:
        raise SystemExit(f"moe: the global batch of {sequences} sequences must divide over {nproc} ranks")
    if model.cfg.n_experts % nproc:
        raise SystemExit(f"moe: {model.cfg.n_experts} experts do not split over ep={nproc}")
    job = {"model": model, "sequences": sequences, "reps": reps, "warmup": warmup, "steps": steps,
           "contenders": contenders or contenders_for(nproc)}
    out: list[dict[str, dict[str, Any]]] = spawn_collect(_worker, nproc, pickle.dumps(job), accelerator=accelerator)
    return out


# ---- the table -----------------------------------------------------------------------------------
def samples(rank: dict[str, dict[str, Any]], key: str) -> list[Sample]:
    """One rank's repetitions of contender ``key`` from :func:`run_moe`'s result."""
    return [Sample(**d) for d in rank[key]["samples"]]


def token_exchange_bytes(s: Sample) -> float:
    """Bytes of the token all-to-alls (dispatch, combine, their gradients) one rank sent per step."""
    return sum(s.by_name.get(k, 0.0) for k in TOKEN_EXCHANGES)


def summarize(results: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per contender: medians over repetitions, then the slowest rank (time) or the largest (bytes); the routed
    and dropped slots summed over the ranks (every rank routes its own tokens)."""
    out: dict[str, dict[str, Any]] = {}

    def med(r: dict[str, dict[str, Any]], key: str, f: Callable[[Sample], float]) -> float:
        return statistics.median(f(s) for s in samples(r, key))

    for key in results[0]:
        out[key] = {
            "step_time_s": max(med(r, key, lambda s: s.step_time_s) for r in results),
            "rss": max(med(r, key, lambda s: s.rss) for r in results),
            "sent": max(med(r, key, lambda s: s.sent) for r in results),
            "a2a": max(med(r, key, token_exchange_bytes) for r in results),
            "state": max(samples(r, key)[0].state_bytes or 0 for r in results),
            "dispatched": sum(med(r, key, lambda s: s.counters.get("moe_dispatched", 0.0)) for r in results),
            "dropped": sum(med(r, key, lambda s: s.counters.get("moe_dropped", 0.0)) for r in results),
            "tokens": sum(r[key]["tokens"] for r in results),
        }
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def moe_table(summaries: dict[int, dict[str, dict[str, Any]]], cfg: GPTConfig, sequences: int,
              wide_: bool = False) -> Table:
    """One row per (world size, contender); ratios against ddp at the same world size, and against dropless ep."""
    title = (f"Mixture of experts: GPT {cfg.n_layer} x {cfg.n_embd} ({cfg.n_head} heads, vocab {cfg.vocab_size}, "
             f"S={cfg.block_size}), {cfg.n_experts} experts top-{cfg.top_k} (expert width {cfg.moe_intermediate}, "
             f"aux loss {cfg.aux_loss_coef:g}), global batch {sequences} sequences ({sequences * cfg.block_size} "
             f"tokens), AdamW fp32. Baseline: Parallel(dp=N) (DDP, every expert on every rank); PyTorch has no "
             f"expert parallelism to compare with")
    caption = ("model state: parameters + gradients + AdamW states one rank holds after opt.step (as "
               "stats['model_state_bytes']). a2a: ep_dispatch + ep_combine + their gradients, off-rank rows only, "
               "the largest rank. routed / dropped: slots (k per token per MoE layer), all ranks, per step. "
               "Times: medians over steps and repetitions, the slowest rank. ep=E: Parallel(ep=E); cf: its "
               "capacity_factor. --wide: every column.")
    rows = []
    for n, summary in summaries.items():
        base = summary["ddp"]
        dropless = summary.get(f"{EP}{n}")
        for key, s in summary.items():
            c = contender_of(key)
            st = s["step_time_s"]
            is_ep = c.ep > 1
            rows.append([str(n), c.label.replace("dp=N", f"dp={n}"), f"{1e3 * st:.2f} ms",
                         f"{base['step_time_s'] / st:.3f}x",
                         f"{dropless['step_time_s'] / st:.3f}x" if is_ep and dropless is not None else "",
                         _mib(s["state"]), f"{s['state'] / max(1, base['state']):.3f}x", _mib(s["rss"]),
                         f"{s['a2a']:,.0f} B", f"{s['sent']:,.0f} B",
                         f"{s['dispatched']:,.0f}" if is_ep else "(not counted)",
                         f"{s['dropped']:,.1f}" if is_ep else "",
                         f"{s['dropped'] / s['dispatched']:.2%}" if is_ep and s["dispatched"] else ""])
    return table(title, COLUMNS, rows, wide_, caption)


COLUMNS = (Column("ranks"), Column("layout", left=True), Column("median step"), Column("vs ddp"),
           Column("vs dropless"), Column("state / rank"), Column("state vs ddp", detail=True),
           Column("peak RSS +", detail=True), Column("a2a/rank/step"), Column("sent/rank/step", detail=True),
           Column("routed / step", detail=True), Column("dropped / step", detail=True), Column("dropped share"))


def contender_of(key: str) -> MoEContender:
    """The contender whose :attr:`MoEContender.key` is ``key`` (the gathered results are keyed by it)."""
    if key == "ddp":
        return MoEContender(1)
    ep, _, cf = key.removeprefix(EP).partition("-cf")
    return MoEContender(int(ep), float(cf) if cf else None)


def moe_pair(a: argparse.Namespace) -> Table:
    """``shardwise bench --pairs moe``: runs at 2 and at 4 ranks whatever ``--nproc`` says (the issue asks for
    ep=2 and ep=4); the global batch is :data:`SEQUENCES` sequences (``--batch`` counts the other pairs' short
    samples and is not used here)."""
    model = gpt()
    summaries = {n: summarize(run_moe(model, n, SEQUENCES, a.reps, steps=a.steps, accelerator=a.accelerator))
                 for n in WORLDS}
    return moe_table(summaries, CFG, SEQUENCES, wide(a))


__all__ = ["CAPACITIES", "CFG", "SEQUENCES", "TOKEN_EXCHANGES", "WORLDS", "MoEContender", "Sample", "contender_of",
           "contenders_for", "gpt", "measure_one", "moe_pair", "moe_table", "run_moe", "samples", "summarize",
           "token_exchange_bytes"]
