"""A switcher's first day: the mistakes of someone coming from a plain torch loop are
refused before any process starts, each with a message that says what was passed and what to do.

Every refusal runs under ``no_spawn`` (starting a rank is itself a failure) and is asserted as a whole message.
One pair of fits (a single-device reference and two ddp ranks, float64) shows that a lazy model is materialised
in the caller, once, so that every rank starts from the weights of the user's own dry run.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise as sw
from shardwise.strategies import registry
from shardwise.strategies.base import Strategy

pytestmark = pytest.mark.timeout(120)

SGD = functools.partial(torch.optim.SGD, lr=0.1)
LOSS = nn.functional.cross_entropy


def data(n: int = 32, features: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g))


def fit(model: nn.Module, dataset, strategy="ddp", devices: int = 2, batch: int = 16, steps: int = 1, **kw):
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, **kw).fit(
        model, dataset, LOSS, SGD, batch_size=batch, max_steps=steps)


def refused(error: type[Exception], call) -> str:
    with pytest.raises(error) as info:
        call()
    return str(info.value)


def test_a_dataloader_passed_as_the_dataset(no_spawn):
    loader = DataLoader(data(), batch_size=16)
    assert refused(TypeError, lambda: fit(nn.Linear(8, 3), loader)) == (
        "the dataset is a torch DataLoader over a TensorDataset, which yields batches, not samples: pass the "
        "Dataset; the Trainer makes the batches and splits them over ranks")


class Net(nn.Module):
    def __init__(self, first: nn.Module, last: nn.Module) -> None:
        super().__init__()
        self.net = nn.Sequential(first, nn.ReLU(), last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_shape_mistake_names_the_module_and_its_input(no_spawn):
    # 16 samples over 2 ranks: the pre-check runs the 8-sample micro-batch each rank would run.
    model = Net(nn.Linear(8, 8), nn.Linear(10, 3))
    assert refused(ValueError, lambda: fit(model, data())) == (
        "the model's forward failed before any process started, in module 'net.2' (Linear(in_features=10, "
        "out_features=3, bias=True)) on an input of shape [8, 8] float32: mat1 and mat2 shapes cannot be "
        "multiplied (8x8 and 10x3)")


def test_a_dtype_mistake_names_the_module_and_its_input(no_spawn):
    # The meta device multiplies float32 by float64 without a word; the CPU refuses, and so does the pre-check.
    model = Net(nn.Linear(8, 8), nn.Linear(8, 3).double())
    assert refused(ValueError, lambda: fit(model, data())) == (
        "the model's forward failed before any process started, in module 'net.2' (Linear(in_features=8, "
        "out_features=3, bias=True)) on an input of shape [8, 8] float32: mat1 and mat2 must have the same "
        "dtype, but got Float and Double")


def test_plain_list_samples(no_spawn):
    samples = [[[1.0, 2.0], 0] for _ in range(32)]
    assert refused(TypeError, lambda: fit(nn.Linear(2, 3), samples)) == (
        "sample 0 of the dataset is a list whose input is a plain list of numbers ([1.0, 2.0]): torch's "
        "default_collate batches it position by position, into a list of 2 tensors rather than one tensor; make "
        "it a tensor (torch.tensor([1.0, 2.0])) or pass a collate_fn that builds the batch")


def test_an_unwritable_checkpoint_dir(no_spawn):
    # The suite runs as root, for whom os.access says yes to every directory: /proc takes no new file anyway.
    message = refused(ValueError, lambda: fit(nn.Linear(8, 3), data(), checkpoint_dir="/proc/shardwise-ckpt"))
    assert re.fullmatch(r"checkpoint_dir='/proc/shardwise-ckpt' cannot be written \((creating a file in '/proc' "
                        r"failed: [A-Za-z ]+|'/proc' is not writable)\)", message), message


def test_a_lazy_module_the_forward_never_calls(no_spawn):
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = nn.LazyLinear(3), nn.LazyLinear(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    assert refused(ValueError, lambda: fit(Unused(), data())) == (
        "the model's lazy modules 'spare' were not initialised by a forward of the first batch (the forward did "
        "not call them); initialise them before fit with a forward of one batch, or give them their sizes "
        "(nn.Linear instead of nn.LazyLinear)")


@pytest.mark.float64
def test_a_lazy_model_trains_as_after_the_users_own_dry_run(same_run):
    def lazy() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.LazyLinear(3))

    reference = lazy()
    reference(data()[:8][0])  # torch's dry run: the lazy weights drawn in forward order from the same seed
    ref = fit(reference, data(), "single", 1, steps=3)
    model = lazy()
    run = fit(model, data(), "ddp", 2, steps=3)
    same_run(ref, run)
    assert type(model[0]) is nn.Linear and model[0].weight.shape == (16, 8)  # materialised in place, then trained
    torch.testing.assert_close(model.state_dict(), run.state_dict, rtol=0, atol=0)


@pytest.mark.parametrize("size", ["dp", "tp", "pp", "cp", "ep", "replicate"])
def test_pp_refuses_every_size_but_its_own(size):
    assert refused(ValueError, lambda: sw.PP(**{size: 2})) == (
        "PP puts every device in the pipeline (pp = devices): it takes none of dp, tp, pp, cp, ep, zero, "
        f"replicate, got {size}=2; use sw.Parallel({'' if size == 'pp' else 'pp=<stages>, '}{size}=2), which "
        "composes them")


SIZES = ("dp", "tp", "pp", "cp", "ep", "replicate", "shard_size", "servers")


def test_every_preset_honours_or_refuses_every_size_it_takes():
    """A size field of any built-in strategy, set to 4 on 8 devices, changes the layout or is refused."""
    checked = []
    for target in registry.CLASSES.values():
        cls = registry.load(target)
        if not (isinstance(cls, type) and issubclass(cls, Strategy) and dataclasses.is_dataclass(cls)):
            continue
        for f in dataclasses.fields(cls):
            if f.name not in SIZES:
                continue
            checked.append(f"{cls.__name__}.{f.name}")
            try:
                layout = cls(**{f.name: 4}).layout(8)
            except ValueError:
                continue
            assert layout != cls().layout(8), f"{cls.__name__}({f.name}=4) builds the default layout"
    assert {"PP.cp", "Parallel.cp", "HSDP.shard_size", "ParameterServer.servers"} <= set(checked)


def test_naive_mp_refuses_a_device_count_other_than_its_list():
    assert refused(ValueError, lambda: sw.Trainer(sw.NaiveMP(devices=["cpu"] * 3), 2)) == (
        "devices=2 but NaiveMP(devices=...) names 3 devices; pass devices=3 (or 1) to the Trainer, or list 2 "
        "devices")
    assert sw.Trainer(sw.NaiveMP(devices=["cpu"] * 3), 1).layout.devices_per_process == 3


def test_no_probe_file_is_left_behind(tmp_path, no_spawn):
    with pytest.raises(no_spawn):
        fit(nn.Linear(8, 3), data(), checkpoint_dir=str(tmp_path / "ck"), memory_check="off")
    assert os.listdir(tmp_path) == []
