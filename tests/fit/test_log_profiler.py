"""Your own scalars (``sw.log``) and the profiler: what each logs, checked against values computed by
hand from the global batch, and the profiler's parts and bytes against the step time and the byte counter."""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.fit.profiler import PARTS, table
from shardwise.loggers.scalars import Scalars, recording, union
from shardwise.models import GPT, GPTConfig

pytestmark = pytest.mark.timeout(240)

SGD = functools.partial(torch.optim.SGD, lr=0.1)
STEPS = 3
N = 16  # samples: the global batch is the whole set, so every step's batch statistics are known by hand


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sw.log("block_calls", 1, reduce="sum")  # checkpointed: its recompute in backward must not log again
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def logging_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    sw.log("y_mean", y.mean())
    sw.log("y_sum", y.sum(), reduce="sum")
    sw.log("y_max", y.max(), reduce="max")
    sw.log("y_min", y.min(), reduce="min")
    return F.mse_loss(out, y)


class LogStep(sw.Callback):
    def on_step_end(self, info) -> None:
        sw.log("done", info.step)  # the same on every rank: its mean is itself


def targets() -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32).reshape(N, 1) ** 2 / 10  # unequal halves: rank 0's share differs


def dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(torch.linspace(-1, 1, N * 4).reshape(N, 4), targets()))


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_and_the_simple_profiler_under_ddp(tmp_path):
    """One ddp x 2 run checks every sw.log rule and profiler="simple"; 2 micro-batches per step,
    checkpointed blocks, a validation and a callback that logs."""
    path = tmp_path / "m.jsonl"
    torch.manual_seed(0)
    run = sw.Trainer("ddp", 2, accelerator="cpu", progress=False, metrics_path=path, accumulate_grad_batches=2,
                     log_every_n_steps=1,
                     activation_checkpointing=True, callbacks=[LogStep()], profiler="simple").fit(
        Net(), dataset(), logging_mse, SGD, batch_size=N, max_steps=STEPS, val_dataset=dataset(), val_every=STEPS)
    y = targets()
    train = [r for r in rows(path) if "loss" in r]
    assert [r["step"] for r in train] == list(range(STEPS))
    for r in train:
        assert r["y_mean"] == pytest.approx(float(y.mean()))  # mean over the 2 shards x 2 micro-batches
        assert r["y_sum"] == pytest.approx(float(y.sum()))
        assert (r["y_max"], r["y_min"]) == (pytest.approx(float(y.max())), pytest.approx(float(y.min())))
        assert r["block_calls"] == 2 * 2 * 2  # blocks x micro-batches x ranks: the recompute logs nothing
        assert r["done"] == r["step"] + 1  # logged in on_step_end: that step's row
    val = [r for r in rows(path) if "val_loss" in r]
    # The metrics file writes names without their namespace: the validation row's y_mean is the loggers' val/y_mean.
    assert len(val) == 1 and val[0]["y_mean"] == pytest.approx(float(y.mean()))
    assert val[0]["block_calls"] == 2 * 2  # blocks x ranks (one batch each, no backward)
    assert "done" not in val[0] and "y_sum" in val[0]

    profiles = run.profile
    assert len(profiles) == 2
    for p, stats in zip(profiles, run.stats):
        assert p["profiled_steps"] == STEPS and set(p["parts_s"]) == set(PARTS)
        assert sum(p["parts_s"].values()) == pytest.approx(p["step_s"], rel=0.05)
        assert p["parts_s"]["forward"] > 0 and p["parts_s"]["backward"] > 0
        # Its bytes are the counter's: every byte the training loop sent, by name.
        assert sum(c["bytes"] for c in p["collectives"].values()) == stats["comm_bytes_per_step"] * STEPS
        params = sum(v.numel() for v in run.state_dict.values())
        assert p["collectives"]["ddp"]["bytes"] == STEPS * 4 * params  # all-reduce of 2: S bytes a step
        assert all(c["waited_s"] <= c["in_flight_s"] + 1e-6 for c in p["collectives"].values())
    printed = table(profiles)  # what rank 0 printed (on the ranks' stderr, which pytest does not capture)
    assert printed.startswith("shardwise profiler: 3 steps (0..2), mean per step, ms\n"
                              "rank      step      data   forward  backward optimizer     other\n   0 ")
    assert "   1 ddp                 " in printed  # rank 1's collectives are in rank 0's table


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))


def token_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 32, (8, 8), generator=g)
    return list(zip(x, (x * 7 + 3) % 32))


def logging_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    sw.log("target_mean", y.float().mean())
    sw.log("samples", y.shape[0], reduce="sum")  # tp peers see the same samples: counted once
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("layout", ["dp2-tp2", "dp2-pp2"])
def test_log_under_data_tensor_and_pipeline_parallel(tmp_path, layout):
    """Tensor-parallel peers count once; under a pipeline only the last stage logs (the loss), in 2
    micro-batches per step, and the first stage's empty set of names is agreed on all the same."""
    path = tmp_path / "m.jsonl"
    data = token_data()
    strategy = sw.Parallel(dp=2, tp=2) if layout == "dp2-tp2" else sw.Parallel(dp=2, pp=2, microbatches=2)
    every = sw.Trainer(strategy, 4, accelerator="cpu", progress=False, metrics_path=path,
                       log_every_n_steps=1).fit(
        tiny_gpt(), data, logging_cross_entropy, SGD, batch_size=8, max_steps=3)
    y = torch.stack([t for _, t in data]).float()
    for r in rows(path):
        assert r["target_mean"] == pytest.approx(float(y.mean()))
        assert r["samples"] == 8  # the global batch, not 16 (tp peers twice)
    if layout == "dp2-tp2":  # the same run logging every second step (1 and the last, 2): only those reduce
        skipping = sw.Trainer(strategy, 4, accelerator="cpu", progress=False, metrics_path=tmp_path / "s.jsonl",
                              log_every_n_steps=2).fit(tiny_gpt(), data, logging_cross_entropy, SGD, batch_size=8,
                                                       max_steps=3)
        assert [r["step"] for r in rows(tmp_path / "s.jsonl") if "loss" in r] == [1, 2]
        assert [s["comm_by_name"]["metrics"] < e["comm_by_name"]["metrics"]
                for s, e in zip(skipping.stats, every.stats)] == [True] * 4


def test_the_pytorch_profiler_writes_a_trace_per_rank(tmp_path):
    run = sw.Trainer("ddp", 2, accelerator="cpu", progress=False, profiler="pytorch", profile_steps=(0, 2),
                     profiler_dir=tmp_path).fit(Net(), dataset(), logging_mse, SGD, batch_size=N, max_steps=2)
    assert [p["trace"] for p in run.profile] == [str(tmp_path / "rank0.json"), str(tmp_path / "rank1.json")]
    for rank in range(2):
        events = json.loads((tmp_path / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert {"shardwise.step#0", "shardwise.step#1"} <= names
        assert any(n and "allreduce" in n.lower() for n in names)  # the step's collectives are in it


# ---- in this process ----------------------------------------------------------------------------------------
def test_log_outside_a_fit_does_nothing_but_checks_its_arguments():
    sw.log("x", 1.0)  # no run: nothing recorded, nothing raised
    with pytest.raises(ValueError, match=r"^sw.log\('x'\): reduce must be one of 'mean', 'sum', 'max', 'min', "
                                         r"got 'avg'$"):
        sw.log("x", 1.0, reduce="avg")
    with pytest.raises(ValueError, match=r"^sw.log\('x'\): the value must be one number, got a tensor of shape "
                                         r"\[2\]$"):
        sw.log("x", torch.ones(2))
    with pytest.raises(ValueError, match=r"^sw.log\('lr/0'\): the step row already has 'lr/0' \(it holds step, "
                                         r"loss, .*\); choose another name$"):
        sw.log("lr/0", 1.0)


def test_one_name_has_one_reduction():
    with recording(Scalars()) as got:
        sw.log("x", 1.0)
        with pytest.raises(ValueError, match="was logged with reduce='mean' and now with reduce='sum'"):
            sw.log("x", 2.0, reduce="sum")
    assert got.names() == [("x", "mean")]
    with pytest.raises(ValueError, match=r"^sw.log\('x'\) is logged with reduce='mean' on one rank and "
                                         r"reduce='max' on rank 1; one name has one reduction$"):
        union([[["x", "mean"]], [["x", "max"]]])


def test_bad_profiler_options_are_refused():
    with pytest.raises(ValueError, match=r"^profiler must be 'simple', 'pytorch' or None, got 'tensorboard'$"):
        sw.Trainer("single", 1, profiler="tensorboard")
    with pytest.raises(ValueError, match=r"^profile_steps must be a range of steps or \(start, stop\) with "
                                         r"0 <= start < stop, got \(3, 1\)$"):
        sw.Trainer("single", 1, profiler="simple", profile_steps=(3, 1))
    t = sw.Trainer("single", 1, profiler="pytorch", profile_steps=range(2, 5), checkpoint_dir="ckpt")
    assert (t.profile_steps, t.profiler_dir) == ((2, 5), os.path.abspath(os.path.join("ckpt", "profiles")))
