"""Benchmark pair ``zb``, V half: our ZBV and DualPipeV against torch's ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``.

The same harness as :mod:`shardwise.bench.pp.zb` (same spawned ranks, rotation of which contender goes first,
medians, an untimed step from the same weights for the loss and gradients), with two model chunks per rank
placed in a V: the model is cut into ``2p`` virtual stages (:func:`~shardwise.parallel.pp.build.stage_starts`,
the same cut for all), and rank ``r`` keeps stages ``r`` and ``2p-1-r`` (torch: two ``PipelineStage`` objects
with those indices; ours: :func:`~shardwise.parallel.pp.build.build_pipeline` with ``shape="v"``). The loss is
computed on rank 0, which holds the last stage. torch's action lists (its schedule IR: an overlapped F&B pair
is its F then its full backward, a full backward our B then its W) are compared with ours in the caption.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV, ScheduleZBVZeroBubble
from torch.nn import functional as F

from shardwise.bench.harness import NOT_SEEN, NOT_SEEN_NOTE
from shardwise.bench.pp.mp import mlp
from shardwise.bench.pp.zb import (
    ADAMW,
    CPU_NOTE,
    DEPTH,
    MICROBATCHES,
    PAIRED_NOTE,
    WIDTH,
    Built,
    Order,
    RankResult,
    ZBContender,
    loss_gap,
    our_pipeline,
    paired_text,
    run_zb,
    summarize,
    zb_pair,
)
from shardwise.bench.tables import Column, table, wide
from shardwise.comm.topology import Topology
from shardwise.dims import PP
from shardwise.parallel.pp.build import stage_starts
from shardwise.parallel.pp.layers import pipeline_layers
from shardwise.parallel.pp.placement import Placement, V
from shardwise.parallel.pp.schedules import Action, bubble_fraction, get_schedule
from shardwise.parallel.pp.timeline import replay

ZBV, DPV, TORCH_ZBV, TORCH_DPV = "zbv", "dualpipev", "torch-zbv", "torch-dualpipev"


def v_order(schedule: str, p: int, m: int) -> Order:
    """Our actions per rank, ``F3.1``: kind, micro-batch, chunk (0: virtual stage r, 1: 2p-1-r); ``BW3.1`` a whole
    backward (one autograd pass; the ``W3.1`` after it computes nothing)."""
    return [" ".join(f"{a.kind}{'W' if a.whole else ''}{a.mb}.{a.chunk}" for a in get_schedule(schedule)(p, m, s, 2))
            for s in range(p)]


def ours_zbv(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Built:
    return our_pipeline(ZBV, model, topo, x, y, m, chunks=2, shape=V, order=v_order)


def ours_dualpipev(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Built:
    return our_pipeline(DPV, model, topo, x, y, m, chunks=2, shape=V, order=v_order)


def _torch_v(cls: type, model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Built:
    """torch's V schedule over this rank's two stages: the same layers ours keeps, in the same order."""
    p, r = topo.size(PP), topo.coord(PP)
    layers = pipeline_layers(model)
    starts = stage_starts(layers, 2 * p) + [len(layers)]
    subs, stages = [], []
    for k in (r, 2 * p - 1 - r):
        sub = nn.Sequential(*[mod for _, mod in layers[starts[k]:starts[k + 1]]]).to(topo.device)
        subs.append(sub)
        stages.append(PipelineStage(sub, k, 2 * p, topo.device, input_args=(x.chunk(m)[0],), group=topo.group(PP)))
    sched = cls(stages, n_microbatches=m, loss_fn=F.mse_loss)
    params = [q for sub in subs for q in sub.parameters()]

    def run() -> torch.Tensor | None:
        if r == 0:  # the first and the last stage: the input goes in and the loss comes out here
            losses: list[torch.Tensor] = []
            sched.step(x, target=y, losses=losses)
            return torch.stack([t.detach() for t in losses]).mean()
        sched.step()
        return None
    return Built(run, ADAMW(params), params, torch_v_order(sched.pipeline_order, p))


def torch_zbv(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Built:
    return _torch_v(ScheduleZBVZeroBubble, model, topo, x, y, m)


def torch_dualpipev(model: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, m: int) -> Built:
    return _torch_v(ScheduleDualPipeV, model, topo, x, y, m)


def split_order(order: Order) -> Order:
    """The order with every whole backward written as a split one (``BW3.1`` as ``B3.1``): the actions alone."""
    return [o.replace("BW", "B") for o in order]


def torch_v_order(pipeline_order: dict[int, list[Any]], p: int) -> Order:
    """torch's compute IR in :func:`v_order`'s notation: stage r is chunk 0, an overlapped pair its two
    sub-actions, a full backward (``B``) our whole B then its W, a backward-input (``I``) our B."""
    out = []
    for r in sorted(pipeline_order):
        acts: list[str] = []
        for a in pipeline_order[r]:
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                kind, mb, c = sub.computation_type.value, sub.microbatch_index, int(sub.stage_index != r)
                if kind == "B":
                    acts += [f"BW{mb}.{c}", f"W{mb}.{c}"]
                elif kind in ("F", "I", "W"):
                    acts.append(f"{'B' if kind == 'I' else kind}{mb}.{c}")
        out.append(" ".join(acts))
    return out


# torch ZBV: ScheduleZBVZeroBubble; torch DualPipeV: ScheduleDualPipeV (short names: the table's first column).
V_CONTENDERS = (ZBContender("shardwise ZBV", ZBV, ours_zbv),
                ZBContender("torch ZBV", TORCH_ZBV, torch_zbv, counts_bytes=False),
                ZBContender("shardwise DualPipeV", DPV, ours_dualpipev),
                ZBContender("torch DualPipeV", TORCH_DPV, torch_dualpipev, counts_bytes=False))


def expected_sent_v(rank: int, p: int, batch_size: int, width: int, elem: int = 4) -> int:
    """Bytes one rank sends per step under the V: down the V, chunk 0's activations to rank r+1 and its input
    gradient to r-1; back up, chunk 1's activations to r-1 and its input gradient to r+1; the turn (rank p-1)
    and both ends (rank 0) send nothing."""
    return 2 * ((rank < p - 1) + (rank > 0)) * batch_size * width * elem


def simulated_bubble_v(order: Order, p: int) -> float:
    """The order's idle share on the model clock, V placement, F = B = W = 1 per chunk."""
    plans = [[Action(a[0], int(a.lstrip("FBW").split(".")[0]), int(a.split(".")[1]), whole=a.startswith("BW"))
              for a in acts.split()] for acts in order]
    return bubble_fraction(replay(plans, Placement(p, 2, V), t_f=1.0, t_b=2.0, t_w=1.0))


def zbv_table(results: list[RankResult], p: int, m: int, batch_size: int, width: int, depth: int,
              elem: int = 4, wide_: bool = False) -> Table:
    s = summarize(results)
    names = {c.key: c.name for c in V_CONTENDERS}
    counts = {c.key: c.counts_bytes for c in V_CONTENDERS}
    formula = max(expected_sent_v(r, p, batch_size, width, elem) for r in range(p))
    # The same actions in the same order; which backwards run whole (BW) is counted apart.
    same = {k: split_order(s[k]["order"]) == split_order(s[f"torch-{k}"]["order"]) for k in (ZBV, DPV)}
    whole = {k: sum(o.count("BW") for o in s[k]["order"]) for k in s}
    gaps = {k: loss_gap(results, k, ZBV, loss_rank=0) for k in (TORCH_ZBV, DPV, TORCH_DPV)}
    caption = ("Two chunks per rank in a V (rank r: virtual stages r and 2p-1-r; torch: two PipelineStages). torch "
               "ZBV: ScheduleZBVZeroBubble; torch DualPipeV: ScheduleDualPipeV. "
               f"torch ZBV runs {'the same' if same[ZBV] else 'NOT the same'} actions as ours zbv, torch "
               f"DualPipeV {'the same' if same[DPV] else 'NOT the same'} as ours dualpipev (its overlapped F&B "
               "pairs as F then the full backward in one autograd pass, ours too). Whole backwards, all ranks: "
               f"ours ZBV {whole[ZBV]}, torch's {whole[TORCH_ZBV]}; ours DualPipeV {whole[DPV]}, torch's "
               f"{whole[TORCH_DPV]} (ours also where nobody waits for the input gradient during W). First step "
               "from the same weights, against ours ZBV: "
               + ", ".join(f"{names[k]} |loss| {dl:.3g}, |grad| {dg:.3g}" for k, (dl, dg) in gaps.items())
               + f". Formula: 2 x ((r < p-1) + (r > 0)) x batch x width x {elem} B, the worst rank. Peak "
               "tensors and RSS as in the table above. Simulated bubble: F = B = W = 1 per chunk, (p-1)/(6m+p-1) "
               f"for both when m >= 2p. {CPU_NOTE} {PAIRED_NOTE} {NOT_SEEN_NOTE} --wide: every column.")
    title = (f"Zero bubble, V: {depth} x Linear({width}) MLP, {p} ranks x 2 chunks, {m} micro-batches, "
             f"batch {batch_size}, AdamW")
    rows = []
    for key, v in s.items():
        st, mem, rss = v["step_time_s"], v["alloc"], v["rss"]
        torch_key = key if key.startswith("torch-") else f"torch-{key}"
        rows.append([names[key], f"{simulated_bubble_v(v['order'], p):.4f}", f"{1e3 * st:.2f} ms",
                     f"{s[torch_key]['step_time_s'] / st:.3f}x", paired_text(results, key, torch_key),
                     f"{1e3 * v['cpu_s']:.1f} ms", f"{v['cpu_s'] / s[torch_key]['cpu_s']:.3f}x",
                     f"{mem / 2**20:.2f} MiB", f"{mem / max(1, s[torch_key]['alloc']):.3f}x", f"{rss / 2**20:.2f} MiB",
                     f"{rss / max(1, s[torch_key]['rss']):.3f}x",
                     " / ".join(f"{b / 1024:,.0f}" for b in v["saved"]) + " KiB",
                     f"{v['sent']:,.0f} B" if counts[key] else NOT_SEEN, f"{formula:,} B"])
    return table(title, ZBV_COLUMNS, rows, wide_, caption)


# As the ZB-H1 table's (:data:`~shardwise.bench.pp.zb.ZB_COLUMNS`), each row against torch's same schedule.
ZBV_COLUMNS = (Column("implementation", left=True), Column("sim. bubble", detail=True), Column("median step"),
               Column("vs torch"), Column("paired vs torch"), Column("CPU / step", detail=True),
               Column("CPU vs torch", detail=True), Column("peak tensors"), Column("mem. vs torch"),
               Column("peak RSS +", detail=True), Column("RSS vs torch", detail=True),
               Column("saved act. / rank", detail=True), Column("sent/rank/step", detail=True),
               Column("formula", detail=True))


def zbv_pair(a: argparse.Namespace) -> Table:
    """``shardwise bench --pairs zb`` (V half): ``--nproc`` ranks x 2 chunks, :data:`MICROBATCHES` micro-batches."""
    res = run_zb(mlp(WIDTH, DEPTH), a.nproc, a.batch, MICROBATCHES, a.reps, steps=a.steps, accelerator=a.accelerator,
                 contenders=V_CONTENDERS)
    return zbv_table(res, a.nproc, MICROBATCHES, a.batch, WIDTH, DEPTH, wide_=wide(a))


def zb_pairs(a: argparse.Namespace) -> Table:
    """``shardwise bench --pairs zb``: the ZB-H1 table (:func:`shardwise.bench.pp.zb.zb_pair`), then the V one."""
    both = Table.grid(padding=(1, 0))
    both.add_row(zb_pair(a))
    both.add_row(zbv_pair(a))
    return both


__all__ = ["DPV", "TORCH_DPV", "TORCH_ZBV", "V_CONTENDERS", "ZBV", "expected_sent_v", "ours_dualpipev", "ours_zbv",
           "simulated_bubble_v", "split_order", "torch_dualpipev", "torch_v_order", "torch_zbv", "v_order", "zb_pairs",
           "zbv_pair", "zbv_table"]
