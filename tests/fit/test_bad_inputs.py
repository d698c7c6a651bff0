"""Every input the launching process can judge is refused before any rank starts.

Each case runs under the ``no_spawn`` fixture: starting a process is itself a
failure, so a check that only fires inside the ranks fails the test.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.workloads import digits

pytestmark = pytest.mark.timeout(60)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def fit(strategy="ddp", devices=2, model=None, data=None, loss=None, opt=ADAMW, batch=64, **kw):
    work = digits()
    return sw.Trainer(strategy, devices, accelerator=kw.pop("accelerator", "cpu"), progress=False, **kw).fit(
        model if model is not None else work.make_model(), data if data is not None else work.train,
        loss or work.loss_fn, opt, batch_size=batch, max_steps=2)


def test_tensor_parallel_without_a_plan(no_spawn):
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with pytest.raises(ValueError, match=r"^no built-in tensor-parallel plan for Sequential; pass plan=\{'<module "
                                         r"pattern>': 'colwise' \| 'rowwise' \| 'vocab' \| 'colwise_gather', "
                                         r"\.\.\.\}$"):
        fit("tp", 2, model=model)


def test_an_hsdp_shard_size_that_does_not_divide(no_spawn):
    with pytest.raises(ValueError, match="^HSDP shard_size=3 must divide the data-parallel size 4$"):
        fit(sw.HSDP(shard_size=3), 4)


def test_an_unknown_accelerator(no_spawn):
    with pytest.raises(ValueError, match="^unknown accelerator 'tpu'; valid: 'auto', 'cpu', 'cuda'$"):
        fit(accelerator="tpu")


def test_an_optimizer_instance_instead_of_a_factory(no_spawn):
    opt = torch.optim.AdamW(digits().make_model().parameters(), lr=1e-3)
    with pytest.raises(TypeError, match=r"^optimizer must be a factory that builds the optimizer from parameters .* "
                                        r"not a built AdamW; pass e\.g\. "
                                        r"functools\.partial\(torch\.optim\.AdamW, lr=\.\.\.\)$"):
        fit(opt=opt)


def test_a_dataset_without_len(no_spawn):
    with pytest.raises(TypeError, match="^the dataset must support len\\(\\) and indexing .* got generator$"):
        fit(data=(x for x in range(3)))


def test_samples_of_different_shapes(no_spawn):
    data = [(torch.zeros(64 if i % 2 else 63), torch.tensor(0)) for i in range(128)]
    with pytest.raises(ValueError, match=r"^samples 0\.\.31 of the dataset cannot be stacked into one batch .* found "
                                         r"a tuple of \(a tensor of shape \[63\]"):
        fit(data=data)


def test_a_plain_list_of_inputs_without_targets(no_spawn):
    with pytest.raises(TypeError, match=r"^each sample must be an \(input, target\) pair; dataset\[0\.\.31\] holds a "
                                        r"tensor of shape \[64\]"):
        fit(data=[torch.zeros(64) for _ in range(128)])


def test_a_plain_list_of_pairs_is_fine(no_spawn):
    data = [(torch.zeros(64), torch.tensor(i % 10)) for i in range(128)]
    with pytest.raises(no_spawn):  # accepted: the run gets as far as starting its processes
        fit(data=data)


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 10)

    def forward(self, x):
        return self.lin(x), x.sum()


def test_a_forward_that_returns_a_tuple_the_loss_cannot_take(no_spawn):
    with pytest.raises(TypeError, match=r"^the loss function cannot take the model's output: the model returns a tuple "
                                        r"of \(a tensor of shape \[32, 10\] \(float32\), a tensor of shape \[\] "):
        fit(model=TupleOut())


def test_a_loss_that_is_not_a_scalar(no_spawn):
    with pytest.raises(ValueError, match=r"^loss_fn must return a scalar .* got a tensor of shape \[32\]; reduce it"):
        fit(loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"))


def test_a_checkpoint_dir_that_is_a_file(no_spawn, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        fit(checkpoint_dir=str(f))


def test_a_thousand_processes_on_a_few_cores(no_spawn):
    with pytest.raises(ValueError, match=r"^devices=1000 would start 1000 processes on \d+ CPU cores, more than "
                                         r"max_processes_per_core=8 per core"):
        fit(devices=1000, batch=1000, memory_check="off")


@pytest.mark.parametrize("kw,what", [({"precision": "16-mixed"}, "precision='16-mixed'"),
                                     ({"on_nonfinite": "skip"}, "on_nonfinite='skip'")])
def test_the_parameter_server_with_per_step_agreement(no_spawn, kw, what):
    with pytest.raises(ValueError, match=f"^strategy 'ps' does not support {what}: the loss-scale overflow and skip "
                                         "decisions are agreed by every rank each step"):
        fit(sw.ParameterServer(servers=1), 3, **kw)


def test_a_checkpoint_dir_that_cannot_be_written(no_spawn, tmp_path, monkeypatch):
    # The tests run as root, for whom every directory is writable: the permission check is made to say no.
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    with pytest.raises(ValueError, match=f"^checkpoint_dir='{tmp_path}/ck' cannot be written \\('{tmp_path}' is not "
                                         "writable\\)$"):
        fit(checkpoint_dir=str(tmp_path / "ck"))
