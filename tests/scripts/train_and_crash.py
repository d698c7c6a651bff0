"""Run under `shardwise run`: trains with checkpoints; optionally SIGKILLs one worker mid-run.

--strategy: a strategy name, or "dp-pp" (GPT with tied embeddings under Parallel(dp=2, pp=2, zero=1), 4 ranks);
other strategies train digits.

--kill-rank R --kill-step S: on the first attempt (torchrun's TORCHELASTIC_RESTART_COUNT == 0),
rank R kills itself with SIGKILL at step S (a real, uncatchable death, as an OOM kill would be);
--kill-attempt A: on attempt A instead.

Several runs in one launch: their flags separated by ``++``, run in turn in the same ranks (a new group
each, as a script with several fits). A run whose --out exists was finished by an earlier attempt and is
not run again, so after a restart the job goes on where it was (each run resumes from its own checkpoints).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal

import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.strategies.parallel import Parallel
from shardwise.strategies.registry import resolve
from shardwise.workloads import CharText, digits, stdlib_text


class KillOnce:
    """Wraps a strategy's train_step with a SIGKILL of one rank at one step, on one attempt only (the first, unless
    ``attempt`` says which)."""

    def __init__(self, inner, rank: int, step: int, attempt: int = 0) -> None:
        self.inner, self.rank, self.step, self.attempt = inner, rank, step, attempt

    def __call__(self, model, micro, loss_fn, topo, *run):
        if (topo.rank == self.rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == str(self.attempt)
                and topo.diag is not None and topo.diag.step == self.step):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(model, micro, loss_fn, topo, *run)


def build(name: str) -> tuple:
    """(strategy, model, data, loss_fn, batch) of a run named ``name``: only shardwise's own objects, so that
    tests/system/test_elastic.py can run the same training through the worker pool as its uninterrupted reference."""
    if name == "dp-pp":
        strategy = Parallel(dp=2, pp=2, zero=1)
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_weights=True))
        return strategy, model, CharText(stdlib_text(20_000), 16), lm_loss, 8
    strategy, work = resolve(name), digits()
    return strategy, work.make_model(), work.train, work.loss_fn, 64


class StepsSeen(sw.Callback):
    """Counts the optimizer steps it saw; its count is kept in every checkpoint, so after a kill and a restart it
    is the run's whole step count only if the checkpoint's count came back."""

    def __init__(self) -> None:
        self.count = 0

    def on_step_end(self, info) -> None:  # noqa: ANN001, D102
        self.count += 1

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def fit(strategy, model, data, loss_fn, batch: int, devices: int, checkpoint_dir: str, checkpoint_every: int,
        steps: int, callbacks: list | None = None) -> sw.FitResult:
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, checkpoint_dir=checkpoint_dir,
                      checkpoint_every=checkpoint_every, timeout_s=30, callbacks=callbacks).fit(
        model, data, loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3), batch_size=batch, max_steps=steps)


def main() -> None:
    import sys

    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-attempt", type=int, default=0)
    p.add_argument("--out", required=True)
    runs, run = [], []
    for arg in [*sys.argv[1:], "++"]:
        if arg != "++":
            run.append(arg)
            continue
        runs.append(p.parse_args(run))
        run = []
    for a in runs:
        if os.path.exists(a.out):
            continue  # finished by an earlier attempt of this job
        strategy, model, data, loss_fn, batch = build(a.strategy)
        if a.kill_rank >= 0:
            strategy.train_step = KillOnce(strategy.train_step, a.kill_rank, a.kill_step,  # type: ignore[method-assign]
                                           a.kill_attempt)
        seen = StepsSeen()
        result = fit(strategy, model, data, loss_fn, batch, int(os.environ["WORLD_SIZE"]), a.checkpoint_dir,
                     a.checkpoint_every, a.steps, [seen])
        if int(os.environ["RANK"]) == 0:
            with open(a.out + ".part", "w") as f:
                json.dump({"losses": result.losses, "steps_seen": seen.count,
                           "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}, f)
            os.replace(a.out + ".part", a.out)  # whole or absent, for a restart that reads whether it exists


if __name__ == "__main__":
    main()
