"""`shardwise verify`: a strategy against the single-device reference, step by step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.strategy import Strategy
from shardwise.trainer import FitResult, Trainer
from shardwise.workloads import Workload


@dataclass
class Comparison:
    """Largest differences between a run and the single-device reference."""

    max_loss_diff: float
    max_loss_rel: float
    max_param_diff: float
    max_param_rel: float
    worst_param: str

    def within(self, rtol: float, atol: float = 1e-7) -> bool:
        """Every loss and every weight within ``rtol`` (relative, see :func:`compare`) or ``atol`` (absolute)."""
        return (self.max_loss_rel <= rtol or self.max_loss_diff <= atol) and \
            (self.max_param_rel <= rtol or self.max_param_diff <= atol)


def compare(ref: FitResult, run: FitResult, atol: float = 1e-7) -> Comparison:
    """Largest differences of every step's loss and every final weight.

    A loss is compared relative to its own value. A weight is compared
    relative to the largest magnitude in its tensor (``|a-b| / max|a|``): an
    element that happens to sit near zero has no meaningful relative error of
    its own, and Adam's normalised update turns last-bit differences in
    near-zero gradients into differences of that absolute size.
    """
    if len(ref.losses) != len(run.losses):
        raise ValueError(f"runs differ in length: {len(ref.losses)} vs {len(run.losses)} steps")
    dl = [abs(a - b) for a, b in zip(ref.losses, run.losses)]
    rl = [d / (atol + abs(a)) for d, a in zip(dl, ref.losses)]
    missing = set(ref.state_dict) ^ set(run.state_dict)
    if missing:
        raise ValueError(f"state dicts differ in keys: {sorted(missing)[:8]}")
    worst, pdiff, prel = "", 0.0, 0.0
    for k, a in ref.state_dict.items():
        b = run.state_dict[k].to(a.dtype)
        if a.shape != b.shape:
            raise ValueError(f"{k}: shape {list(b.shape)} differs from the reference's {list(a.shape)}")
        if not a.numel() or not a.is_floating_point():
            continue
        d = float((a - b).abs().max())
        rel = d / (atol + float(a.abs().max()))
        if rel > prel:
            worst, prel = k, rel
        pdiff = max(pdiff, d)
    return Comparison(max(dl), max(rl), pdiff, prel, worst)


def run_pair(work: Workload, strategy: str | Strategy, devices: int, steps: int,
             **trainer_kwargs: object) -> tuple[FitResult, FitResult]:
    """Train the workload under ``single`` and under ``strategy`` from the same initial weights."""
    def fit(strat: str | Strategy, n: int) -> FitResult:
        return Trainer(strat, n, accelerator="cpu", progress=False, **trainer_kwargs).fit(  # type: ignore[arg-type]
            work.make_model(), work.train, work.loss_fn, work.optimizer(), work.batch_size, steps)
    return fit("single", 1), fit(strategy, devices)


def accuracy(model: torch.nn.Module, dataset: object) -> float:
    """Classification accuracy of ``model`` on a (x, y) TensorDataset."""
    x, y = dataset.tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())
