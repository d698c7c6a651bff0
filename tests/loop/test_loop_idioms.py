"""The idioms of real hand-written loops, on the model and optimizer `sw.setup` returns, under every strategy.

One table: a row per strategy (one launch each), a cell per idiom. Every cell runs a few steps of the same loop
code on the prepared model (each rank its share of every global batch) and on one plain model in this process
(the whole batch), in float64, and asserts that the losses and the final weights are equal at the suite's
tolerance. The cells that may be refused assert the exact refusal instead.
"""
from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
from conftest import assert_same_run

import shardwise as sw
from shardwise import launch
from shardwise.dims import PP
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(240), pytest.mark.float64]

BATCH = 32
STEPS = 3
CLIP_NORM, CLIP_VALUE = 0.05, 2e-3  # small enough that every step clips
STRATEGIES = {"single": 1, "ddp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "fsdp": 2, "hsdp": 4, "tp": 2, "pp": 2,
              "Parallel(dp=2, tp=2, zero=3)": 4}
SHARDED = {"zero3", "fsdp", "hsdp", "tp", "pp", "Parallel(dp=2, tp=2, zero=3)"}


def strategy_of(name: str):
    return sw.Parallel(dp=2, tp=2, zero=3) if name.startswith("Parallel") else name


def decay_groups(model):
    """The recipe people copy: weight decay on matrices, none on biases."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0}]


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


class Loop:
    """What a cell's loop code calls: the same names on the prepared model (``dist``) and on the plain one."""

    def __init__(self, model, opt, work, dist: bool, call=None):
        self.model, self.opt, self.work, self.dist = model, opt, work, dist
        # What the forward goes through (a torch.compile wrapper of the model).
        self.call = model if call is None else call
        self.pp = dist and model.topo.size(PP) > 1

    def forward_backward(self, x, y, scale=1.0):
        """One batch's forward and backward (under pp: the pipeline's step), the loss scaled by ``scale``."""
        fn = self.work.loss_fn if scale == 1.0 else (lambda out, t: self.work.loss_fn(out, t) * scale)
        if self.pp:
            return self.model.train_step(x, y, fn) / scale
        loss = fn(self.call(x), y)
        loss.backward()
        return (sw.all_reduce_mean(loss.detach(), self.model) if self.dist else loss.detach()) / scale

    def no_sync(self):
        return sw.no_sync(self.model) if self.dist else contextlib.nullcontext()


def _zero_grad(how):
    def clear(loop):
        if how == "p.grad = None":
            for p in loop.model.parameters():
                p.grad = None
        else:
            owner, none = how.split(".zero_grad(set_to_none=")
            getattr(loop, owner).zero_grad(set_to_none=none == "True)")
    return clear


def plain_step(clear):
    def cell(loop, x, y, step):
        loss = loop.forward_backward(x, y)
        loop.opt.step()
        clear(loop)
        return loss
    return cell


def clipped(clip):
    def cell(loop, x, y, step):
        loss = loop.forward_backward(x, y)
        clip(loop.model.parameters())
        loop.opt.step()
        loop.opt.zero_grad()
        return loss
    return cell


def eval_forward(loop, x, y, step):
    """model.eval(), a forward under no_grad on every rank (its output checked too), then model.train()."""
    loop.model.eval()
    with torch.no_grad():
        out = loop.model(x)
        loop.outputs.append((sw.gather_for_metrics(out, loop.model) if loop.dist else out).cpu())
    loop.model.train()
    return plain_step(_zero_grad("opt.zero_grad(set_to_none=True)"))(loop, x, y, step)


def accumulate(loop, x, y, step):
    """Two micro-batches of half the batch, the first under sw.no_sync; the loss scaled by 1/2 each."""
    half = x.shape[0] // 2
    with loop.no_sync():
        a = loop.forward_backward(x[:half], y[:half], 0.5)
    b = loop.forward_backward(x[half:], y[half:], 0.5)
    loop.opt.step()
    loop.opt.zero_grad()
    return (a + b) / 2


def lr_by_hand(loop, x, y, step):
    for i, g in enumerate(loop.opt.param_groups):
        g["lr"] = 1e-2 * (1 + i) / (1 + step)
    return plain_step(_zero_grad("opt.zero_grad(set_to_none=True)"))(loop, x, y, step)


def state_dict_round_trip(loop, x, y, step):
    """After step 0, keep a copy of model.state_dict() (as `best = copy.deepcopy(model.state_dict())` does); after
    step 1, load it back (the optimizer's state goes on)."""
    if step == 0:
        loop.kept = copy.deepcopy(loop.model.state_dict())
    if step == 2:
        loop.model.load_state_dict(loop.kept)
    return plain_step(_zero_grad("opt.zero_grad(set_to_none=True)"))(loop, x, y, step)


CELLS = {
    **{how: plain_step(_zero_grad(how)) for how in (
        "model.zero_grad(set_to_none=True)", "model.zero_grad(set_to_none=False)",
        "opt.zero_grad(set_to_none=True)", "opt.zero_grad(set_to_none=False)", "p.grad = None")},
    "clip_grad_norm_": clipped(lambda ps: torch.nn.utils.clip_grad_norm_(ps, CLIP_NORM)),
    "clip_grad_value_": clipped(lambda ps: torch.nn.utils.clip_grad_value_(ps, CLIP_VALUE)),
    "eval() and a no_grad forward": eval_forward,
    "sw.no_sync accumulation": accumulate,
    "lr set by hand": lr_by_hand,
    "state_dict then load_state_dict": state_dict_round_trip,
}


def batches(work, loader=None):
    """The first STEPS global batches: from a prepared loader (this rank's share, read as the loop goes), or
    whole."""
    if loader is not None:
        return zip(range(STEPS), loader)
    data = work.train
    return enumerate(tuple(torch.stack([torch.as_tensor(data[i][k]) for i in range(s * BATCH, (s + 1) * BATCH)])
                           for k in (0, 1)) for s in range(STEPS))


def run_cell(cell, loop, data):
    loop.outputs = []
    losses = [float(cell(loop, x, y, step)) for step, (x, y) in data]
    return losses, loop.model.state_dict(), loop.outputs


def reference(name):
    work = digits(hidden=32)
    torch.manual_seed(0)
    model = work.make_model()
    opt = ADAMW(decay_groups(model))
    return run_cell(CELLS[name], Loop(model, opt, work, dist=False), batches(work))


def _row(rank, device, strategy, out):
    sw.init(accelerator="cpu")
    work = digits(hidden=32)
    results = {}
    for name, cell in CELLS.items():
        torch.manual_seed(0)
        model, opt = sw.setup(work.make_model(), ADAMW, strategy=strategy_of(strategy), accelerator="cpu",
                              param_groups=decay_groups)
        loader = sw.prepare_dataloader(work.train, batch_size=BATCH, model=model, shuffle=False)
        results[name] = run_cell(cell, Loop(model, opt, work, dist=True), batches(work, loader))
    results["bare state_dict"] = _bare_state_dict(work, strategy)
    if strategy in COMPILED:
        results["torch.compile"] = _compiled(work, strategy)
    if rank == 0:
        torch.save(results, out)


def _bare_state_dict(work, strategy):
    """The bare model's own state_dict() after sw.setup: the full model's, or refused with the fix."""
    torch.manual_seed(0)
    bare = work.make_model()
    model, _ = sw.setup(bare, ADAMW, strategy=strategy_of(strategy), accelerator="cpu")
    full = model.state_dict()
    try:
        own = bare.state_dict()
    except RuntimeError as e:
        return str(e)
    return all(torch.equal(own[k], v) for k, v in full.items())


COMPILED = ("ddp", "fsdp")  # torch.compile(model) after sw.setup: equal where the forward does not communicate


def _compiled(work, strategy):
    """A loop whose forward goes through torch.compile(model, backend="aot_eager"): its run, or the refusal."""
    torch.manual_seed(0)
    model, opt = sw.setup(work.make_model(), ADAMW, strategy=strategy, accelerator="cpu", param_groups=decay_groups)
    loader = sw.prepare_dataloader(work.train, batch_size=BATCH, model=model, shuffle=False)
    loop = Loop(model, opt, work, dist=True, call=torch.compile(model, backend="aot_eager"))
    try:
        return run_cell(CELLS["opt.zero_grad(set_to_none=True)"], loop, batches(work, loader))
    except RuntimeError as e:
        return str(e)


@pytest.fixture(scope="module")
def references():
    return {name: reference(name) for name in CELLS}


class Run:
    def __init__(self, state, losses):
        self.state_dict, self.losses = state, losses


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_idiom_of_a_hand_written_loop_equals_one_plain_process(tmp_path, references, strategy):
    out = tmp_path / "cells.pt"
    launch.spawn(_row, STRATEGIES[strategy], args=(strategy, str(out)))
    results = torch.load(out, weights_only=True)
    failed = []
    for name, (ref_losses, ref_state, ref_outputs) in references.items():
        losses, state, outputs = results[name]
        try:
            assert_same_run(Run(ref_state, ref_losses), Run(state, losses))
            for a, b in zip(ref_outputs, outputs, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
        except AssertionError as e:
            failed.append(f"{name}: {str(e).splitlines()[0]}")
    assert not failed, f"{strategy}: " + "; ".join(failed)
    bare = results["bare state_dict"]
    if strategy in SHARDED:
        holds = "one pipeline stage of it" if strategy == "pp" else (
            "tensor-parallel slices of the parameters" if strategy == "tp" else
            "flat 1-D shards of the parameters (ZeRO-3/FSDP)")
        assert bare == ("state_dict() of the model passed to sw.setup: under "
                        f"{sw.resolve(strategy_of(strategy)).name!r}"
                        f" this rank holds {holds}, so its state dict is not the model's; call state_dict() on the "
                        "model sw.setup returned (a collective: every rank calls it; each gets the full state "
                        "dict), or save with sw.save(model, optimizer, directory)")
    else:
        assert bare is True
    if strategy == "ddp":
        losses, state, _ = results["torch.compile"]
        ref_losses, ref_state, _ = references["opt.zero_grad(set_to_none=True)"]
        assert_same_run(Run(ref_state, ref_losses), Run(state, losses))
    elif strategy == "fsdp":
        assert results["torch.compile"] == (
            "torch.compile(model) on the model sw.setup returned (strategy 'fsdp'): its wrappers communicate from "
            "hooks and swap parameters in and out around each block, which dynamo would trace into the graph; "
            "compile the blocks before the strategy wraps them with sw.setup(..., compile=True) (or "
            "compile='aot_eager', any backend)")
