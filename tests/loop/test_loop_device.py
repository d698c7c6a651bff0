"""The hand-written loop on any device and in fp16: inputs follow the model to its device,
``sw.prepare_dataloader`` yields device batches, ``model.backward(loss)`` is the one call that scales an fp16 loss,
and docs/loop.md's program runs as written. The CUDA side of these is in tests/gpu/test_gpu_loop.py."""
from __future__ import annotations

import functools
import os

import docs_snippet
import pytest
import torch
from conftest import assert_same_run

import shardwise as sw
from shardwise import launch
from shardwise.data import to_device
from shardwise.workloads import digits

pytestmark = [pytest.mark.timeout(240)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
META = torch.device("meta")


def test_nested_inputs_and_batch_encodings_move_to_the_device():
    from transformers import BatchEncoding  # seconds to import: only this test of the module needs it

    x = {"a": (torch.ones(2), [torch.zeros(1), 3]), "enc": BatchEncoding({"input_ids": torch.ones(2, 3)})}
    moved = to_device(x, META)
    assert moved["a"][0].device == META and moved["a"][1][0].device == META and moved["a"][1][1] == 3
    assert isinstance(moved["enc"], BatchEncoding) and moved["enc"]["input_ids"].device == META


def test_prepare_dataloader_yields_batches_on_the_device_it_is_given():
    data = torch.utils.data.TensorDataset(torch.arange(8.0), torch.arange(8))
    loader = sw.prepare_dataloader(data, batch_size=4, shuffle=False, device=META)
    assert [(x.device, y.device, tuple(x.shape)) for x, y in loader] == [(META, META, (4,))] * 2
    assert not loader.pin_memory  # pinned memory only for CUDA copies
    plain = sw.prepare_dataloader(data, batch_size=4, shuffle=False)
    assert [x.device.type for x, _ in plain] == ["cpu", "cpu"]


STEPS, BATCH = 4, 64
SGD = functools.partial(torch.optim.SGD, lr=0.5)


def _fp16_loop(rank: int, device: torch.device, out: str) -> None:
    work = digits()
    sw.init(accelerator="cpu")
    torch.manual_seed(0)
    model, opt = sw.setup(work.make_model(), SGD, strategy="ddp", accelerator="cpu", precision="16-mixed")
    loader = sw.prepare_dataloader(work.train, batch_size=BATCH, model=model, seed=0)
    losses, scales = [], []
    for _, (x, y) in zip(range(STEPS), loader):
        loss = work.loss_fn(model(x), y)
        model.backward(loss)  # scales the loss: fp16 gradients of a small loss would flush to zero
        sw.clip_grad_norm_(model, 1.0)  # of the unscaled gradients
        scales.append(opt.scaler.scale)
        opt.step()
        opt.zero_grad()
        losses.append(float(sw.all_reduce_mean(loss.detach().float(), model)))
    x, y = next(iter(loader))
    work.loss_fn(model(x), y).backward()  # unscaled: the step below must refuse it
    try:
        opt.step()
    except RuntimeError as e:
        refused = str(e)
    state = model.state_dict()
    if rank == 0:
        torch.save({"state": state, "losses": losses, "scales": scales, "refused": refused}, out)


def test_an_fp16_loop_equals_the_trainers_fp16_run(tmp_path):
    out = str(tmp_path / "fp16.pt")
    launch.spawn(_fp16_loop, 2, args=(out,))
    got = torch.load(out, weights_only=True)
    work = digits()
    torch.manual_seed(0)
    ref = sw.Trainer("ddp", 2, accelerator="cpu", progress=False, precision="16-mixed", gradient_clip_val=1.0).fit(
        work.make_model(), work.train, work.loss_fn, SGD, batch_size=BATCH, max_steps=STEPS)

    class Ran:
        state_dict, losses = got["state"], got["losses"]

    assert_same_run(ref, Ran)  # float32 model, fp16 autocast: the same operations in the same order
    assert got["scales"] == [2.0 ** 16] * STEPS
    assert got["refused"] == ("precision='16-mixed' scales the loss so that small fp16 gradients survive: call "
                              "model.backward(loss) instead of loss.backward() (or model.train_step), then "
                              "optimizer.step()")


def test_the_loop_of_docs_loop_md_runs_as_written(tmp_path, monkeypatch):
    """The page's program, its main() run here (sw.init forms a group of one)."""
    docs_snippet.run("loop.md", "loop", tmp_path, monkeypatch)
    assert os.path.exists(tmp_path / "model.pt") and os.path.isdir(tmp_path / "ckpt")
