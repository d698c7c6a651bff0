"""Data as users have it: iterable datasets, DataLoader workers, dict batches, resume position.

Every run is compared with single-device training on the same data: the
global batches are the same whatever the device count, the number of
DataLoader workers, or whether the run was interrupted.
"""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

import shardwise as sw
from shardwise.data import (
    DataSource,
    GlobalBatches,
    LoaderOptions,
    StreamBatches,
    stream_steps,
)
from shardwise.models import GPT, MLP, GPTConfig, lm_loss
from shardwise.workloads import CharText, digits, stdlib_text

pytestmark = [pytest.mark.timeout(300), pytest.mark.float64]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


class DigitStream(IterableDataset):
    """200 digits as a stream, reshuffled by ``set_epoch`` (64-sample batches: 3 per epoch, 8 samples dropped).

    With ``split_over_workers`` it does what torch's docs suggest for workers: each DataLoader worker yields
    only its own part. The Trainer must still read the whole stream in every worker (it hides the worker info).
    """

    def __init__(self, split_over_workers: bool = False) -> None:
        self.data = digits().train
        self.split = split_over_workers
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(200, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        info = get_worker_info() if self.split else None
        if info is not None:
            order = order[info.id::info.num_workers]
        for i in order:
            yield self.data[i]


class DictDigits(torch.utils.data.Dataset):
    """The digits as dict samples, Hugging Face style."""

    def __init__(self) -> None:
        self.data = digits().train

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return {"pixels": x, "labels": y}


class DictMLP(MLP):
    """The digits MLP called with keyword inputs (``model(**inputs)``); same parameters, same names."""

    def forward(self, pixels):  # type: ignore[override]
        return self.net(pixels)


def dict_loss(out, batch):
    return F.cross_entropy(out, batch["labels"])


def make_mlp(cls=MLP):
    torch.manual_seed(0)
    return cls(64, 128, 2, 10)


def stacked(samples):
    """A collate_fn of the user's own (here: torch's default, called through a function of ours)."""
    return default_collate(samples)


def fit(strategy, devices, data, steps=8, model=None, loss=F.cross_entropy, ckpt=None, every=None,
        accumulate=1, **kw):
    return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, checkpoint_dir=ckpt,
                      checkpoint_every=every, accumulate_grad_batches=accumulate).fit(
        model if model is not None else make_mlp(), data, loss, ADAMW, batch_size=64, max_steps=steps, **kw)


@pytest.fixture(scope="module")
def stream_single():
    return fit("single", 1, DigitStream())


# ---- iterable datasets ------------------------------------------------------------------
def test_each_rank_reads_its_own_part_of_every_global_batch():
    stream = list(range(20))
    whole = list(itertools.islice(stream_steps(stream, 6, 1, 0), 6))
    assert [s for s, _ in whole] == list(range(6))
    # 20 samples make 3 batches of 6 per epoch (2 dropped); the stream then starts over.
    assert [b for _, b in whole] == [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))] * 2
    for r in range(3):
        # Rank r of 3 holds positions r and r + 3 of each global batch: the union is what one device reads.
        part = list(itertools.islice(stream_steps(stream, 6, 3, r), 6))
        assert part == [(s, b[r::3]) for s, b in whole]


def test_stream_batches_resume_and_workers_read_the_same_batches():
    ref = StreamBatches(DigitStream(), 64, 2, 1, start=0, stop=8)
    want = [ref.batch(s, torch.device("cpu")) for s in range(8)]
    for start, workers in ((0, 2), (4, 0), (5, 2)):
        got = StreamBatches(DigitStream(True), 64, 2, 1, loader=LoaderOptions(num_workers=workers), start=start,
                            stop=8)
        for s in range(start, 8):
            x, y = got.batch(s, torch.device("cpu"))
            assert torch.equal(x, want[s][0]) and torch.equal(y, want[s][1]), (start, workers, s)
        got.close()


def test_an_iterable_dataset_under_ddp_equals_single(stream_single, same_run):
    same_run(stream_single, fit("ddp", 2, DigitStream()))


def test_dataloader_workers_give_the_same_batches(same_run):
    """num_workers=2 in each of 2 ranks equals one process without workers: map-style and iterable data."""
    work = digits()
    same_run(fit("single", 1, work.train), fit("ddp", 2, work.train, num_workers=2, collate_fn=stacked))


def test_dataloader_workers_on_a_stream_that_splits_itself(stream_single, same_run):
    same_run(stream_single, fit("ddp", 2, DigitStream(split_over_workers=True), num_workers=2))


def test_a_resumed_stream_continues_where_it_stopped(tmp_path, stream_single, same_run):
    """Stopped after 4 steps (epoch 1, one batch in), resumed with workers: the uninterrupted run's batches."""
    ckpt = str(tmp_path / "ck")
    fit("ddp", 2, DigitStream(), steps=4, ckpt=ckpt)
    same_run(stream_single, fit("ddp", 2, DigitStream(), ckpt=ckpt, num_workers=2))


# ---- dict batches -------------------------------------------------------------------------
def test_dict_batches_under_ddp_equal_pairs_on_one_device(same_run):
    """{"pixels", "labels"} samples, ``model(**inputs)``, ``loss_fn(output, batch)``, micro-batches included."""
    pairs = fit("single", 1, digits().train, accumulate=2)
    run = fit("ddp", 2, DictDigits(), model=make_mlp(DictMLP), loss=dict_loss, accumulate=2)
    same_run(pairs, run)
    same_run(pairs, fit("single", 1, DictDigits(), model=make_mlp(), loss=dict_loss, inputs="pixels"))


class TokenDicts(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.text = CharText(stdlib_text(20_000), 16)

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, i):
        x, y = self.text[i]
        return {"input_ids": x, "labels": y}


def gpt_dict_loss(out, batch):
    return lm_loss(out, batch["labels"])


def make_gpt():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32))
    for b in m.blocks:
        b.attn.k.bias.requires_grad_(False)
    return m


def test_dict_batches_through_a_pipeline(same_run):
    """A pipeline feeds its first stage one tensor: inputs="input_ids"; the last stage's loss gets the batch dict."""
    def run(strategy, devices):
        return sw.Trainer(strategy, devices, accelerator="cpu", progress=False, accumulate_grad_batches=2).fit(
            make_gpt(), TokenDicts(), gpt_dict_loss, ADAMW, batch_size=8, max_steps=3, inputs="input_ids")

    same_run(run("single", 1), run("pp", 2))


# ---- what is refused -------------------------------------------------------------------------
def test_bad_data_options_are_refused(no_spawn):
    with pytest.raises(ValueError, match="^dataloader option.s. batch_size, shuffle cannot be set: the Trainer makes"):
        sw.Trainer("ddp", 2, dataloader_kwargs={"batch_size": 8, "shuffle": True})
    with pytest.raises(ValueError, match="^unknown dataloader option.s. num_worker; valid: num_workers, collate_fn"):
        sw.Trainer("ddp", 2, dataloader_kwargs={"num_worker": 2})
    with pytest.raises(ValueError, match="^num_workers must be an integer >= 0, got -1"):
        fit("ddp", 2, digits().train, num_workers=-1)
    with pytest.raises(ValueError, match="^inputs= picks the model's inputs among the keys of dict samples"):
        fit("ddp", 2, digits().train, inputs="pixels")
    with pytest.raises(KeyError, match="inputs= names the key 'image', which the batch does not have"):
        fit("ddp", 2, DictDigits(), model=make_mlp(DictMLP), loss=dict_loss, inputs=["image"])
    with pytest.raises(ValueError, match="^strategy 'pp' feeds the model's input through its layers as one tensor"):
        fit("pp", 2, DictDigits(), model=make_mlp(DictMLP), loss=dict_loss)
    with pytest.raises(TypeError, match="^fit's collate_fn cannot be sent to the rank processes"):
        fit("ddp", 2, digits().train, collate_fn=lambda samples: default_collate(samples))
    with pytest.raises(ValueError, match=r"^the dataset stream yields 10 samples, fewer than one global batch"):
        fit("ddp", 2, ShortStream())


class ShortStream(IterableDataset):
    def __iter__(self):
        data = digits().train
        yield from (data[i] for i in range(10))


def test_map_style_batches_unchanged():
    """The map-style order is the one shardwise always had (DistributedSampler positions per step)."""
    data = list(range(100))
    b = GlobalBatches(data, 20, 2, 1, seed=3)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(0)
    assert b.indices(1) == list(sampler)[10:20]
    assert DataSource(data).streaming is False and DataSource(DigitStream()).streaming is True


def test_a_dict_key_the_model_does_not_take(no_spawn):
    with pytest.raises(TypeError, match=r"^the model does not take the dict batch's inputs as keyword arguments "
                                        r"\(pixels\): .*unexpected keyword argument 'pixels'.* "
                                        r"fit\(inputs=\.\.\.\) names"):
        fit("ddp", 2, DictDigits(), loss=dict_loss)  # MLP.forward(x): no 'pixels'


def test_the_digits_workload_reads_exactly_scikit_learns_digits():
    # The workload parses the bundled CSV itself (no scikit-learn import in every rank): it must give
    # load_digits' pixels (scaled by 1/16) and labels, in the same 80/20 split as before.
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    work = digits()
    assert torch.equal(work.train.tensors[0], x[perm[:1437]]) and torch.equal(work.train.tensors[1], y[perm[:1437]])
    assert torch.equal(work.test.tensors[0], x[perm[1437:]]) and torch.equal(work.test.tensors[1], y[perm[1437:]])
