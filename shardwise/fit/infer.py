"""Evaluation and inference after training: ``trainer.validate``, ``trainer.test`` and ``trainer.predict``.

One pass over a dataset under the trainer's own strategy, with the model as
the strategy holds it (fsdp's shards gathered unit by unit inside the
forward, tp's slices, pp's stages, cp's tokens, ep's experts: never the whole
model on one rank), from the model given or from a checkpoint directory
(``ckpt_path``: each rank reads the pieces it holds, whatever layout wrote it):

* the set is read once, in order, in global batches of ``batch_size`` (the
  last one may be partial), each data-parallel rank its positions ``r, r + N,
  ...`` of every batch (:func:`shardwise.data.eval_batches`); a rank with no
  sample in the last batch runs one it then ignores, so nothing is counted twice;
* each batch runs forward only, in eval mode, under ``torch.no_grad`` and the
  run's autocast, through the strategy's
  :meth:`~shardwise.strategies.base.Strategy.eval_step`;
* only ranks that own the output count (:meth:`~shardwise.strategies.base.
  Strategy.owns_loss`: the last pipeline stage, tensor-parallel rank 0), so
  tensor- and pipeline-parallel peers, which see the same samples, add nothing.

``predict`` returns every sample's output once, in dataset order: the owners
send theirs to rank 0, which puts context-parallel chunks back in sequence
order (:func:`~shardwise.parallel.cp.attention.join_sequence`) and each sample
at its position. ``validate``/``test`` return global metrics: ``loss_fn`` and
plain ``fn(output, target)`` metrics are batch means weighted by the batch's
samples (as fit's validation, :mod:`shardwise.fit.evaluate`); a metric object
with ``update``/``compute`` (torchmetrics) is updated with ``(output, target)``
on every owner and computed once, its states synced over the owners' data
group (dp x cp: the ranks that hold different samples or tokens), so F1, AUC
and other metrics that are not means are exact.
"""
from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise import precision as precision_mod
from shardwise.checkpoint import store as checkpoint
from shardwise.comm.topology import Topology
from shardwise.data import DataSource, batch_len, eval_batches, to_device
from shardwise.dims import CP
from shardwise.fit.evaluate import computed_objects, eval_mode, is_metric_object, output_tensor, reset_objects
from shardwise.fit.job import hf_output_capture
from shardwise.fit.options import FitOptions
from shardwise.parallel.cp.attention import join_sequence
from shardwise.recipe import Built, Recipe, prepare_rank
from shardwise.step import LossFn, StepRun
from shardwise.strategies.base import HasServers, Strategy


def resolve_checkpoint(path: str | os.PathLike[str]) -> str:
    """A checkpoint (a ``step_*`` directory) or a run's checkpoint directory (its newest intact one)."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, checkpoint.MANIFEST)):
        return path
    newest = checkpoint.latest_valid(path)
    if newest is None:
        raise FileNotFoundError(f"ckpt_path={path!r} is neither a checkpoint nor a directory holding one (a "
                                "Trainer(checkpoint_dir=) run's step_* directories)")
    return newest


@dataclass
class Inference:
    """Everything one rank needs for one pass (``kind``: predict, validate or test); pickled into spawned ranks."""

    options: FitOptions
    model: nn.Module
    data: DataSource
    batch_size: int
    kind: str
    loss_fn: LossFn | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    ckpt_path: str | None = None

    def run(self, device: torch.device) -> Any:
        t = self.options
        hf_output_capture(self.model)
        topo = Topology.create(device, t.layout.dims, timeout=t.timeout, debug=t.debug)
        try:
            model = self.build(topo).model
            tally = Tally(self, topo)
            self._pass(model, topo, tally)
            return tally.predictions() if self.kind == "predict" else tally.metrics()
        finally:
            topo.close()

    def build(self, topo: Topology) -> Built:
        """The model as the strategy holds it on this rank (by the one recipe, :func:`shardwise.recipe.prepare_rank`),
        with the checkpoint's weights when one is given."""
        t, strat = self.options, self.options.strategy
        torch.manual_seed(t.seed)
        # Forward only, in eval mode: the precision is the recipe's one option that changes what it computes.
        built = prepare_rank(self.model, strat, topo, Recipe(precision=t.precision))
        if self.ckpt_path is not None:
            checkpoint.load_model(self.ckpt_path, strat, built.model, built.optimizer, topo, built.shapes)
        return built

    def _pass(self, model: nn.Module, topo: Topology, tally: Tally) -> None:
        t, strat = self.options, self.options.strategy
        shards, shard = strat.data_parallel(topo)
        run = StepRun(t.precision)
        owner = strat.owns_loss(topo)
        with eval_mode(model):
            for w, (batch, real) in enumerate(eval_batches(self.data, self.batch_size, shards, shard, t.seed)):
                x, y = precision_mod.cast_batch(t.precision, self.data.split(to_device(batch, topo.device)))
                tally.at = w * self.batch_size + shard if owner and real else None
                strat.eval_step(model, x, y, tally, topo, run)


class Tally:
    """What one rank's owner batches add up to; called by ``eval_step`` as its ``fn(output, target)``."""

    def __init__(self, job: Inference, topo: Topology) -> None:
        self.job, self.topo = job, topo
        self.strat: Strategy = job.options.strategy
        self.at: int | None = None  # the dataset position of this batch's first local sample; None: not counted
        self.rows: list[tuple[int, torch.Tensor]] = []
        # Batch means: the loss (when given) first, then each fn(output, target) metric.
        self.means: dict[str, Any] = ({f"{'val' if job.kind == 'validate' else 'test'}_loss": job.loss_fn}
                                      if job.loss_fn is not None else {})
        self.means.update({k: m for k, m in job.metrics.items() if not is_metric_object(m)})
        self.sums = torch.zeros(1 + len(self.means), dtype=torch.float64)  # samples, then each mean's weighted sum
        self.objects = {k: m for k, m in job.metrics.items() if is_metric_object(m)}
        reset_objects(self.objects, topo)

    def __call__(self, out: Any, y: Any) -> torch.Tensor:
        if self.at is not None:
            if self.job.kind == "predict":
                self.rows.append((self.at, output_tensor(out).detach().cpu()))
            else:
                self._measure(out, y)
        return torch.zeros((), device=self.topo.device)  # (a pipeline's last stage hands a tensor back)

    def _measure(self, out: Any, y: Any) -> None:
        k = batch_len(y) or batch_len(out)
        self.sums[0] += k
        for i, fn in enumerate(self.means.values()):
            v = fn(out, y)
            self.sums[1 + i] += k * float(v.detach() if isinstance(v, torch.Tensor) else v)
        for m in self.objects.values():
            m.update(output_tensor(out).detach(), y)

    # ---- the result --------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The global metrics, on every rank: the batch means summed over the world (non-owners add zeros), the
        metric objects computed on the owners (synced over their data group) and handed to every rank."""
        sums = self.sums.to(self.topo.device)
        self.topo.comm("world").all_reduce(sums, name="metrics.evaluate")
        n = max(float(sums[0]), 1.0)
        out = {k: float(v) / n for k, v in zip(self.means, sums[1:].tolist())}
        return {**out, **computed_objects(self.objects, self.strat, self.topo)}

    def predictions(self) -> torch.Tensor | None:
        """Every sample's output, in dataset order, on rank 0 (None on the other ranks)."""
        world = self.topo.comm("world")
        shards, _ = self.strat.data_parallel(self.topo)
        owner = self.strat.owns_loss(self.topo)
        head = [[at, list(t.shape), str(t.dtype).replace("torch.", "")] for at, t in self.rows]
        every = world.all_gather_object({"part": self.topo.coord(CP), "rows": head} if owner else None,
                                        name="predict.meta")
        if self.topo.rank != 0:
            for _, t in self.rows:
                world.send(t.to(self.topo.device).contiguous(), 0, name="predict.rows")
            return None
        parts: dict[int, dict[int, torch.Tensor]] = {}  # first position -> cp rank -> outputs
        for r, got in enumerate(every):
            if got is None:
                continue
            for i, (at, shape, dtype) in enumerate(got["rows"]):
                t = self.rows[i][1] if r == 0 else _received(world, r, shape, dtype, self.topo.device)
                parts.setdefault(at, {})[got["part"]] = t.cpu()
        return _in_order(parts, shards)


def _received(world: Any, src: int, shape: list[int], dtype: str, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
    world.recv(t, src, name="predict.rows")
    return t


def _in_order(parts: dict[int, dict[int, torch.Tensor]], shards: int) -> torch.Tensor:
    """Each sample's output at its dataset position: a rank's j-th sample of a batch is at ``at + shards * j``;
    context-parallel chunks joined along the sequence first."""
    by_position: dict[int, torch.Tensor] = {}
    for at, by_cp in parts.items():
        chunks = [by_cp[c] for c in sorted(by_cp)]
        whole = chunks[0] if len(chunks) == 1 else join_sequence(chunks, dim=1)
        for j in range(whole.shape[0]):
            by_position[at + shards * j] = whole[j]
    n = len(by_position)
    if sorted(by_position) != list(range(n)):
        raise RuntimeError(f"predict: the outputs cover positions {sorted(by_position)[:8]}..., not 0..{n - 1}")
    return torch.stack([by_position[i] for i in range(n)])


def check_inference(options: FitOptions, kind: str, batch_size: int, loss_fn: LossFn | None,
                    metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Before any process starts: what this pass can run; returns the metrics as a dict."""
    strat = options.strategy
    if isinstance(strat, HasServers):
        raise ValueError(f"strategy {strat.name!r} cannot {kind}: its weights live on the server ranks, which serve "
                         "training steps only; use another strategy (or the model fit returned) to evaluate")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    metrics = dict(metrics or {})
    for name, m in metrics.items():
        if not isinstance(name, str) or not name or name in ("val_loss", "test_loss"):
            raise ValueError(f"metric names must be non-empty strings other than 'val_loss' and 'test_loss' (the "
                             f"loss_fn's), got {name!r}")
        if not (callable(m) or is_metric_object(m)):
            raise TypeError(f"metrics[{name!r}] must be fn(output, target) -> the batch's mean, or a metric object "
                            f"with update() and compute() (torchmetrics), got {type(m).__name__}")
    if kind != "predict" and loss_fn is None and not metrics:
        raise ValueError(f"{kind} computes loss_fn and metrics; pass loss_fn= or metrics= (or predict outputs)")
    return metrics


def spawned_inference(rank: int, device: torch.device, job: bytes, path: str) -> None:
    result = pickle.loads(job).run(device)
    if rank == 0:
        torch.save({"result": result}, path)


__all__ = ["Inference", "check_inference", "is_metric_object", "output_tensor", "resolve_checkpoint",
           "spawned_inference"]
