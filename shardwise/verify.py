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


# A correct strategy changes only the order in which sums are taken; its differences from the
# reference are then of the size the reference has against itself summed in another order.
# The floor is one such other order, not a bound on all of them: FLOOR_FACTOR leaves room.
FLOOR_FACTOR = 10.0


def tensor_differences(ref: FitResult, run: FitResult, atol: float = 1e-7) -> dict[str, float]:
    """Each floating-point tensor's largest difference relative to its own scale (as :func:`compare`)."""
    out: dict[str, float] = {}
    for k, a in ref.state_dict.items():
        b = run.state_dict[k].to(a.dtype)
        if a.numel() and a.is_floating_point():
            out[k] = float((a - b).abs().max()) / (atol + float(a.abs().max()))
    return out


@dataclass
class Verdict:
    """A strategy's run against the reference, judged against the noise floor measured alongside.

    Weights are judged tensor by tensor against that tensor's own floor: a
    tensor Adam keeps near zero (a bias whose gradient is zero) differs by
    O(1) relative between any two orders, and must not mask a real
    difference elsewhere.
    """

    run: Comparison    # the strategy against the single-device reference
    floor: Comparison  # the reference against itself with the gradient summed in another order
    loss_tol: float
    param_tols: dict[str, float]
    param_diffs: dict[str, float]

    @property
    def losses_equal(self) -> bool:
        return self.run.max_loss_rel <= self.loss_tol

    @property
    def worst(self) -> tuple[str, float, float]:
        """(tensor, its relative difference, its tolerance) of the tensor closest to (or past) its tolerance."""
        if not self.param_diffs:
            return ("-", 0.0, 0.0)
        k = max(self.param_diffs, key=lambda n: self.param_diffs[n] / self.param_tols[n])
        return k, self.param_diffs[k], self.param_tols[k]

    @property
    def params_equal(self) -> bool:
        return all(d <= self.param_tols[k] for k, d in self.param_diffs.items())

    @property
    def equal(self) -> bool:
        return self.losses_equal and self.params_equal


def judge(work: Workload, strategy: str | Strategy, devices: int, steps: int, rtol: float = 1e-6,
          accumulate_grad_batches: int = 1) -> Verdict:
    """Run the reference, the noise-floor run and the strategy; each tolerance (the losses', and each
    weight tensor's) is the larger of ``rtol`` and ``FLOOR_FACTOR`` times the floor's own difference.

    The floor run is single-device training with the batch cut into twice as many
    accumulated micro-batches: the same optimisation, its gradient summed in another
    order (a model whose result depends on the micro-batch itself, as BatchNorm's
    does, is not a fair floor; verify it with ``rtol``).
    """
    def fit(strat: str | Strategy, n: int, k: int) -> FitResult:
        return Trainer(strat, n, accelerator="cpu", progress=False, accumulate_grad_batches=k).fit(
            work.make_model(), work.train, work.loss_fn, work.optimizer(), work.batch_size, steps)

    k = accumulate_grad_batches
    if work.batch_size % (2 * k):
        raise ValueError(f"verify measures its noise floor with the batch of {work.batch_size} cut into {2 * k} "
                         f"micro-batches; use a batch size divisible by {2 * k}")
    ref = fit("single", 1, k)
    other = fit("single", 1, 2 * k)
    res = fit(strategy, devices, k)
    floor_t = tensor_differences(ref, other)
    tols = {n: max(rtol, FLOOR_FACTOR * d) for n, d in floor_t.items()}
    floor = compare(ref, other)
    return Verdict(compare(ref, res), floor, max(rtol, FLOOR_FACTOR * floor.max_loss_rel), tols,
                   tensor_differences(ref, res))


def accuracy(model: torch.nn.Module, dataset: object) -> float:
    """Classification accuracy of ``model`` on a (x, y) TensorDataset."""
    x, y = dataset.tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())
