"""Evaluation in a hand-written loop counts each sample once: an unshuffled prepared loader drops nothing,
`sw.gather_for_metrics` returns every sample once in the dataset's order, a DataLoader is taken for what it is;
and a forward on one rank only under fsdp ends within `sw.init(timeout_s=)`, naming the collective."""
from __future__ import annotations

import functools
import re
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, WeightedRandomSampler

import shardwise as sw
from shardwise import launch

pytestmark = pytest.mark.timeout(120)

SAMPLES = 408  # the size of a GLUE MRPC validation split: 408 = 25 * 16 + 8, so the last batch is short


class Pairs(Dataset):
    """Samples as dicts, collated by a function of our own (as tokenizer pipelines do)."""

    def __len__(self):
        return 37

    def __getitem__(self, i):
        return {"id": i, "x": float(i)}


def collate(items):
    return {"id": torch.tensor([d["id"] for d in items]), "x": torch.tensor([d["x"] for d in items]) * 2}


def _evaluate(rank, device, out):
    sw.init(accelerator="cpu")
    data = TensorDataset(torch.arange(SAMPLES), torch.arange(SAMPLES) * 10)
    results = {}
    for batch in (16, 32):  # the Accelerate example's evaluation batch, and half of it
        loader = sw.prepare_dataloader(data, batch_size=batch, shuffle=False)
        ids, tens, dicts = [], [], []
        for i, t in loader:
            got_i, got_t = sw.gather_for_metrics((i, t))  # a tuple
            ids.append(got_i)
            tens.append(got_t)
            dicts.append(sw.gather_for_metrics({"i": i})["i"])  # a dict, a second call for the same batch
        results[batch] = (torch.cat(ids), torch.cat(tens), torch.cat(dicts), len(loader))
    # A DataLoader is taken for what it says: its dataset, batch (the global one), order and collate function.
    small = sw.prepare_dataloader(DataLoader(Pairs(), batch_size=8, collate_fn=collate))
    results["loader"] = [sw.gather_for_metrics(b) for b in small]
    big = sw.prepare_dataloader(DataLoader(data, batch_size=64, shuffle=True), seed=3)
    results["shuffled"] = torch.cat([sw.gather_for_metrics(i) for i, _ in big])
    results["refused"] = [_refusal(lambda: sw.prepare_dataloader(bad)) for bad in (
        DataLoader(Stream()), DataLoader(data, batch_size=8, sampler=WeightedRandomSampler([1.0] * SAMPLES, 8)),
        DataLoader(data, batch_sampler=[[0, 1], [2, 3]]))]
    results["batch mismatch"] = _refusal(lambda: sw.prepare_dataloader(DataLoader(data, batch_size=8), 16))
    if rank == 0:
        torch.save(results, out)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def _refusal(call):
    try:
        call()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "results.pt"
    launch.spawn(_evaluate, 2, args=(str(out),))
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("batch", [16, 32])
def test_every_sample_is_gathered_once_in_the_dataset_s_order(evaluated, batch):
    ids, tens, dicts, steps = evaluated[batch]
    assert steps == -(-SAMPLES // batch)  # the last, short batch is kept
    assert ids.tolist() == list(range(SAMPLES))
    assert tens.tolist() == [10 * i for i in range(SAMPLES)]
    assert dicts.tolist() == list(range(SAMPLES))


def test_a_dataloader_is_used_with_its_dataset_batch_order_and_collate(evaluated):
    got = evaluated["loader"]
    assert [len(b["id"]) for b in got] == [8, 8, 8, 8, 5]  # global batches of the loader's size, none dropped
    assert torch.cat([b["id"] for b in got]).tolist() == list(range(37))
    assert torch.cat([b["x"] for b in got]).tolist() == [2.0 * i for i in range(37)]
    shuffled = evaluated["shuffled"].tolist()  # a shuffling loader (drop_last=False): one seeded permutation
    assert sorted(shuffled) == list(range(SAMPLES)) and shuffled != sorted(shuffled)


def test_a_dataloader_that_cannot_be_dealt_out_is_refused_with_the_reason(evaluated):
    stream, weighted, batches = evaluated["refused"]
    assert stream == (
        "TypeError: prepare_dataloader() of an IterableDataset: its samples come as a stream, which a "
        "DistributedSampler cannot deal out to the data-parallel ranks by index; give a map-style dataset (with "
        "__getitem__ and __len__), or shard the stream yourself by the rank's data-parallel coordinate")
    assert weighted == (
        "TypeError: prepare_dataloader() of a DataLoader with a WeightedRandomSampler: each rank reads through a "
        "DistributedSampler, which deals out the dataset in order or in one seeded permutation; pass its dataset "
        "and a batch_size, and shuffle=True or False")
    assert batches == (
        "TypeError: prepare_dataloader() of a DataLoader with a batch_sampler of its own: which samples make a "
        "batch is then its choice, which cannot be split over the data-parallel ranks; pass its dataset and a "
        "batch_size instead")
    assert evaluated["batch mismatch"] == (
        "ValueError: batch_size=16 differs from the DataLoader's batch_size=8; pass one of them (it is the GLOBAL "
        "batch per step)")


TIMEOUT_S = 2.0


def _forward_on_rank0(rank, device):
    sw.init(accelerator="cpu", timeout_s=TIMEOUT_S)
    model, _ = sw.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                        functools.partial(torch.optim.SGD, lr=0.1), strategy="fsdp", accelerator="cpu")
    if rank == 0:  # "sampling on rank 0 only": the forward gathers the shards, a collective rank 1 never joins
        with torch.no_grad():
            model(torch.ones(1, 4))
    else:
        time.sleep(60)  # busy elsewhere (ended by the launcher once rank 0 fails)


@pytest.mark.timeout(60)
def test_a_forward_on_one_rank_under_fsdp_ends_within_the_timeout_naming_the_collective():
    with pytest.raises(launch.WorkerFailed) as e:
        launch.spawn(_forward_on_rank0, 2)
    msg = str(e.value)
    # The gather of the shards (one all-gather, or sends and receives for a small unit) names its unit.
    first = re.search(r"rank 0: (all_gather|send|recv) '(fsdp_all_gather\.u\d+)' \(seq \d+ on group \w+, step -?\d+\) "
                      r"did not complete within 0:00:02", msg)
    assert first is not None, msg
    assert re.search(rf"rank\(s\) \[1\] never arrived at (the matching \w+ of )?{first[1]} '{first[2]}'", msg), msg
    assert ("under 'fsdp' a forward of the model from sw.setup is a collective (the ranks holding its shards or "
            "slices take part in it): call the model on every rank of its group, e.g. generate samples on every "
            "rank and print them on rank 0 only") in msg
