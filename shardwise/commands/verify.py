"""`shardwise verify`: a strategy against the single-device reference, step by step.

Runs of one workload from the same initial weights: the reference (one
device, float32), the same run in float64, the reference with the samples of
each micro-batch in two other orders, and the strategy (float32). The
reference's largest difference from those other runs is the noise floor:
float32 rounding and nothing else, since all of them compute the same
function. Before
the runs, a probe asks whether the model's output for one sample depends on
the other samples of its batch (BatchNorm in training mode, or any layer that
mixes samples); when it does and the strategy cuts the batch that one forward
sees, the strategy computes another function than the reference, and the
verdict says so whatever the numbers. What this can and cannot prove:
docs/verify.md.
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from shardwise.data import collate, is_stream, leaves, split_batch
from shardwise.fit.trainer import FitResult, Trainer
from shardwise.step import call_model, forward_loss
from shardwise.strategies.base import Strategy
from shardwise.strategies.dp.threaded import DP
from shardwise.strategies.parallel import Parallel
from shardwise.strategies.registry import resolve
from shardwise.torch_private import BatchNormBase
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


def _widened(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Compared in the wider dtype: casting a float64 run down to float32 would add a rounding of its own.
    wide = torch.promote_types(a.dtype, b.dtype)
    return a.to(wide), b.to(wide)


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
        b = run.state_dict[k]
        if a.shape != b.shape:
            raise ValueError(f"{k}: shape {list(b.shape)} differs from the reference's {list(a.shape)}")
        if not a.numel() or not a.is_floating_point():
            continue
        a, b = _widened(a, b)
        d = float((a - b).abs().max())
        rel = d / (atol + float(a.abs().max()))
        if rel > prel:
            worst, prel = k, rel
        pdiff = max(pdiff, d)
    return Comparison(max(dl), max(rl), pdiff, prel, worst)


def widest(comparisons: list[Comparison]) -> Comparison:
    """The largest of each difference over ``comparisons`` (the worst tensor: the one of the largest relative)."""
    top = max(comparisons, key=lambda c: c.max_param_rel)
    return Comparison(max(c.max_loss_diff for c in comparisons), max(c.max_loss_rel for c in comparisons),
                      max(c.max_param_diff for c in comparisons), top.max_param_rel, top.worst_param)


def run_pair(work: Workload, strategy: str | Strategy, devices: int, steps: int,
             **trainer_kwargs: object) -> tuple[FitResult, FitResult]:
    """Train the workload under ``single`` and under ``strategy`` from the same initial weights."""
    def fit(strat: str | Strategy, n: int) -> FitResult:
        return Trainer(strat, n, accelerator="cpu", progress=False, **trainer_kwargs).fit(  # type: ignore[arg-type]
            work.make_model(), work.train, work.loss_fn, work.optimizer(), work.batch_size, steps)
    return fit("single", 1), fit(strategy, devices)


# A correct strategy changes only the order in which float32 sums are taken, so it differs from the
# reference by float32 rounding, of the size the reference differs from the exact result. The floor
# measures the latter against float64 for this workload; FLOOR_FACTOR leaves room for another order's
# rounding being a few times larger (two float32 runs can each sit on either side of the exact one).
FLOOR_FACTOR = 10.0


def tensor_differences(ref: FitResult, run: FitResult, atol: float = 1e-7) -> dict[str, float]:
    """Each floating-point tensor's largest difference relative to its own scale (as :func:`compare`)."""
    out: dict[str, float] = {}
    for k, a in ref.state_dict.items():
        if a.numel() and a.is_floating_point():
            a, b = _widened(a, run.state_dict[k])
            out[k] = float((a - b).abs().max()) / (atol + float(a.abs().max()))
    return out


# ---- the float64 twin -----------------------------------------------------------------------
def to_float64(item: Any) -> Any:
    """``item`` with every floating-point tensor (or numpy array) in float64, through tuples, lists and dicts;
    integer tensors (token ids, class labels) and everything else unchanged."""
    if isinstance(item, torch.Tensor):
        return item.double() if item.is_floating_point() else item
    if isinstance(item, Mapping):
        return {k: to_float64(v) for k, v in item.items()}
    if isinstance(item, tuple):
        parts = [to_float64(v) for v in item]
        return type(item)(*parts) if hasattr(item, "_fields") else tuple(parts)  # a namedtuple keeps its type
    if isinstance(item, list):
        return [to_float64(v) for v in item]
    dtype = getattr(item, "dtype", None)
    if getattr(dtype, "kind", None) == "f" and hasattr(item, "astype"):  # a numpy array of floats
        return item.astype("float64")
    return item


class Float64Items(Dataset):  # type: ignore[type-arg]
    """A map-style dataset whose items come out through :func:`to_float64` (picklable for spawned ranks)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return to_float64(self.dataset[i])


class Float64Stream(IterableDataset):  # type: ignore[type-arg]
    """An iterable dataset whose items come out through :func:`to_float64`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return (to_float64(item) for item in self.dataset)

    def set_epoch(self, epoch: int) -> None:
        # The Trainer calls set_epoch on a stream that has it before each pass; the wrapped one must see it.
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


def in_float64(dataset: Any) -> Dataset:  # type: ignore[type-arg]
    """``dataset`` with its floating-point tensors cast to float64 item by item, map-style or stream as it was."""
    return Float64Stream(dataset) if is_stream(dataset) else Float64Items(dataset)


# ---- more float32 draws: the reference with the samples of each micro-batch in another order ------------------
# One float32 run against float64 is one draw of the rounding. Where Adam divides a gradient near its eps (a weight
# whose gradient nearly cancels), an element's update moves by 1e3 times that gradient's relative rounding: one
# element then decides its tensor's difference, and two runs' differences there are two draws of one random number.
# Their ratio passes 10 often (the tutorial's GPT: 12.5 in one tensor of 26, on one CPU and not another). The floor is
# the largest difference over several draws: the float64 twin, and the reference itself with the samples of each
# micro-batch in other orders (the order of the sums over samples is what a strategy changes too).
ORDERS = ("reversed", "halves swapped")


@dataclass(frozen=True)
class Reordered:
    """A collate function: the samples of each of the step's ``micro`` micro-batches in another ``order`` (one of
    :data:`ORDERS`), then collated as usual. Each micro-batch keeps its samples (the Trainer cuts the collated
    batch into ``micro`` equal parts along dim 0), so BatchNorm and every loss that is a mean over samples
    compute what they did."""

    micro: int
    order: str

    def __call__(self, samples: list[Any]) -> Any:
        n = -(-len(samples) // self.micro)
        return collate([s for i in range(0, len(samples), n) for s in self.reorder(samples[i:i + n])])

    def reorder(self, part: list[Any]) -> list[Any]:
        half = len(part) // 2
        return part[::-1] if self.order == "reversed" else part[half:] + part[:half]


def _loss64(model: nn.Module, batch: Any, loss_fn: Any, seed: int) -> float:
    """One training-mode forward's loss of a float64 copy of ``model`` (no gradient), torch's RNG seeded first."""
    m = copy.deepcopy(model).cpu().double().train()
    x, y = split_batch(to_float64(batch))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        return float(forward_loss(m, x, y, loss_fn))


def same_in_any_order(work: Workload, micro: int = 1, seed: int = 0) -> bool:
    """Whether the loss of the first micro-batch is the same, in float64, with its samples in each of
    :data:`ORDERS`: a draw in another order is the same run only then. Not so under active dropout (a row's mask
    follows its place, not its sample) or for a model or loss that treats the samples by their place."""
    items = _first_items(work.train, max(1, work.batch_size // micro))
    if len(items) < 2:
        return False
    model = work.make_model()
    first = _loss64(model, collate(items), work.loss_fn, seed)
    return all(abs(_loss64(model, Reordered(1, o)(items), work.loss_fn, seed) - first)
               <= 1e-9 * abs(first) for o in ORDERS)


# ---- does the model couple the samples of a batch? -------------------------------------------
@dataclass(frozen=True)
class Coupling:
    """What :func:`probe_coupling` found.

    ``coupled``: some sample's output changed when other samples of its batch
    did. ``beyond_batchnorm``: it still did with every BatchNorm in eval mode
    (something else mixes samples). ``batchnorm``: the names of the model's
    BatchNorm layers.
    """

    coupled: bool
    beyond_batchnorm: bool
    batchnorm: tuple[str, ...]

    @property
    def only_batchnorm(self) -> bool:
        return self.coupled and not self.beyond_batchnorm


def _first_items(dataset: Any, count: int) -> list[Any]:
    if is_stream(dataset):
        return list(itertools.islice(dataset, count))
    return [dataset[i] for i in range(min(count, len(dataset)))]


def _outputs(model: nn.Module, batch: Any, seed: int, freeze_batchnorm: bool, wide: bool) -> list[torch.Tensor]:
    """The output tensors of one training-mode forward of a fresh copy of ``model`` (no gradient)."""
    m = copy.deepcopy(model).cpu()
    if wide:
        m, batch = m.double(), to_float64(batch)
    m.train()
    if freeze_batchnorm:
        for mod in m.modules():
            if isinstance(mod, BatchNormBase):
                mod.eval()  # normalises with its running statistics: no longer looks at the batch
    x, _ = split_batch(batch)
    # The same seed before each forward: dropout draws the same mask for the same rows, so only the
    # other samples of the batch can make the rows of `a` differ.
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        return [t.detach() for t in leaves(call_model(m, x))]


def _rows_changed(first: list[torch.Tensor], second: list[torch.Tensor], rows: int, rtol: float) -> bool:
    """Whether any output tensor with the batch on dim 0 differs in its first ``rows`` rows."""
    for s, t in zip(first, second):
        if s.dim() == 0 or s.shape != t.shape or s.shape[0] != 2 * rows:
            continue  # not a per-sample tensor (a scalar loss, a shape that lost the batch)
        s, t = s[:rows], t[:rows]
        if not (s.is_floating_point() or s.is_complex()):
            if not torch.equal(s, t):
                return True
            continue
        # Relative to the tensor's scale: a correct model's rows differ only by rounding, if at all
        # (a matrix product may block its sums by the batch's shape, which is the same in both).
        if float((s - t).abs().max()) > rtol * float(s.abs().max()):
            return True
    return False


def probe_coupling(model: nn.Module, dataset: Any, samples: int = 8, seed: int = 0) -> Coupling:
    """Whether ``model``'s output for a sample depends on the other samples of its batch.

    Two batches of the dataset's own items, ``[a; b]`` and ``[a; b']`` (``a``,
    ``b``, ``b'``: ``samples`` items each, ``b'`` other items than ``b``), go
    through copies of the model in training mode, on the CPU, without gradient,
    with torch's RNG seeded alike before each forward. If an output row of ``a``
    changes, the samples are coupled; the probe then runs again with every
    BatchNorm in eval mode to tell whether BatchNorm alone couples them. The
    forwards run in float64, where rounding cannot pass for coupling, or in the
    model's own dtype when it does not run in float64.
    """
    names = tuple(n for n, m in model.named_modules() if isinstance(m, BatchNormBase))
    items = _first_items(dataset, 3 * samples)
    n = len(items) // 3
    if n < 1:
        return Coupling(False, False, names)  # too few items for two distinct batches: nothing can be seen
    batches = [collate(items[:2 * n]), collate(items[:n] + items[2 * n:3 * n])]

    def changed(freeze: bool) -> bool:
        try:
            outs = [_outputs(model, b, seed, freeze, wide=True) for b in batches]
            rtol = 1e-9
        except (RuntimeError, TypeError):  # a kernel without float64
            outs = [_outputs(model, b, seed, freeze, wide=False) for b in batches]
            rtol = 1e-4
        return _rows_changed(outs[0], outs[1], n, rtol)

    coupled = changed(False)
    beyond = coupled and (not names or changed(True))
    return Coupling(coupled, beyond, names)


# ---- does the strategy cut the batch one forward sees? -----------------------------------------
@dataclass(frozen=True)
class BatchSplit:
    """How many samples one forward sees: in the single-device run, and on one rank (or replica) of a strategy.

    ``reference``: ``batch_size / accumulate_grad_batches``. ``per_forward``:
    the strategy's, ``unit`` says whose (``"rank"``, ``"micro-batch"``,
    ``"replica"``). ``no_sync``: why ``sync_batchnorm`` cannot make a split
    BatchNorm equal to the reference under this layout ("" when it can).
    ``sync_possible``: whether the Trainer can apply ``sync_batchnorm`` at all.
    """

    batch_size: int
    reference: int
    per_forward: int
    unit: str
    no_sync: str
    sync_possible: bool

    @property
    def splits(self) -> bool:
        return self.per_forward != self.reference


def batch_split(strategy: str | Strategy, devices: int, batch_size: int,
                accumulate_grad_batches: int = 1) -> BatchSplit:
    """What :class:`BatchSplit` describes, for ``strategy`` on ``devices`` (read from its layout, nothing runs).

    Data-parallel ranks each read ``batch_size / batch_shards``; the Trainer cuts
    that into ``accumulate_grad_batches`` micro-batches, and a pipeline into its
    own (:meth:`~shardwise.parallel.compose.Parallel.effective_microbatches`);
    ``dp`` scatters each micro-batch over its replicas. Tensor parallelism
    splits no batch. SyncBatchNorm reduces over the data-parallel group only
    (``topo.comm("dp")``, see :mod:`shardwise.fit_job`): micro-batches that one
    rank runs one after another are never normalised together.
    """
    strat, k = resolve(strategy), accumulate_grad_batches
    sizes = strat.layout(devices).dims
    shards, dp, procs = strat.batch_shards(devices), sizes.dp, strat.processes(devices)
    local = batch_size // shards
    micro = strat.effective_microbatches(local, sizes.pp, k) if isinstance(strat, Parallel) else k
    per, unit = local // max(1, micro), "micro-batch" if micro > 1 else "rank"
    replicas = len(strat.device_ids) if isinstance(strat, DP) and strat.device_ids is not None else devices
    if isinstance(strat, DP) and replicas > 1:
        per, unit = per // replicas, "replica"
    reference = batch_size // k
    no_sync, possible = "", procs > 1 and dp == shards
    if isinstance(strat, DP) or (procs == 1 and devices > 1):
        no_sync = (f"strategy {strat.name!r} drives every device from one process, with no process group to "
                   "synchronise over (use 'ddp')")
    elif procs > 1 and dp != shards:
        no_sync = (f"the data-parallel group of {strat.name!r} holds {dp - shards} rank(s) that read no data (the "
                   "parameter servers) and would never join the synchronisation")
    elif per * dp != reference:
        no_sync = (f"SyncBatchNorm synchronises over the {dp} data-parallel rank(s), not over the {micro} "
                   f"micro-batches each rank runs one after another, so it would normalise {per * dp} samples at "
                   f"a time; --accumulate {micro} (accumulate_grad_batches={micro}) gives the single-device run "
                   "the same micro-batches")
    return BatchSplit(batch_size, reference, per, unit, no_sync, possible)


def coupling_reason(coupling: Coupling, split: BatchSplit, where: str, sync_batchnorm: bool) -> str | None:
    """Why the strategy cannot equal the reference for this model, or None when nothing stands in the way."""
    if not coupling.coupled or not split.splits:
        return None
    shown = ", ".join(coupling.batchnorm[:5]) + \
        (f" and {len(coupling.batchnorm) - 5} more" if len(coupling.batchnorm) > 5 else "")
    if coupling.only_batchnorm:
        if sync_batchnorm and not split.no_sync:
            return None  # the whole group is normalised together: the same maths as one device
        piece = f"each {split.unit}'s {split.per_forward} samples"
        whole = f"all {split.batch_size} together" if split.reference == split.batch_size else \
            f"{split.reference} at a time"
        one = len(coupling.batchnorm) == 1
        layers = f"BatchNorm layer{'' if one else 's'} {shown} normalise{'s' if one else ''}"
        them = "it" if one else "them"
        text = (f"{layers} {piece} alone under {where}; the single-device run normalises {whole}: not the same "
                "maths.")
        if split.no_sync:
            return f"{text} sync_batchnorm cannot make {them} equal here: {split.no_sync}"
        return f"{text} Trainer(sync_batchnorm=True) / --sync-batchnorm makes {them} equal"
    also = f" (still with its BatchNorm layers {shown} in eval mode)" if coupling.batchnorm else ""
    seen = f"all {split.batch_size}" if split.reference == split.batch_size else \
        f"{split.reference} (of {split.batch_size}, in micro-batches)"
    return (f"the model mixes the samples of a batch in a layer other than BatchNorm{also}: under {where} a forward "
            f"sees only one {split.unit}'s {split.per_forward} samples, where the single-device run's sees {seen}: not "
            "the same maths, and sync_batchnorm synchronises BatchNorm layers only")


# ---- the verdict ---------------------------------------------------------------------------------
@dataclass
class Verdict:
    """A strategy's run against the reference, judged against the noise floor measured alongside.

    Weights are judged tensor by tensor against that tensor's own floor: a
    tensor Adam keeps near zero (a bias whose gradient is zero) differs by
    O(1) relative between any two runs, and must not mask a real
    difference elsewhere. ``reason``, when set, says why the strategy does not
    compute what the reference computes (see :func:`coupling_reason`): the
    verdict is then a mismatch whatever the numbers.
    """

    run: Comparison    # the strategy against the single-device reference
    floor: Comparison  # the reference (float32) against its other draws (see judge), the largest of each
    loss_tol: float
    param_tols: dict[str, float]
    param_diffs: dict[str, float]
    reason: str | None = None
    coupling: Coupling | None = None
    reordered: bool = False  # the floor includes the reference with its micro-batches' samples in other orders

    @property
    def floor_source(self) -> str:
        """What the floor compared the float32 reference with."""
        return "float64" + (f" and itself in {len(ORDERS)} other sample orders" if self.reordered else "")

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
        return self.reason is None and self.losses_equal and self.params_equal


def judge(work: Workload, strategy: str | Strategy, devices: int, steps: int, rtol: float = 1e-6,
          accumulate_grad_batches: int = 1, sync_batchnorm: bool = False, engine: str = "shardwise") -> Verdict:
    """Probe the model for batch coupling, then run the reference, its other draws and the strategy; each
    tolerance (the losses', and each weight tensor's) is the larger of ``rtol`` and ``FLOOR_FACTOR`` times
    the floor's own difference: the largest of the reference's differences from its draws.

    The float64 twin is built by the same factory (the same initial weights, cast exactly) and reads the
    same items with their floating-point tensors cast; it trains the same function, so its difference from
    the reference is float32 rounding only, for any model. The reordered draws (:data:`ORDERS`, through
    :class:`Reordered`) run only when :func:`same_in_any_order` finds them the same run (not under active
    dropout); without them the floor is the twin's alone, which errs toward MISMATCH. ``sync_batchnorm`` goes
    to the strategy's Trainer (where the strategy can apply it at all); a model whose samples are coupled in a
    batch the strategy cuts is a mismatch, with the reason, unless SyncBatchNorm makes the cut exact.
    ``engine``: whose mechanism runs the strategy (``"torch"``: PyTorch's engine for it,
    :mod:`shardwise.strategies.torch_engine.choice`); the reference and its draws run on one device either way.
    """
    strat = resolve(strategy)
    k = accumulate_grad_batches
    coupling = probe_coupling(work.make_model(), work.train, samples=max(1, min(8, work.batch_size // 2)))
    split = batch_split(strat, devices, work.batch_size, k)
    reason = coupling_reason(coupling, split, f"{strat.name} on {devices} devices", sync_batchnorm)

    def fit(s: str | Strategy, n: int, model: nn.Module, data: Any, sync: bool = False,
            under: str = "shardwise", collate_fn: Reordered | None = None) -> FitResult:
        return Trainer(s, n, accelerator="cpu", progress=False, accumulate_grad_batches=k, sync_batchnorm=sync,
                       engine=under).fit(model, data, work.loss_fn, work.optimizer(), work.batch_size, steps,
                                         collate_fn=collate_fn)

    ref = fit("single", 1, work.make_model(), work.train)
    draws = [fit("single", 1, work.make_model().double(), in_float64(work.train))]
    reordered = same_in_any_order(work, k)
    if reordered:
        draws += [fit("single", 1, work.make_model(), work.train, collate_fn=Reordered(k, o)) for o in ORDERS]
    # Only where the Trainer can apply it: one process (dp) refuses it, and the servers of ps never join.
    res = fit(strat, devices, work.make_model(), work.train, sync_batchnorm and split.sync_possible, engine)
    floors = [tensor_differences(ref, d) for d in draws]
    tols = {n: max(rtol, FLOOR_FACTOR * max(f[n] for f in floors)) for n in floors[0]}
    floor = widest([compare(ref, d) for d in draws])
    return Verdict(compare(ref, res), floor, max(rtol, FLOOR_FACTOR * floor.max_loss_rel), tols,
                   tensor_differences(ref, res), reason, coupling, reordered)


def accuracy(model: torch.nn.Module, dataset: object) -> float:
    """Classification accuracy of ``model`` on a (x, y) TensorDataset."""
    x, y = dataset.tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())
