"""accelerate_original.py in shardwise: the "after" of docs/migrate/accelerate.md, the same loop.

    shardwise run --nproc 2 accelerate_converted.py   # torchrun underneath; `accelerate launch` before
    python accelerate_converted.py                    # one process (a group of one): the same code runs

What moved where: Accelerator() and prepare() are sw.init() and sw.setup() (the optimizer becomes a factory,
so a strategy that shards the model can build it over what each rank holds); the DataLoader is
sw.prepare_dataloader, whose batch_size is GLOBAL (Accelerate's 16 per process x 2 processes x 2
accumulation steps = 64); accelerator.accumulate is sw.no_sync on all micro-batches but the last;
accelerator.gather_for_metrics is sw.gather_for_metrics.
"""
import contextlib
import functools

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

import shardwise as sw

ACCUMULATE = 2  # micro-batches per optimizer step (Accelerate's gradient_accumulation_steps)


def datasets():
    digits = load_digits()  # scikit-learn's bundled 8x8 digits: 1797 images, nothing downloaded
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    return random_split(TensorDataset(x, y), [1437, 360], generator=torch.Generator().manual_seed(0))


def main(epochs: int = 10, strategy: str = "ddp"):
    sw.init()  # joins shardwise run's group; from a plain `python`, a group of one
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model, optimizer = sw.setup(model, functools.partial(torch.optim.AdamW, lr=1e-3), strategy=strategy,
                                precision="bf16-mixed")
    train, val = datasets()
    train_dl = sw.prepare_dataloader(train, batch_size=64, model=model)  # GLOBAL: 16 x 2 processes x 2
    # The original's evaluation DataLoader, as it was: its batch (here the global one) and order; nothing dropped.
    val_dl = sw.prepare_dataloader(DataLoader(val, batch_size=32), model=model)  # 360 = 11 x 32 + 8
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(train_dl))
    for epoch in range(epochs):
        train_dl.sampler.set_epoch(epoch)
        model.train()
        for x, y in train_dl:  # this rank's part of one global batch: ACCUMULATE micro-batches
            for i, (xm, ym) in enumerate(zip(x.chunk(ACCUMULATE), y.chunk(ACCUMULATE))):
                last = i == ACCUMULATE - 1
                with contextlib.nullcontext() if last else sw.no_sync(model):  # communicate on the last only
                    model.backward(F.cross_entropy(model(xm), ym) / ACCUMULATE)
            sw.clip_grad_norm_(model, 1.0)  # the global norm, under every strategy
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        model.eval()
        correct = total = 0
        for x, y in val_dl:
            with torch.no_grad():
                pred = model(x).argmax(-1)
            pred, y = sw.gather_for_metrics((pred, y), model)  # every sample once, in order, padding dropped
            correct += int((pred == y).sum())
            total += y.numel()
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: val accuracy {correct / total:.3f}")
    sw.save(model, optimizer, "ckpt", step=epochs * len(train_dl))  # any strategy and device count can load it
    state = model.state_dict()  # the full model on every rank (a collective: every rank calls it)
    if dist.get_rank() == 0:
        torch.save(state, "model.pt")
    return correct, total


if __name__ == "__main__":
    main()
    sw.teardown()  # leave the group (a barrier first, so that no rank exits while another still talks)
