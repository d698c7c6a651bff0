"""Built-in workloads (model + data + loss) for the demo, `verify` and `bench`.

All data ships with installed packages: scikit-learn's 8x8 digits and the
Python standard library's own source files as text. Nothing is downloaded.

Public: :class:`Workload`, :func:`load` (what ``shardwise verify --model``
takes: ``digits``, ``gpt``, ``mlp1024`` or ``path.py:factory``), the workloads
:func:`digits`, :func:`gpt` and :func:`mlp1024`, and the text data of the GPT
examples, :class:`CharText` and :func:`stdlib_text`, and :class:`Digits` and :class:`RandomClasses` for
configuration files: the examples and docs import them, and they change only with a note in CHANGELOG.md. The workloads
are for demonstrations and checks, not benchmarks of record: their sizes and
hyperparameters follow what the demo and the tests need. Names starting with
an underscore are internal. :func:`digits` needs scikit-learn (the ``demo``
extra: ``pip install 'shardwise[demo]'``).
"""
from __future__ import annotations

import functools
import gzip
import importlib
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from shardwise.extras import MissingExtra, installed, message
from shardwise.models import GPT, MLP, GPTConfig, lm_loss


@dataclass
class Workload:
    """A model factory (fresh, identically initialised model per call), its data and its loss."""

    name: str
    make_model: Callable[[], nn.Module]
    train: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    test: Any = None
    batch_size: int = 32
    lr: float = 1e-3

    def optimizer(self) -> Callable[..., torch.optim.Optimizer]:
        return functools.partial(torch.optim.AdamW, lr=self.lr)


def _seeded(factory: Callable[[], nn.Module], seed: int = 0) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return factory()
    return make


def _digits_csv() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits.csv.gz (64 pixel values 0-16, then the label, per row), read from the installed
    package without importing scikit-learn: its import costs about 0.9 s in every rank process."""
    spec = importlib.util.find_spec("sklearn") if installed("demo") else None
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra(message("the digits workload (scikit-learn's bundled digits)", "demo"))
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        rows = torch.tensor([[float(v) for v in line.split(",")] for line in f if line.strip()])
    return rows[:, :-1] / 16.0, rows[:, -1].long()


class Digits(TensorDataset):
    """scikit-learn's bundled 8x8 digits, 64 pixel values in [0, 1] and a label below 10: the ``split``
    ``"train"`` (80%, 1437 images) or ``"test"`` (the other 360) of :func:`digits`, always the same images; a
    dataset a configuration file can name (``shardwise.workloads.Digits``)."""

    def __init__(self, split: Literal["train", "test"] = "train") -> None:
        if split not in ("train", "test"):
            raise ValueError(f"Digits(split={split!r}): split is 'train' or 'test'")
        x, y = _digits_csv()
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        cut = int(0.8 * len(x))
        part = perm[:cut] if split == "train" else perm[cut:]
        super().__init__(x[part], y[part])


def digits(hidden: int = 128) -> Workload:
    """scikit-learn's bundled 8x8 digits (1797 images), 80/20 split (:class:`Digits`), an MLP classifier."""
    return Workload("digits", _seeded(lambda: MLP(64, hidden, 2, 10)), Digits("train"), F.cross_entropy,
                    test=Digits("test"), batch_size=64, lr=3e-3)


def mlp1024(samples: int = 1024, width: int = 1024) -> Workload:
    """4 x Linear(1024) MLP on random regression data (the benchmark model of the issues)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, width, generator=g)
    y = torch.randn(samples, width, generator=g)

    def make() -> nn.Module:
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())][:-1])

    return Workload("mlp1024", _seeded(make), TensorDataset(x, y), F.mse_loss, batch_size=64)


class RandomClasses(TensorDataset):
    """``samples`` seeded random ``(features,)`` inputs, each with a random class below ``classes``, in torch's
    default dtype: a dataset a configuration file can name (``shardwise.workloads.RandomClasses``)."""

    def __init__(self, samples: int = 64, features: int = 8, classes: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        super().__init__(torch.randn(samples, features, generator=g),
                         torch.randint(0, classes, (samples,), generator=g))


class CharText(Dataset):  # type: ignore[type-arg]
    """Character-level next-token windows over text (bytes as tokens, vocabulary 128)."""

    def __init__(self, text: str, block: int) -> None:
        data = torch.tensor(list(text.encode("ascii", "ignore")), dtype=torch.long).clamp_(max=127)
        self.data, self.block = data, block

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.block
        chunk = self.data[s:s + self.block + 1]
        return chunk[:-1], chunk[1:]


def stdlib_text(max_chars: int = 200_000) -> str:
    """Python's own standard library sources, a corpus every Python install ships."""
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="ignore") as f:
                t = f.read()
            parts.append(t)
            total += len(t)
            if total >= max_chars:
                break
    return "".join(parts)[:max_chars]


def gpt(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, block: int = 32, max_chars: int = 100_000) -> Workload:
    """A tiny character-level GPT on the standard library's source text."""
    cfg = GPTConfig(vocab_size=128, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    return Workload("gpt", _seeded(lambda: GPT(cfg)), CharText(stdlib_text(max_chars), block), lm_loss,
                    batch_size=16, lr=1e-3)


BUILTIN: dict[str, Callable[[], Workload]] = {"digits": digits, "mlp1024": mlp1024, "gpt": gpt}


def mean_square(out: torch.Tensor, _target: Any) -> torch.Tensor:
    """A loss for models given without data: the mean squared output."""
    return out.float().pow(2).mean()


def load(spec: str) -> Workload:
    """A built-in name or ``path.py:factory``.

    The factory returns a model, or a tuple ``(model, dataset)`` or
    ``(model, dataset, loss_fn)``; it is called once per run, so it must build
    identically initialised models (we seed before calling it). Without a
    dataset, random inputs are made for the model's first Linear layer and
    the loss is the mean squared output.
    """
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        raise ValueError(f"unknown workload {spec!r}; use one of {sorted(BUILTIN)} or path.py:factory")
    path, fn_name = spec.rsplit(":", 1)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file {path!r} does not exist")
    # Imported by its own name from its own folder (added to sys.path), so that
    # spawned workers, which inherit sys.path, can unpickle its classes.
    folder, fname = os.path.split(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.import_module(os.path.splitext(fname)[0])
    factory = getattr(module, fn_name, None)
    if factory is None:
        raise ValueError(f"{path} has no function {fn_name!r}")
    torch.manual_seed(0)
    out = factory()
    model, dataset, loss = (out, None, None) if isinstance(out, nn.Module) else (tuple(out) + (None,))[:3]
    if dataset is None:
        first = next(m for m in model.modules() if isinstance(m, nn.Linear))
        g = torch.Generator().manual_seed(0)
        dataset = TensorDataset(torch.randn(256, first.in_features, generator=g), torch.zeros(256))
        loss = loss or mean_square
    loss = loss or F.cross_entropy
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def make() -> nn.Module:
        torch.manual_seed(0)
        m = factory()
        m = m if isinstance(m, nn.Module) else m[0]
        m.load_state_dict(state)
        return m

    return Workload(spec, make, dataset, loss)
