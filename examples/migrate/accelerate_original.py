"""An Accelerate training loop, written as an Accelerate user writes it: the "before" of docs/migrate/accelerate.md.

This project does not install Accelerate, so its tests do not run this file unless ``accelerate`` happens to be
importable (tests/system/test_docs_site.py); accelerate_converted.py is the same loop in shardwise, and the tests run
that one. Run it with Accelerate installed:

    accelerate launch --num_processes 2 accelerate_original.py
"""
import torch
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split


def datasets():
    digits = load_digits()  # scikit-learn's bundled 8x8 digits: 1797 images, nothing downloaded
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    return random_split(TensorDataset(x, y), [1437, 360], generator=torch.Generator().manual_seed(0))


def main(epochs: int = 10):
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, val = datasets()
    train_dl = DataLoader(train, batch_size=16, shuffle=True, drop_last=True)  # 16 per process
    val_dl = DataLoader(val, batch_size=20)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * (len(train) // 64))
    model, optimizer, train_dl, val_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, val_dl,
                                                                        scheduler)
    for epoch in range(epochs):
        model.train()
        for x, y in train_dl:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = total = 0
        for x, y in val_dl:
            with torch.no_grad():
                pred = model(x).argmax(-1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += int((pred == y).sum())
            total += y.numel()
        accelerator.print(f"epoch {epoch}: val accuracy {correct / total:.3f}")
    accelerator.wait_for_everyone()
    accelerator.save_state("ckpt")
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(state, "model.pt")


if __name__ == "__main__":
    main()
