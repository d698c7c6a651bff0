"""A Lightning training script, written as a Lightning user writes it: the "before" of docs/migrate/lightning.md.

This project does not install Lightning, so its tests do not run this file unless ``lightning`` happens to be
importable (tests/system/test_docs_site.py); lightning_converted.py is the same training in shardwise, and the tests
run that one. Run it with Lightning installed:

    python lightning_original.py      # Lightning starts the 2 processes itself (strategy="ddp", devices=2)
"""
import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split


class DigitsClassifier(L.LightningModule):
    def __init__(self, hidden: int = 128, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def datasets():
    digits = load_digits()  # scikit-learn's bundled 8x8 digits: 1797 images, nothing downloaded
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    return random_split(TensorDataset(x, y), [1437, 360], generator=torch.Generator().manual_seed(0))


def main(max_epochs: int = 10):
    L.seed_everything(0)
    train, val = datasets()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", precision="bf16-mixed",
        max_epochs=max_epochs, gradient_clip_val=1.0,
        callbacks=[EarlyStopping(monitor="val_loss", patience=3),
                   ModelCheckpoint(dirpath="ckpt", monitor="val_loss")],
    )
    trainer.fit(DigitsClassifier(),
                train_dataloaders=DataLoader(train, batch_size=32, shuffle=True),  # 32 per device
                val_dataloaders=DataLoader(val, batch_size=40))
    return trainer


if __name__ == "__main__":
    main()
