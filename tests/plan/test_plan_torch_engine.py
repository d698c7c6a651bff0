"""The planner under engine="torch": each rank's model states as torch's engines partition them (FSDP2's rows
padded per parameter, in host memory under its CPUOffloadPolicy; ZeroRedundancyOptimizer's whole tensors handed
out greedily), equal to what the runs count,
rank by rank; the buffers torch holds besides, and what the plan does not model, said in its notes."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import launch
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.plan import plan_run, rank_states
from shardwise.workloads import CharText, stdlib_text

pytestmark = pytest.mark.timeout(240)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def uneven() -> nn.Module:
    """Rows that 2 ranks cannot split evenly (3, 5, 7) and a frozen bias, which FSDP2 shards too."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 3), nn.ReLU(), nn.Linear(3, 5), nn.Linear(5, 7))
    m[2].bias.requires_grad_(False)
    return m


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))


def _data(model: str) -> tuple[object, object]:
    if model == "gpt":
        return CharText(stdlib_text(4_000), 16), lm_loss
    x = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))
    return list(zip(x, (x.sum(1) * 3).long().clamp(0, 6))), nn.functional.cross_entropy


CASES = [("uneven", "ddp"), ("uneven", "zero1"), ("uneven", "zero2"), ("uneven", "fsdp"), ("gpt", "zero1"),
         ("gpt", "fsdp"), ("uneven", "fsdp-offload")]
# FSDP2's CPUOffloadPolicy: every shard in host memory.
STRATEGIES = {"fsdp-offload": functools.partial(sw.FSDP, offload="all")}


def strategy_of(name: str) -> object:
    return STRATEGIES[name]() if name in STRATEGIES else name


def _runs(rank: int, device: torch.device, folder: str) -> None:
    """Every case under torch's engines, 2 steps each, in one 2-rank launch; rank 0 saves every rank's stats."""
    out = {}
    for model, strategy in CASES:
        data, loss = _data(model)
        run = sw.Trainer(strategy_of(strategy), 2, accelerator="cpu", progress=False, engine="torch").fit(
            {"uneven": uneven, "gpt": gpt}[model](), data, loss, ADAMW, batch_size=8, max_steps=2)
        out[model, strategy] = run.stats
    if rank == 0:
        torch.save(out, os.path.join(folder, "stats.pt"))


def test_torch_partitions_planned_equal_counted_rank_by_rank(tmp_path):
    launch.spawn(_runs, 2, args=(str(tmp_path),))
    counted = torch.load(tmp_path / "stats.pt")
    for model, strategy in CASES:
        layout = sw.Trainer(strategy_of(strategy), 2, accelerator="cpu", engine="torch").strategy.describe(2)
        planned = rank_states({"uneven": uneven, "gpt": gpt}[model](), layout, "adamw")
        stats = sorted(counted[model, strategy], key=lambda s: s["rank"])
        assert [{k: s[k] for k in p.as_stats()} for s, p in zip(stats, planned, strict=True)] == \
            [p.as_stats() for p in planned], (model, strategy)
    # By hand, FSDP2 on the uneven model: pieces of ceil(rows / 2) rows, frozen bias included, padded storage;
    # the optimizer's two states on this rank's rows only (rank 1 holds 1 of 3, 2 of 5 and 3 of 7 rows).
    fsdp = sorted(counted["uneven", "fsdp"], key=lambda s: s["rank"])
    assert [(s["params_bytes"], s["grads_bytes"], s["optimizer_bytes"]) for s in fsdp] == [
        (4 * (20 + 2 + 9 + 3 + 20 + 4), 4 * (20 + 2 + 9 + 20 + 4), 8 * (20 + 2 + 9 + 20 + 4)),
        (4 * (20 + 2 + 9 + 3 + 20 + 4), 4 * (20 + 2 + 9 + 20 + 4), 8 * (10 + 1 + 6 + 15 + 3))]
    # ZeroRedundancyOptimizer, largest first to the emptiest rank: rank 0 owns 3.weight (35) and 3.bias (7),
    # rank 1 0.weight (30), 2.weight (15) and 0.bias (3); the frozen 2.bias (rank 0's) has no state.
    assert [s["optimizer_bytes"] for s in sorted(counted["uneven", "zero1"], key=lambda s: s["rank"])] == \
        [8 * 42, 8 * 48]
    # Offloaded, the same shards, all of them in host memory, none on the device.
    offloaded = sorted(counted["uneven", "fsdp-offload"], key=lambda s: s["rank"])
    assert [(s["params_bytes"], s["host_params_bytes"], s["host_optimizer_bytes"]) for s in offloaded] == \
        [(0, f[0], f[2]) for f in ((s["params_bytes"], 0, s["optimizer_bytes"]) for s in fsdp)]


def test_the_plan_under_torch_adds_ddp_s_buckets_and_says_what_it_does_not_model():
    layout = sw.Trainer("ddp", 2, accelerator="cpu", engine="torch").strategy.describe(2)
    plan = plan_run(gpt(), layout, 10**12, 8, "adamw")
    whole = sum(p.numel() * 4 for p in gpt().parameters())
    assert plan.buffers["DDP gradient buckets (torch)"] == whole
    assert "engine='torch': model states as torch's engines partition them; activations and the other buffers " \
           "as shardwise's engines hold them" in plan.message()
    assert "DDP gradient buckets (torch)" not in plan_run(gpt(), sw.DDP().describe(2), 10**12, 8, "adamw").buffers
    assert layout.label() == "ddp(dp=2, engine=torch)"
