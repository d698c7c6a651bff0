"""Pipeline parallelism: consecutive layers on different ranks, fed micro-batches.

The model is flattened into a list of *layers* (:func:`pipeline_layers`:
``nn.Sequential`` children, the blocks of shardwise's GPT, of Hugging Face
GPT-2 and Llama, or whatever a model's own ``pipeline_layers()`` returns),
cut into contiguous *stages* (by named split points, or balanced by
parameter count), and each pipeline rank keeps only its stage. Activations
go forward and gradients backward point to point through
:class:`~shardwise.comm.Comm` (so their bytes are counted, under ``pp``); the
loss is computed on the last stage. Which micro-batch runs when is the job of
:mod:`shardwise.parallel.schedules`; this module only partitions and runs.

The loss of each of ``m`` micro-batches is divided by ``m`` before its
backward, so the accumulated gradient is that of the mean over the batch
(equal micro-batch sizes are enforced).

Weights tied across stages (an embedding reused as the output head) are kept
in sync as Megatron-LM does (Shoeybi et al. 2019): every stage holding a copy
starts from the same values and, after the backward passes, the copies'
gradients are summed between those stages, so all take the same step
(``tied="error"`` rejects such models instead).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.comm import Comm, Handle
from shardwise.parallel.checkpointing import SavedActivations
from shardwise.parallel.pipeline_layers import pipeline_layers
from shardwise.parallel.schedules import Action, Recorder, check_message_order, execute, get_schedule
from shardwise.strategy import LossFn
from shardwise.topology import Topology


# ---- partitioning ------------------------------------------------------------------
def layer_sizes(layers: Sequence[tuple[str, nn.Module]]) -> list[int]:
    return [sum(p.numel() for p in m.parameters()) for _, m in layers]


def balanced_starts(sizes: Sequence[int], parts: int) -> list[int]:
    """Start index of each of ``parts`` contiguous groups minimising the largest group's sum.

    The classic linear-partition dynamic programme; ties go to the earliest cut.
    """
    n = len(sizes)
    pre = [0]
    for s in sizes:
        pre.append(pre[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for j in range(1, parts + 1):
        for i in range(j, n + 1):
            for k in range(j - 1, i):
                v = max(best[j - 1][k], pre[i] - pre[k])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, k
    starts, i = [], n
    for j in range(parts, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def stage_starts(layers: Sequence[tuple[str, nn.Module]], parts: int,
                 split_points: Sequence[str] | None = None) -> list[int]:
    """Where each of ``parts`` stages begins: at the named layers, or balanced by parameter count."""
    names = [n for n, _ in layers]
    if len(layers) < parts:
        raise ValueError(f"the model has {len(layers)} pipeline layers ({names}), fewer than the {parts} stages "
                         "asked for; every stage needs at least one layer")
    if not split_points:
        return balanced_starts(layer_sizes(layers), parts)
    if len(split_points) != parts - 1:
        raise ValueError(f"{parts} stages need {parts - 1} split points, got {len(split_points)}: {list(split_points)}")
    starts = [0]
    for sp in split_points:
        if sp not in names:
            raise ValueError(f"split point {sp!r} is not a pipeline layer; layers are {names}")
        i = names.index(sp)
        if i <= starts[-1]:
            raise ValueError(f"split points must name layers in increasing order after the first layer; "
                             f"{sp!r} (layer {i}) does not follow layer {starts[-1]} ({names[starts[-1]]!r})")
        starts.append(i)
    return starts


class PipelineStage(nn.Module):
    """The layers of one stage (or one model chunk of an interleaved schedule)."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], virtual: int, total: int) -> None:
        super().__init__()
        self.names = [n for n, _ in layers]
        self.layers = nn.ModuleList(m for _, m in layers)
        self.virtual, self.total = virtual, total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = m(x)
        return x


@dataclass
class _Tie:
    name: str            # canonical name of the tied parameter
    param: nn.Parameter  # this rank's copy
    owners: list[int]    # pipeline ranks holding a copy, ascending


class PipelineModel(nn.Module):
    """This rank's model chunks plus what a step and a state-dict gather need to know.

    ``chunks[c]`` is virtual stage ``c * stages + rank`` (possibly wrapped by a
    data-parallel module); calling the model directly only works without
    pipeline ranks to talk to (``stages == 1``).
    """

    def __init__(self, chunks: list[nn.Module], rank: int, stages: int, keys: list[str],
                 claimed: dict[str, torch.Tensor], ties: list[_Tie], device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.chunks = nn.ModuleList(chunks)
        self.rank, self.stages = rank, stages
        self.keys = keys
        self.claimed = claimed
        self.ties = ties
        self.meta_sent: set[Any] = set()
        self.meta_recv: dict[Any, tuple[tuple[int, ...], torch.dtype]] = {}
        # Where a tied parameter's gradient lives once the step's backwards are over:
        # its .grad, unless a data-parallel wrapper keeps only a reduced piece (FSDP).
        self.tie_grad: Callable[[nn.Parameter], torch.Tensor] | None = None
        # The data-parallel wrappers of the chunks (shardwise.parallelize.Owners; None: DDP or none).
        self.data: Any = None

    def grad_of_tie(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor holding this rank's gradient of tied parameter ``p`` (zeros if it got none)."""
        if self.tie_grad is not None:
            return self.tie_grad(p)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def stage(self, chunk: int) -> PipelineStage:
        c = self.chunks[chunk]
        return getattr(c, "module", c)  # type: ignore[no-any-return]

    @property
    def is_last(self) -> bool:
        return self.rank == self.stages - 1

    def forward(self, x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        if chunk is not None:
            return self.chunks[chunk](x)  # type: ignore[no-any-return]
        if self.stages > 1:
            raise RuntimeError("this rank holds one pipeline stage of the model; a forward of the whole model "
                               "runs through the schedule (strategy.train_step), not model(x)")
        for c in self.chunks:
            x = c(x)
        return x

    def elsewhere(self) -> set[int]:
        """Ids of tied copies whose gradient norm another stage counts (for global clipping)."""
        return {id(t.param) for t in self.ties if t.owners[0] != self.rank}


Transform = Callable[[nn.Module, Callable[[str], bool]], nn.Module]


def build_pipeline(model: nn.Module, topo: Topology, split_points: Sequence[str] | None = None, chunks: int = 1,
                   tied: str = "sync", transform: Transform | None = None) -> PipelineModel:
    """Keep this rank's stage(s) of ``model`` (already on the device); ``transform`` (TP) sees only those.

    The order is fixed here: split first, then ``transform(model, keep)``
    applied to the modules this rank keeps, then the stage modules are cut
    from the transformed model.
    """
    if tied not in ("sync", "error"):
        raise ValueError(f"tied={tied!r}; valid: 'sync' (keep tied copies in sync) or 'error'")
    p, r, v = topo.size("pp"), topo.coord("pp"), chunks
    if v < 1 or (v > 1 and p == 1):
        raise ValueError(f"chunks={v}: interleaving needs chunks >= 1 and more than one pipeline stage")
    layers = pipeline_layers(model)
    starts = stage_starts(layers, p * v, split_points) + [len(layers)]
    parts = [layers[starts[i]:starts[i + 1]] for i in range(p * v)]
    mine = [r + c * p for c in range(v)]
    ties = find_ties(model, parts, p, v, tied)
    my_modules = {id(m) for k in mine for _, layer in parts[k] for m in layer.modules()}
    if transform is not None:
        transform(model, lambda name: id(model.get_submodule(name)) in my_modules)
        layers = pipeline_layers(model)
        parts = [layers[starts[i]:starts[i + 1]] for i in range(p * v)]
    stages = [PipelineStage(parts[k], k, p * v) for k in mine]
    state = model.state_dict(keep_vars=True)
    held = {id(t) for s in stages for t in list(s.parameters()) + list(s.buffers())}
    claimed = {k: t for k, t in state.items() if id(t) in held}
    my_ties = [_Tie(name, model.get_parameter(local), owners) for name, local, owners in ties.get(r, [])]
    return PipelineModel(stages, r, p, list(state), claimed, my_ties, topo.device)


def find_ties(model: nn.Module, parts: list[list[tuple[str, nn.Module]]], p: int, v: int,
               tied: str) -> dict[int, list[tuple[str, str, list[int]]]]:
    """Parameters used by more than one stage: per rank, (canonical name, name on that rank, owner ranks)."""
    names: dict[int, list[str]] = {}
    for n, prm in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(prm), []).append(n)
    mod_name = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    users: dict[int, list[int]] = {}
    for k, part in enumerate(parts):
        for prm in {id(x) for _, layer in part for x in layer.parameters()}:
            users.setdefault(prm, []).append(k)
    out: dict[int, list[tuple[str, str, list[int]]]] = {}
    for pid, ks in sorted(users.items(), key=lambda kv: names.get(kv[0], ["?"])[0]):
        if len(ks) < 2:
            continue
        canon = names.get(pid, ["?"])[0]
        owners = sorted({k % p for k in ks})
        if tied == "error":
            raise ValueError(f"pipeline: parameter '{canon}' (also {names.get(pid, [])[1:]}) is used by stages "
                             f"{ks}, so it would live on several ranks; weights tied across stages are rejected "
                             "with tied='error' (tied='sync' keeps the copies in sync)")
        if len(owners) < len(ks):
            raise ValueError(f"pipeline: parameter '{canon}' is used by model chunks {ks}, two of which are on the "
                             "same rank; tied weights across chunks of one rank are not supported")
        for k in ks:
            # This rank's name for the parameter: one under a module of stage k.
            mods = {mod_name[id(m)] for _, layer in parts[k] for m in layer.modules() if id(m) in mod_name}
            local = next(n for n in names[pid] if n.rpartition(".")[0] in mods)
            out.setdefault(k % p, []).append((canon, local, owners))
    return out


# ---- running a step ------------------------------------------------------------
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_META = 10  # header: ndim, dtype code, up to 8 dims


class _Runner:
    """Receives, computes and sends for :func:`shardwise.parallel.schedules.execute`."""

    def __init__(self, pm: PipelineModel, comm: Comm, mbs: Sequence[tuple[Any, Any]], loss_fn: LossFn,
                 saved: SavedActivations | None,
                 forward_context: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
                 loss_scale: float = 1.0) -> None:
        self.pm, self.comm, self.mbs, self.loss_fn = pm, comm, mbs, loss_fn
        # Mixed precision: each stage's forward (and the loss) runs under the strategy's
        # autocast, like Strategy.train_step; fp16's loss scale multiplies the loss.
        self.forward_context = forward_context or contextlib.nullcontext
        self.loss_scale = loss_scale
        self.p, self.r, self.v = pm.stages, pm.rank, len(pm.chunks)
        self.last = self.p * self.v - 1
        self.x: dict[tuple[int, int], Any] = {}
        self.out: dict[tuple[int, int], torch.Tensor] = {}
        self.grad: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.sends: list[Handle] = []
        self.saved = saved

    def _k(self, a: Action) -> int:
        return a.chunk * self.p + self.r

    def _key(self, a: Action) -> Any:
        # Every rank of a replica reads the same batch, so the shape of the
        # micro-batch input is known everywhere: the activation shape behind a
        # boundary is sent once per distinct input shape and cached.
        x = self.mbs[a.mb][0]
        return (a.chunk, tuple(x.shape) if isinstance(x, torch.Tensor) else repr(type(x)))

    # -- forward
    def recv_forward(self, a: Action) -> None:
        k, key = self._k(a), (a.chunk, a.mb)
        if k == 0:
            self.x[key] = self.mbs[a.mb][0]
            return
        src, mk = (k - 1) % self.p, self._key(a)
        if mk not in self.pm.meta_recv:
            head = torch.empty(_META, dtype=torch.int64, device=self._device())
            self.comm.irecv(head, src, "pp.meta").wait()
            n = int(head[0])
            self.pm.meta_recv[mk] = (tuple(int(d) for d in head[2:2 + n]), _DTYPES[int(head[1])])
        shape, dtype = self.pm.meta_recv[mk]
        buf = torch.empty(shape, dtype=dtype, device=self._device())
        self.comm.irecv(buf, src, "pp.act").wait()
        self.x[key] = buf.requires_grad_() if buf.is_floating_point() else buf

    def forward(self, a: Action) -> None:
        key = (a.chunk, a.mb)
        ctx = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack) \
            if self.saved is not None else contextlib.nullcontext()
        with ctx, self.forward_context():
            out = self.pm(self.x[key], chunk=a.chunk)
            if self._k(a) == self.last:
                loss = self.loss_fn(out, self.mbs[a.mb][1])
                self.losses.append(loss.detach().float())
                out = loss.float() * (self.loss_scale / len(self.mbs))
        self.out[key] = out

    def send_forward(self, a: Action) -> None:
        k = self._k(a)
        if k == self.last:
            return
        out, dst, mk = self.out[(a.chunk, a.mb)], (k + 1) % self.p, self._key(a)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"pipeline stage {k} returned a {type(out).__name__}; stages must pass one tensor")
        if mk not in self.pm.meta_sent:
            if out.dim() > _META - 2:
                raise ValueError(f"activations with {out.dim()} dims cannot be sent (at most {_META - 2})")
            head = torch.zeros(_META, dtype=torch.int64, device=out.device)
            head[0], head[1] = out.dim(), _DTYPES.index(out.dtype)
            head[2:2 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
            self.sends.append(self.comm.isend(head, dst, "pp.meta"))
            self.pm.meta_sent.add(mk)
        self.sends.append(self.comm.isend(out.detach().contiguous(), dst, "pp.act"))

    # -- backward
    def recv_backward(self, a: Action) -> None:
        k, key = self._k(a), (a.chunk, a.mb)
        if k == self.last:
            return
        out = self.out[key]
        g = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        self.comm.irecv(g, (k + 1) % self.p, "pp.grad").wait()
        self.grad[key] = g

    def backward(self, a: Action, last: bool) -> None:
        key = (a.chunk, a.mb)
        chunk = self.pm.chunks[a.chunk]
        # Data-parallel wrappers reduce gradients only in a chunk's final backward.
        ctx = chunk.no_sync() if (not last and hasattr(chunk, "no_sync")) else contextlib.nullcontext()
        out = self.out.pop(key)
        with ctx:
            torch.autograd.backward(out, self.grad.pop(key, None))

    def send_backward(self, a: Action) -> None:
        k, key = self._k(a), (a.chunk, a.mb)
        x = self.x.pop(key)
        if k == 0:
            return
        g = x.grad if x.grad is not None else torch.zeros_like(x)
        self.sends.append(self.comm.isend(g, (k - 1) % self.p, "pp.grad"))

    def in_flight(self) -> int:
        return len(self.out)

    def saved_bytes(self) -> int:
        return self.saved.current if self.saved is not None else 0

    def _device(self) -> torch.device:
        return self.pm.device

    def finish(self) -> None:
        for h in self.sends:
            h.wait()
        self.sends.clear()


def resplit(micro_batches: Sequence[tuple[Any, Any]], m: int | None) -> list[tuple[Any, Any]]:
    """The trainer's micro-batches, or the same local batch cut into ``m`` equal ones."""
    from shardwise.strategy import iter_chunks

    if m is None:
        return list(micro_batches)
    xs, ys = [x for x, _ in micro_batches], [y for _, y in micro_batches]
    x, y = (torch.cat(xs) if len(xs) > 1 else xs[0]), (torch.cat(ys) if len(ys) > 1 else ys[0])
    n = x.shape[0]
    if m < 1 or n % m:
        raise ValueError(f"pipeline: the local batch of {n} samples does not split into microbatches={m} "
                         f"equal micro-batches (the mean loss needs equal sizes); choose a divisor of {n}")
    return list(zip(iter_chunks(x, m), iter_chunks(y, m)))


def sync_ties(pm: PipelineModel, comm: Comm) -> None:
    """Sum the gradients of tied copies over the stages holding them (same order everywhere: same sum)."""
    for t in pm.ties:
        g = pm.grad_of_tie(t.param)
        others = [o for o in t.owners if o != pm.rank]
        bufs = {o: torch.empty_like(g) for o in others}
        hs = [comm.isend(g.contiguous(), o, "pp.tied") for o in others]
        for o in others:
            comm.irecv(bufs[o], o, "pp.tied").wait()
        for h in hs:
            h.wait()
        total = None
        for o in t.owners:
            part = g if o == pm.rank else bufs[o]
            total = part.clone() if total is None else total + part
        # In place: a data-parallel wrapper may keep the gradient as a view of its bucket or shard.
        g.copy_(total)


def pipeline_step(pm: PipelineModel, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, topo: Topology,
                  schedule: str = "1f1b", microbatches: int | None = None,
                  recorder: Recorder | None = None,
                  forward_context: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
                  loss_scale: float = 1.0) -> torch.Tensor | None:
    """One optimizer step's forwards and backwards; the mean loss on the last stage, None elsewhere.

    ``forward_context`` (e.g. autocast for mixed precision) wraps every stage forward
    and the loss; ``loss_scale`` multiplies the loss before backward (fp16).
    """
    mbs = resplit(micro_batches, microbatches)
    acts = get_schedule(schedule)(pm.stages, len(mbs), pm.rank, len(pm.chunks))
    check_message_order(schedule, pm.stages, len(mbs), len(pm.chunks))
    saved = None
    if recorder is not None and recorder.track_saved:
        # Parameters and the batch itself are not activations (micro-batches are views of one batch).
        data = [t for xy in mbs for t in xy if isinstance(t, torch.Tensor)]
        saved = SavedActivations(pm.parameters(), data)
    runner = _Runner(pm, topo.comm("pp"), mbs, loss_fn, saved, forward_context, loss_scale)
    execute(acts, runner, pm.rank, recorder)
    runner.finish()
    if recorder is not None:
        recorder.step += 1
        if saved is not None:
            recorder.peak_saved_bytes = max(recorder.peak_saved_bytes, saved.peak)
    sync_ties(pm, topo.comm("pp"))
    if not runner.losses:
        return None
    return torch.stack(runner.losses).mean()


def gather_full_state(pm: PipelineModel, topo: Topology) -> dict[str, torch.Tensor]:
    """The original model's full state dict on every rank: tp shards gathered, then stages exchanged."""
    from shardwise.parallel.tp import gather_tensor, tp_spec

    tp, pp = topo.comm("tp"), topo.comm("pp")
    mine: dict[str, torch.Tensor] = {}
    for k in pm.keys:
        if k in pm.claimed:
            t = pm.claimed[k].detach()
            spec = tp_spec(pm.claimed[k])
            mine[k] = (gather_tensor(t, spec[0], spec[1], tp) if spec is not None else t).contiguous()
    listing = pp.all_gather_object([(k, list(t.shape), str(t.dtype)) for k, t in mine.items()], name="pp.keys")
    owner: dict[str, tuple[int, list[int], str]] = {}
    for s, items in enumerate(listing):
        for k, shape, dt in items:
            owner.setdefault(k, (s, shape, dt))
    missing = [k for k in pm.keys if k not in owner]
    if missing:
        raise RuntimeError(f"pipeline: no stage holds {missing[:5]}; the stage layers do not cover the model")
    out: dict[str, torch.Tensor] = {}
    device = pm.device
    for s in range(pp.size):
        keys = [k for k in pm.keys if owner[k][0] == s]
        by_dtype: dict[str, list[str]] = {}
        for k in keys:
            by_dtype.setdefault(owner[k][2], []).append(k)
        for dt, ks in by_dtype.items():
            dtype = getattr(torch, dt.replace("torch.", ""))
            sizes = [int(torch.Size(owner[k][1]).numel()) for k in ks]
            if s == pp.rank:
                flat = torch.cat([mine[k].reshape(-1) for k in ks]) if ks else torch.empty(0, dtype=dtype)
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            if pp.size > 1:
                pp.broadcast(flat, src=s, name="pp.state")
            for k, piece in zip(ks, flat.split(sizes)):
                out[k] = piece.view(owner[k][1]).cpu().clone()
    return {k: out[k] for k in pm.keys}


def __getattr__(name: str) -> Any:
    # The PP strategy is a preset of the composition (shardwise.parallel.compose), which imports this module.
    if name == "PP":
        from shardwise.parallel.compose import PP

        return PP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PipelineModel", "PipelineStage", "balanced_starts", "build_pipeline", "find_ties", "gather_full_state",
           "pipeline_layers", "pipeline_step", "resplit", "stage_starts", "sync_ties"]
