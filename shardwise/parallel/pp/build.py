"""Pipeline parallelism: consecutive layers on different ranks, fed micro-batches.

The model is flattened into a list of *layers* (:func:`pipeline_layers`:
``nn.Sequential`` children, the blocks of shardwise's GPT, of Hugging Face
GPT-2 and Llama, or whatever a model's own ``pipeline_layers()`` returns),
cut into contiguous *stages* (by named split points, or balanced by
parameter count), and each pipeline rank keeps only its stage. Activations
go forward and gradients backward point to point through
:class:`~shardwise.comm.Comm` (so their bytes are counted, under ``pp``); the
loss is computed on the last stage. Which micro-batch runs when is the job of
:mod:`shardwise.parallel.pp.schedules`; this module partitions, and
:mod:`shardwise.parallel.pp.run` runs a step on the model built here
(:func:`~shardwise.parallel.pp.run.pipeline_step`).

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.dims import EP, PP, TP
from shardwise.parallel.dtensor import local
from shardwise.parallel.ep import is_expert
from shardwise.parallel.pp.layers import pipeline_layers, stage_layers
from shardwise.parallel.pp.placement import LOOP, Placement
from shardwise.parallel.tp.apply import gather_tensor, tp_spec


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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.layers) == 1:  # the whole model as its one layer (no pipeline): called as the model is
            return self.layers[0](*args, **kwargs)
        (x,) = args
        for m in self.layers:
            x = m(x)
        return x


@dataclass
class _Tie:
    name: str            # canonical name of the tied parameter
    param: nn.Parameter  # this rank's copy (one per chunk using it: a V puts the embedding and head on one rank)
    owners: list[int]    # pipeline ranks holding a copy, ascending
    counted: bool = True  # the one copy of all that the global gradient norm counts (first rank, first chunk)


class PipelineModel(nn.Module):
    """This rank's model chunks plus what a step and a state-dict gather need to know.

    ``chunks[c]`` is virtual stage ``placement.virtual(rank, c)`` (possibly wrapped by a
    data-parallel module; :class:`~shardwise.parallel.pp.placement.Placement`, the loop
    ``c * stages + rank`` unless a V schedule asked otherwise); calling the model directly
    only works without pipeline ranks to talk to (``stages == 1``).
    """

    def __init__(self, chunks: list[nn.Module], rank: int, stages: int, keys: list[str],
                 claimed: dict[str, torch.Tensor], ties: list[_Tie], device: torch.device,
                 placement: Placement | None = None,
                 copies: Sequence[tuple[nn.Parameter, nn.Parameter]] = ()) -> None:
        super().__init__()
        self.device = device
        self.chunks = nn.ModuleList(chunks)
        self.rank, self.stages = rank, stages
        self.placement = placement or Placement(stages, len(chunks))
        # (first copy, further copy) of weights two chunks of this rank use (a V's embedding and head).
        self.copies = list(copies)
        self.keys = keys
        self.claimed = claimed
        self.ties = ties
        self.meta_sent: set[Any] = set()
        self.meta_recv: dict[Any, tuple[tuple[int, ...], torch.dtype]] = {}
        # The data-parallel wrappers of the chunks (shardwise.parallel.parallelize.Owners; None: DDP or none).
        self.data: Any = None
        # The chunks' context parallelism (shardwise.parallel.cp.apply.ContextParallel; None without cp).
        self.context: Any = None

    def grad_of_tie(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor holding this rank's gradient of tied parameter ``p`` (zeros if it got none).

        Its ``.grad``, unless an FSDP wrapper of a chunk keeps only its reduced piece.
        """
        for w in self.data.wrappers if self.data is not None else []:
            if p in getattr(w, "unit_of", {}):
                return w.grad_piece(p)  # type: ignore[no-any-return]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        # A DTensor's (torch's FSDP2 or tp): its local shard, a view, laid out alike in every stage's copy.
        return local(p.grad)

    def renew(self, new: dict[int, nn.Parameter]) -> None:
        """Point the claims, ties and copies at the parameters that replaced theirs (``id(old) -> new``): an
        engine that swaps a chunk's parameters after the split (torch's FSDP2) keeps the names."""
        self.claimed = {k: new.get(id(t), t) for k, t in self.claimed.items()}
        for t in self.ties:
            t.param = new.get(id(t.param), t.param)
        self.copies = [(new.get(id(f), f), new.get(id(c), c)) for f, c in self.copies]

    def sync_copies(self) -> None:
        """Give every further copy of a weight tied within this rank the first copy's value.

        The copies take the same step from the same summed gradient, so this is a no-op in a run; it
        matters after a checkpoint is loaded, which restores the first copy only (the one claimed under
        the weight's names; the further copy's optimizer state is then stale, but its value is
        replaced here before every step, so it never reaches a forward).

        Under FSDP (zero=3) each copy lives, sharded, in a unit of its own chunk's wrapper: the full
        tensors are freed between uses, so the first copy's shard piece is copied into the further copy's
        instead. Both pieces are elements ``[r*c, r*c+c)`` of the same flattened weight sharded over the
        same group (:meth:`~shardwise.parallel.dp.fsdp_module.FSDPModule.grad_piece`), so this is the whole
        weight's copy done piece by piece, with no collective."""
        with torch.no_grad():
            for first, copy in self.copies:
                src, dst = self._shard_piece(first), self._shard_piece(copy, free=True)
                if src is None and dst is None:
                    copy.copy_(first)
                    continue
                if src is None or dst is None or src.shape != dst.shape:
                    raise ValueError("pipeline: the two copies of a weight tied between two chunks of one rank "
                                     "(a V's embedding and head) are not sharded alike by zero=3 (one frozen, or "
                                     "in units over different groups); their pieces cannot be kept equal")
                dst.copy_(src)

    def _shard_piece(self, p: nn.Parameter, free: bool = False) -> torch.Tensor | None:
        """This rank's stepped piece of ``p`` when an FSDP wrapper shards it (None: ``p`` is whole).

        ``free``: for the further copy, whose unit, still gathered, would keep the stale full values: it is
        freed (a local operation), so that its next use gathers the pieces written here. The first copy's
        unit is left as it is: its gathered values are current."""
        for w in self.data.wrappers if self.data is not None else []:
            u = getattr(w, "unit_of", {}).get(p)
            if u is not None:
                if free:
                    u.reshard()
                i = next(i for i, q in enumerate(u.params) if q is p)  # by identity: == would compare values
                return u.shard_params[i]  # type: ignore[no-any-return]
        return None

    def stage(self, chunk: int) -> PipelineStage:
        c = self.chunks[chunk]
        return getattr(c, "module", c)  # type: ignore[arg-type]

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last virtual stage (the loss): rank 0 under a V placement."""
        return self.placement.rank_of(self.placement.last) == self.rank

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
        """Ids of tied copies whose gradient norm another copy counts (for global clipping)."""
        return {id(t.param) for t in self.ties if not t.counted}


Transform = Callable[[nn.Module, Callable[[str], bool]], nn.Module]


def build_pipeline(model: nn.Module, topo: Topology, split_points: Sequence[str] | None = None, chunks: int = 1,
                   tied: str = "sync", transform: Transform | None = None, shape: str = LOOP) -> PipelineModel:
    """Keep this rank's stage(s) of ``model`` (already on the device); ``transform`` (TP) sees only those.

    The order is fixed here: split first, then ``transform(model, keep)``
    applied to the modules this rank keeps, then the stage modules are cut
    from the transformed model. ``shape`` places the ``p * chunks`` virtual
    stages on the ranks (:mod:`shardwise.parallel.pp.placement`: ``"loop"``, or
    ``"v"`` for the V schedules, :func:`shardwise.parallel.pp.schedules.placement`).
    """
    if tied not in ("sync", "error"):
        raise ValueError(f"tied={tied!r}; valid: 'sync' (keep tied copies in sync) or 'error'")
    p, r, v = topo.size(PP), topo.coord(PP), chunks
    if v < 1 or (v > 1 and p == 1):
        raise ValueError(f"chunks={v}: interleaving needs chunks >= 1 and more than one pipeline stage")
    place = Placement(p, v, shape)
    layers = stage_layers(model, p * v)
    starts = stage_starts(layers, p * v, split_points) + [len(layers)]
    parts = [layers[starts[i]:starts[i + 1]] for i in range(p * v)]
    mine = place.mine(r)
    ties = find_ties(model, parts, p, v, tied, place)
    untie_on_rank(model, ties.get(r, []))
    my_modules = {id(m) for k in mine for _, layer in parts[k] for m in layer.modules()}
    if transform is not None:
        transform(model, lambda name: id(model.get_submodule(name)) in my_modules)
        layers = stage_layers(model, p * v)
        parts = [layers[starts[i]:starts[i + 1]] for i in range(p * v)]
    stages = [PipelineStage(parts[k], k, p * v) for k in mine]
    seen: dict[str, nn.Parameter] = {}
    my_ties, copies = [], []
    for name, local_name, owners in ties.get(r, []):  # in virtual-stage order: the first copy of the first owner counts
        prm = model.get_parameter(local_name)
        my_ties.append(_Tie(name, prm, owners, counted=owners[0] == r and name not in seen))
        if name in seen:
            copies.append((seen[name], prm))
        seen.setdefault(name, prm)
    state = model.state_dict(keep_vars=True)
    held = {id(t) for s in stages for t in list(s.parameters()) + list(s.buffers())}
    # A further chunk's copy of a tied weight is claimed as the rank's first copy: one tensor under its names
    # for the full state and the checkpoint, as on one device (PipelineModel.sync_copies keeps them equal).
    first_of = {id(c): f for f, c in copies}
    claimed = {k: first_of.get(id(t), t) for k, t in state.items() if id(t) in held}
    return PipelineModel(stages, r, p, list(state), claimed, my_ties, topo.device, place, copies)  # type: ignore[arg-type]


def untie_on_rank(model: nn.Module, my_ties: Sequence[tuple[str, str, list[int]]]) -> None:
    """Give each further chunk of this rank that uses a tied parameter its own copy of it.

    Two chunks of one rank can share a weight (the V placement puts the embedding and the head both on rank
    0). A copy per chunk makes that the same case as copies on different ranks: each chunk's data-parallel
    wrapper owns its own parameters, and :func:`~shardwise.parallel.pp.run.sync_ties` sums the copies'
    gradients (here, then over the ranks) before the step, which all copies take alike."""
    first: set[str] = set()
    for canon, local_name, _ in my_ties:
        if canon not in first:
            first.add(canon)
            continue
        owner, _, attr = local_name.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, attr, nn.Parameter(model.get_parameter(local_name).detach().clone(),
                                           requires_grad=model.get_parameter(local_name).requires_grad))


def find_ties(model: nn.Module, parts: list[list[tuple[str, nn.Module]]], p: int, v: int,
              tied: str, place: Placement | None = None) -> dict[int, list[tuple[str, str, list[int]]]]:
    """Parameters used by more than one virtual stage: per rank, (canonical name, name on that rank, owner
    ranks), one entry per virtual stage using it, in virtual-stage order (``place``: the loop by default)."""
    place = place or Placement(p, v)
    names: dict[int, list[str]] = {}
    for n, prm in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(prm), []).append(n)
    mod_name = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    users: dict[int, list[int]] = {}
    for k, part in enumerate(parts):
        for prm in {id(x) for _, layer in part for x in layer.parameters()}:  # type: ignore[assignment]
            users.setdefault(prm, []).append(k)  # type: ignore[arg-type]
    out: dict[int, list[tuple[str, str, list[int]]]] = {}
    for pid, ks in sorted(users.items(), key=lambda kv: names.get(kv[0], ["?"])[0]):
        if len(ks) < 2:
            continue
        canon = names.get(pid, ["?"])[0]
        owners = sorted({place.rank_of(k) for k in ks})
        if tied == "error":
            raise ValueError(f"pipeline: parameter '{canon}' (also {names.get(pid, [])[1:]}) is used by stages "
                             f"{ks}, so it would live on several ranks; weights tied across stages are rejected "
                             "with tied='error' (tied='sync' keeps the copies in sync)")
        for k in ks:
            # This rank's name for the parameter: one under a module of stage k.
            mods = {mod_name[id(m)] for _, layer in parts[k] for m in layer.modules() if id(m) in mod_name}
            local = next(n for n in names[pid] if n.rpartition(".")[0] in mods)
            out.setdefault(place.rank_of(k), []).append((canon, local, owners))
    return out


# ---- the full state dict -------------------------------------------------------
def gather_full_state(pm: PipelineModel, topo: Topology) -> dict[str, torch.Tensor]:
    """The original model's full state dict on every rank: tp shards gathered, then stages exchanged."""
    tp = topo.comm(TP)
    mine: dict[str, torch.Tensor] = {}
    for k in pm.keys:
        if k in pm.claimed:
            t = pm.claimed[k].detach()
            spec = tp_spec(pm.claimed[k])
            t = gather_tensor(t, spec[0], spec[1], tp) if spec is not None else t
            if is_expert(pm.claimed[k]):  # this rank's experts: every ep rank's rows, in rank order
                t = gather_tensor(t, 0, 1, topo.comm(EP), name="ep.state")
            mine[k] = t.contiguous()
    return exchange_stages(pm, mine, topo)


def exchange_stages(pm: PipelineModel, mine: dict[str, torch.Tensor], topo: Topology) -> dict[str, torch.Tensor]:
    """The full state dict on every rank from each stage's whole tensors ``mine`` (this rank's claimed keys)."""
    pp = topo.comm(PP)
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


__all__ = ["PipelineModel", "PipelineStage", "balanced_starts", "build_pipeline", "exchange_stages", "find_ties",
           "gather_full_state", "pipeline_layers", "stage_starts"]
