"""A hand-written loop on `sw.setup`, shared by tests/loop/test_setup_loop.py: run under `shardwise run`
(``python loop_script.py --strategy zero2 --steps 4 --out f.pt``) or called in the test's ranks."""
from __future__ import annotations

import argparse
import functools
from dataclasses import replace

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.strategies.registry import resolve
from shardwise.workloads import digits

MAX_NORM = 0.05  # small enough that every step clips
BATCH = 64
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def batches(loader):
    while True:
        yield from loader


def train(strategy: str, steps: int, out: str | None = None, start_dir: str | None = None,
          save_dir: str | None = None, engine: str = "shardwise") -> list[float]:
    """Steps ``start..steps`` of the loop (``start`` from ``start_dir``'s checkpoint) under ``engine``'s
    mechanism for ``strategy``; rank 0 writes the full state dict from ``model.state_dict()`` to ``out``.
    Returns the losses and the clip norms."""
    sw.init(accelerator="cpu")
    work = digits()
    torch.manual_seed(0)
    model, opt = sw.setup(work.make_model(), ADAMW, strategy=replace(resolve(strategy), engine=engine),
                          accelerator="cpu")
    # The engine asked for is the one that runs: torch's engines are the Torch* strategies.
    assert type(model.strategy).__name__.startswith("Torch") == (engine == "torch"), type(model.strategy)
    loader = sw.prepare_dataloader(work.train, batch_size=BATCH, model=model, shuffle=False)
    start = sw.load(model, opt, start_dir) if start_dir else 0  # the loader's position too: the next batch
    data = batches(loader)
    losses = []
    for _ in range(start, steps):
        x, y = next(data)
        if strategy == "pp":
            loss = model.train_step(x, y, work.loss_fn)
        else:
            loss = work.loss_fn(model(x), y)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM) if strategy in ("ddp", "zero2") else \
            sw.clip_grad_norm_(model, MAX_NORM)
        assert float(norm) > MAX_NORM, float(norm)  # the clip really bites
        opt.step()
        opt.zero_grad()
        losses.append(float(sw.all_reduce_mean(loss.detach(), model)) if strategy != "pp" else float(loss))
    if save_dir:
        sw.save(model, opt, save_dir, step=steps)
    state = model.state_dict()  # a collective: every rank calls it
    if out and (not dist.is_initialized() or dist.get_rank() == 0):
        torch.save(state, out)
    return losses


def reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same loop on one device, with torch's own clip."""
    work = digits()
    torch.manual_seed(0)
    model = work.make_model()
    opt = ADAMW(model.parameters())
    losses = []
    for step in range(steps):
        x = torch.stack([work.train[i][0] for i in range(step * BATCH, (step + 1) * BATCH)])
        y = torch.stack([torch.as_tensor(work.train[i][1]) for i in range(step * BATCH, (step + 1) * BATCH)])
        loss = work.loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model.state_dict(), losses


if __name__ == "__main__":
    import sys

    p = argparse.ArgumentParser(epilog="Several runs in one launch: their flags separated by ++, run in turn in "
                                "these processes (a new group each), e.g. a save under one layout, then its resume "
                                "under another.")
    p.add_argument("--strategy", required=True, help="a name, or several separated by commas: the loop runs under "
                   "each in turn in these processes (a new group each), writing OUT with {strategy} replaced")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--start-dir", default=None, help="resume from this checkpoint directory (sw.load)")
    p.add_argument("--save-dir", default=None, help="save here at the end (sw.save)")
    p.add_argument("--dtype", default="float32", help="the default dtype, in which the model and data are built")
    runs, run = [], []
    for arg in [*sys.argv[1:], "++"]:
        if arg == "++":
            runs.append(p.parse_args(run))
            run = []
        else:
            run.append(arg)
    for a in runs:
        torch.set_default_dtype(getattr(torch, a.dtype))
        for name in a.strategy.split(","):
            train(name, a.steps, a.out.replace("{strategy}", name), a.start_dir, a.save_dir)
            sw.teardown()
