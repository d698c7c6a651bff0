"""Every table ``shardwise bench`` prints fits a 120-column terminal by default (the details behind ``--wide``):
each kind rendered from realistic results (the widest names, the largest figures the recorded runs printed),
with its exact default headers."""
from __future__ import annotations

import argparse

import pytest

from shardwise.bench import classic, cp, moe
from shardwise.bench.compiled import compile_table
from shardwise.bench.engines import GPT_, MLP, SWITCHES, switch_table
from shardwise.bench.harness import PairResult, merged, pair_table, summarize
from shardwise.bench.pp import zb, zbv
from shardwise.bench.tables import WIDTH, rendered_width, table
from shardwise.bench.zero import zero_rows, zero_table

pytestmark = pytest.mark.timeout(30)

PAIR = ["implementation", "median step", "vs torch", "paired vs torch", "peak RSS +", "RSS vs torch",
        "sent/rank/step"]


def pair_results(names: tuple[str, str], ranks: int = 4, reps: int = 5, sent: float = 23_803_904.0
                 ) -> list[PairResult]:
    """Per rank, ``reps`` step times around a second (ours 0.9x torch's), RSS increases around 100 MiB."""
    return [PairResult(names, {names[0]: [1.2345 - 0.01 * i for i in range(reps)], names[1]: [1.3456] * reps},
                       {names[0]: [105_000_000] * reps, names[1]: [109_000_000] * reps},
                       {names[0]: sent, names[1]: None}) for _ in range(ranks)]


def headers(t) -> list[str]:
    return [c.header for c in t.columns]


def check(t, expected: list[str]) -> None:
    assert headers(t) == expected
    assert rendered_width(t) <= WIDTH, (t.title, rendered_width(t))


def test_pair_and_engine_switch_tables_fit():
    for names in (("shardwise Parallel", "torch fully_shard + TP"), ("shardwise 1F1B", "torch Schedule1F1B")):
        runs = [pair_results(names) for _ in range(5)]
        t = pair_table("a title as long as the fsdp-tp pair's " * 4, runs, summarize(merged(runs)), 23_803_904,
                       "TP + ZeRO-3 formula")
        check(t, PAIR)
        assert "5 runs (launches), each run's paired ratio: 1.108x, 1.108x" in t.caption
        assert headers(pair_table("t", runs, summarize(merged(runs)), 1.0, "f", wide=True)) == PAIR + ["formula"]
    for name, sw in SWITCHES.items():  # every switch, fsdp-tp's title naming Parallel(dp=2, tp=2, zero=3)
        switch = {w: ([pair_results(("shardwise", "torch"), sent=25_190_400.0)] * 3, 0.0, 25_190_400.0)
                  for w in sw.workloads}
        t = switch_table(name, sw, switch, 4, 256)
        check(t, ["model", "engine", *PAIR[1:]])
        assert t.row_count == 2 * len(sw.workloads) and sw.formula_note in t.caption
    assert "formula: 3(N-1)/N x gradient bytes." in switch_table("fsdp", SWITCHES["fsdp"], switch, 4, 256).caption
    assert "Trainer(Parallel(dp=2, tp=2, zero=3), engine=" in switch_table("fsdp-tp", SWITCHES["fsdp-tp"], switch, 4,
                                                                           256).title
    rows = [row for w in (MLP, GPT_) for row in zero_rows(w, pair_results(("shardwise zero1", "torch ZeRO-1"),
                                                                           sent=16_793_600.0), 2, 16_793_600)]
    check(zero_table("ZeRO-1: 4 ranks, global batch 256, AdamW fp32", rows, 2, ""), ["model", *PAIR])


def zb_ranks(contenders, orders, p: int = 4) -> list[zb.RankResult]:
    keys = [c.key for c in contenders]
    return [zb.RankResult(times={k: [1.2345] * 5 for k in keys}, rss={k: [123_000_000] * 5 for k in keys},
                          sent={k: [4_194_304.0] * 5 for k in keys}, loss={k: 1.0 for k in keys},
                          grad_gap={k: 0.0 for k in keys}, saved={k: 12_345_678 for k in keys},
                          alloc={k: 123_000_000 for k in keys}, cpu={k: [2.345] * 5 for k in keys},
                          order={k: orders(k) for k in keys}) for _ in range(p)]


def test_zero_bubble_tables_fit():
    p, m = 4, 8
    ranks = zb_ranks(zb.CONTENDERS, lambda k: zb.our_order("zb-h1" if "zb" in k else "1f1b", p, m))
    t = zb.zb_table(ranks, zb.CONTENDERS, p, m, 256, 1024, 8)
    check(t, ["implementation", "median step", "vs torch ZB", "paired vs torch ZB", "peak tensors",
              "mem. vs torch ZB"])
    assert len(zb.zb_table(ranks, zb.CONTENDERS, p, m, 256, 1024, 8, wide_=True).columns) == 16
    ranks = zb_ranks(zbv.V_CONTENDERS, lambda k: zbv.v_order("zbv" if "zbv" in k else "dualpipev", p, m))
    check(zbv.zbv_table(ranks, p, m, 256, 1024, 8), ["implementation", "median step", "vs torch", "paired vs torch",
                                                     "peak tensors", "mem. vs torch"])


def test_context_and_expert_parallel_tables_fit():
    n, cfg = 4, cp.CFG
    summary = {k: {"name": k, "sequences": 4, "step_time_s": 1.2345, "rss": 1e8, "sent": 24_531_968.0,
                   "saved": 123_456_789, "saved_one": 12_345_678} for k in (cp.RING, "ulysses", cp.BASELINE)}
    check(cp.cp_table(summary, cfg, n, 4, 2_373_632),
          ["implementation", "median step", "vs dp", "sent/rank/step", "saved act. / seq.", "per seq. vs dp"])
    figures = {"step_time_s": 1.2345, "rss": 1e8, "sent": 10_741_440.0, "a2a": 2_924_122.0, "state": 28_647_424,
               "dispatched": 4096.0, "dropped": 345.5, "tokens": 1024}
    summaries = {w: {c.key: dict(figures) for c in moe.contenders_for(w)} for w in moe.WORLDS}
    check(moe.moe_table(summaries, moe.CFG, moe.SEQUENCES),
          ["ranks", "layout", "median step", "vs ddp", "vs dropless", "state / rank", "a2a/rank/step",
           "dropped share"])


def test_classic_and_compile_tables_fit():
    a = argparse.Namespace(batch=64, reps=5, accelerator="cpu", steps=10)
    check(classic.dp_vs_ddp_table([(8, 1.2345, 1.1234)], {8: (1.0, 12.0, 1.0, 13.0)}, a),
          ["devices N", "DP step", "DP samples/s", "DDP step", "DDP samples/s", "DDP / DP throughput"])
    ps = [["PS async, 1 server, staleness <= 4", "4", "5", "1234.5 ms (1000-1500)", "1,234", "4", "64.06 MiB",
           "W x (P/2 + 16) = 32.03 MiB"]]
    check(table("Parameter server vs DDP", classic.PS_COLUMNS, ps),
          ["configuration", "workers", "worker step", "samples/s", "busiest receives / step"])
    rows = [{"n": 8, "size": 64 * 2**20, "algo": algo, "time": 0.5, "sent": [123_456_789], "received": [123_456_789]}
            for algo in ("naive", "ring", "native")]
    check(classic.allreduce_table(rows, a), ["N", "size S", "algorithm", "time", "algbw", "busiest receives", "/ S"])
    r = PairResult(("eager", "compiled"), {"eager": [3.082, 1.814], "compiled": [6.146, 3.035]})
    check(compile_table(r, 8), ["implementation", "median step", "speed-up vs eager (paired)"])

