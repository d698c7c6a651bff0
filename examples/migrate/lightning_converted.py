"""lightning_original.py in shardwise: the "after" of docs/migrate/lightning.md, the same training.

    python lightning_converted.py                   # shardwise starts the 2 processes itself
    shardwise run --nproc 2 lightning_converted.py   # or torchrun starts them; fit joins their group

What moved where: the LightningModule's model stays an nn.Module; training_step's loss is fit's loss_fn;
configure_optimizers is fit's optimizer factory; validation_step's metrics are fit's val_metrics; the
DataLoaders' per-device batch of 32 on 2 devices is fit's GLOBAL batch_size of 64.
"""
import functools

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset, random_split

import shardwise as sw


class DigitsClassifier(nn.Module):  # the LightningModule's model, without the training logic
    def __init__(self, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)


def accuracy(logits, y):  # validation_step's metric: a batch's mean; fit averages it over the whole set
    return (logits.argmax(-1) == y).float().mean()


def datasets():
    digits = load_digits()  # scikit-learn's bundled 8x8 digits: 1797 images, nothing downloaded
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    return random_split(TensorDataset(x, y), [1437, 360], generator=torch.Generator().manual_seed(0))


def main(max_epochs: int = 10):
    train, val = datasets()
    batch_size = 64  # GLOBAL: Lightning's 32 per device x 2 devices
    trainer = sw.Trainer(
        "ddp", devices=2, accelerator="cpu", precision="bf16-mixed", seed=0,
        max_epochs=max_epochs, gradient_clip_val=1.0,
        callbacks=[sw.EarlyStopping(monitor="val_loss", patience=3)],
        checkpoint_dir="ckpt",  # resumes from here when run again; <ckpt>/best keeps the best validation's
    )
    result = trainer.fit(
        DigitsClassifier(), train, F.cross_entropy, functools.partial(torch.optim.AdamW, lr=1e-3),
        batch_size=batch_size,
        val_dataset=val, val_every=len(train) // batch_size, val_batch_size=40,  # once per epoch
        val_metrics={"val_acc": accuracy}, checkpoint_best="val_loss")
    print(f"val_loss {result.val_metrics[-1]['val_loss']:.4f}, val_acc {result.val_metrics[-1]['val_acc']:.3f}")
    return result


if __name__ == "__main__":  # the ranks re-import this file: train only in the main program
    main()
