"""The full state dict at the end of a ``fit`` that starts its ranks is gathered once, on rank 0: the
other ranks hold no copy of the whole model, counted in bytes, and with ``return_state_dict=False`` no rank does."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel.dp import fsdp_units

pytestmark = [pytest.mark.timeout(120), pytest.mark.float64]

SGD = functools.partial(torch.optim.SGD, lr=0.1)


class GatherCount(sw.Callback):
    """Counts, in this rank, the bytes of the full tensors FSDP's gathers hand back (the patch is this rank's, for
    this fit); written to ``<folder>/<rank>`` at the end, after the state dict."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_fit_start(self, info):
        self.original, self.kept, self.rank = fsdp_units._Unit.gather_full, 0, info.rank
        original = self.original

        def counted(unit, *args, **kwargs):
            fulls = original(unit, *args, **kwargs)
            self.kept += sum(f.numel() * f.element_size() for f in fulls)
            return fulls
        fsdp_units._Unit.gather_full = counted

    def on_fit_end(self, info):
        fsdp_units._Unit.gather_full = self.original
        with open(f"{self.folder}/{self.rank}", "w") as f:
            f.write(str(self.kept))

    on_exception = on_fit_end


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))


def fit(strategy, m, folder=None, **kwargs):
    callbacks = [GatherCount(folder)] if folder else []
    return sw.Trainer(strategy, 2, accelerator="cpu", progress=False, callbacks=callbacks).fit(
        m, data(), nn.functional.cross_entropy, SGD, batch_size=8, max_steps=2, **kwargs)


def test_the_full_state_dict_is_gathered_on_rank_0_only(tmp_path):
    whole = sum(t.numel() * t.element_size() for t in model().state_dict().values())
    single = sw.Trainer("single", 1, accelerator="cpu", progress=False).fit(
        model(), data(), nn.functional.cross_entropy, SGD, batch_size=8, max_steps=2)
    for strategy in ("ddp", "fsdp"):
        m = model()
        run = fit(strategy, m, str(tmp_path) if strategy == "fsdp" else None)
        assert [s["state_dict_bytes"] for s in run.stats] == [whole, 0], strategy
        for k, v in single.state_dict.items():  # rank 0's is the run's, loaded into the model passed in
            torch.testing.assert_close(run.state_dict[k], v, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(m.state_dict()[k], v, rtol=1e-12, atol=1e-12)
    assert [int((tmp_path / str(r)).read_text()) for r in range(2)] == [whole, 0]  # rank 1 kept no gathered tensor
    with torch.device("meta"):
        meta = model()
    run = fit("fsdp", meta, str(tmp_path), return_state_dict=False)
    assert [s["state_dict_bytes"] for s in run.stats] == [0, 0] and run.state_dict == {}
    assert [int((tmp_path / str(r)).read_text()) for r in range(2)] == [0, 0]  # nothing gathered at all
    assert all(p.is_meta for p in meta.parameters())  # left as it was
