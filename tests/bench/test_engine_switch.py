"""The pairs as engine switches: one Trainer setup alternating ``engine="shardwise"`` and ``engine="torch"`` in
the same ranks, repetition by repetition; in float64 both engines train the same losses, and the bytes our
communication layer counted per step equal the formula (torch's are not seen). ddp and fsdp run the MLP, zero1
and zero2 too, tp, fsdp-tp and pp a tiny GPT (they need a model with a built-in tensor-parallel plan)."""
from __future__ import annotations

import argparse
import importlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from shardwise import launch
from shardwise.bench import engines
from shardwise.bench.engines import SWITCHES, loss_gap, run_switch
from shardwise.bench.pairs import PAIRS
from shardwise.models import GPT, GPTConfig, lm_loss

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64]


def made() -> tuple[nn.Module, TensorDataset, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    g = torch.Generator().manual_seed(0)
    return model, TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)), F.mse_loss


def tiny_gpt() -> tuple[nn.Module, TensorDataset, object]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    tokens = torch.randint(0, cfg.vocab_size, (64, cfg.block_size + 1), generator=torch.Generator().manual_seed(0))
    return GPT(cfg), TensorDataset(tokens[:, :-1], tokens[:, 1:]), lm_loss


# (pair, model, ranks, repetitions, timed steps): the first two as before, each new entry once (a repetition of
# one timed step: a run per engine) to stay inside the suite's budget; fsdp-tp on its layout, dp=2 x tp=2.
CASES = [("ddp", made, 2, 2, 2), ("fsdp", made, 2, 2, 2), ("zero1", made, 2, 1, 1), ("zero2", made, 2, 1, 1),
         ("tp", tiny_gpt, 2, 1, 1), ("fsdp-tp", tiny_gpt, 4, 1, 1), ("pp", tiny_gpt, 2, 1, 1)]


@pytest.mark.parametrize("pair,make,n,reps,steps", CASES, ids=[c[0] for c in CASES])
def test_a_switch_alternates_the_engines_of_one_trainer_setup(pair, make, n, reps, steps):
    switch = SWITCHES[pair]
    work = make()
    ranks, losses = run_switch(switch.strategy_for(n), work, n, batch=8, reps=reps, steps=steps)
    assert len(ranks) == n
    for r in ranks:
        assert r.names == ("shardwise", "torch")
        assert all(len(t) == reps and min(t) > 0 for t in r.step_times.values())  # a run per engine per repetition
        assert all(len(m) == reps for m in r.peak_rss_delta.values())
        formula = switch.formula(work[0], n, 8)  # pp: none (its sends are activations); counted all the same
        assert r.sent_per_step["torch"] is None and r.sent_per_step["shardwise"] > 0
        assert formula is None or r.sent_per_step["shardwise"] == formula
    assert len(losses["shardwise"]) == len(losses["torch"]) == steps + 1  # the untimed first step and the timed
    assert loss_gap(losses) <= 1e-12 * max(losses["torch"])  # the same training under both engines


def _threads_after_joining(rank: int, device: torch.device, path: str) -> None:
    before = torch.get_num_threads()
    launch.init("cpu")  # what a Trainer does when it joins this running group
    assert torch.get_num_threads() == before, (before, torch.get_num_threads())


@pytest.mark.timeout(60)
def test_a_fit_joining_the_ranks_keeps_their_threads(tmp_path):
    # launch.spawn gives each rank its share of the cores; joining its group once took them all again (each of the
    # 2 ranks on 2 cores 2 threads: the ddp switch's steps ran 4x slower than the same Trainer launched alone).
    launch.spawn(_threads_after_joining, 2, args=(str(tmp_path),))


def test_hand_built_still_races_the_hand_built_pairs(monkeypatch):
    monkeypatch.setattr(engines, "switch_pair", lambda name, a: f"switch {name}")
    for name, (module, fn) in {"zero1": ("zero", "zero1_pair"), "tp": ("pp.mp", "tp_pair"),
                               "fsdp-tp": ("compose", "fsdp_tp_pair")}.items():
        monkeypatch.setattr(importlib.import_module(f"shardwise.bench.{module}"), fn, lambda a: f"hand-built {a.n}")
        assert PAIRS[name](argparse.Namespace(hand_built=False, n=name)) == f"switch {name}"
        assert PAIRS[name](argparse.Namespace(hand_built=True, n=name)) == f"hand-built {name}"
    with pytest.raises(SystemExit, match="^zero2: no hand-built pair; run it without --hand-built"):
        PAIRS["zero2"](argparse.Namespace(hand_built=True))
