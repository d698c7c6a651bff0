"""Sharded checkpoints through torch.distributed.checkpoint (DCP), resharding on load.

Layout of one checkpoint directory ``<dir>/step_00000010/``:

* the DCP files, written in parallel by every rank (each writes its shards);
* ``manifest.json``: step, world size, strategy and dp/tp/pp sizes, the
  global shape of every tensor, tied aliases, what the run was (batch size,
  optimizer, model class and Hugging Face config), small run state (the fp16
  loss scaler) and a SHA-256 checksum of every file, written by rank 0 last.

The checkpoint is layout-free: every tensor is stored under its name in the
unsplit model with its global shape (``model.<fqn>``, ``optim.<fqn>.<state>``),
and each rank writes only the rectangles of it that it holds (a
tensor-parallel slice, a pipeline stage's layers, a ZeRO/FSDP shard, a
parameter server's range; :mod:`shardwise.checkpoint.pieces`). A load asks for the
rectangles the new layout holds, and DCP reads them from whichever chunks the
old layout wrote, so any layout resumes any other (docs/checkpoints.md).

Writes are atomic: ranks write into ``step_N.tmp`` and rank 0 renames it to
``step_N`` only after every rank finished and the manifest is on disk, so a
crash while saving leaves the previous checkpoint as the latest complete one.
Loading never unpickles arbitrary objects: DCP reads tensors (its own
``.metadata`` is checksummed first), the manifest is JSON, and :func:`export`
reads the model's tensors through DCP.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint.held import Held, named_state, scope_of, unscoped
from shardwise.comm.collectives import Comm
from shardwise.comm.topology import Topology
from shardwise.dims import CP, EP, SIZES, SPLIT_BY, TP
from shardwise.optim.param_groups import json_hyper
from shardwise.step import unwrap

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"


@dataclass
class Restored:
    step: int
    losses: list[float]
    path: str
    extra: dict[str, torch.Tensor]  # run state beside the model (e.g. "scaler": the fp16 loss scaler)
    # Each parameter group's hyperparameters when it was saved (an lr a schedule or a callback changed), but
    # those this run starts with other values (format 3; None for format 2).
    groups: list[dict[str, Any]] | None = None
    callbacks: dict[str, Any] = field(default_factory=dict)  # each callback's state_dict() (format 3)
    loggers: dict[str, Any] = field(default_factory=dict)  # each logger's run_ref() (format 4)
    loop: dict[str, Any] = field(default_factory=dict)  # a hand-written loop's state, JSON (format 6)
    own: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's own tensors (format 6; RNGs)


# 1: shardwise < issue 13, every tensor flattened to 1-D (not readable by this version).
# 2: every tensor under its global shape. 3: format 2, and the manifest keeps each parameter group's
# hyperparameters at the save ("param_groups"), the groups' members in the run record, and each callback's
# state_dict() ("callbacks"). 4: format 3, and the manifest keeps where each logger's run is ("loggers": its
# run_ref(), e.g. the MLflow run id), so that a resumed run logs into the same tracker run. 5: format 4, and keys
# may have a scope ("<scope>/<key>": a DiLoCo run's global weights are model.<fqn>, each replica's own weights and
# inner states replica<r>/model.<fqn> and replica<r>/optim.<fqn>.<state>, the outer optimizer's states
# outer/optim.<fqn>.<state>, its inner step count outer/steps). 6: format 5, and a hand-written loop's state
# (sw.save): the manifest's "loop" (schedulers, registered objects and the prepared loaders' positions, as JSON)
# and tensors of each rank's own under "trainer.rank<r>.<name>" (its RNGs: each rank draws its own dropout masks
# and noise) (read: 2 to 6).
FORMAT = 6
READS = (2, 3, 4, 5, 6)
# The manifest's "sizes": dims.SIZES and cp, in the order messages name them (dp, cp, tp, pp), then ep. A manifest
# written before cp or ep existed has no such key (shown as "?" by `shardwise checkpoint ls`).
MANIFEST_SIZES: tuple[str, ...] = tuple(d for d in SPLIT_BY if d in SIZES or d == CP) + (EP,)


class Checkpointed(Protocol):
    """What a checkpoint needs of a strategy (:class:`shardwise.strategies.base.Strategy` is one): its name,
    and what this rank holds of every tensor of the layout-free checkpoint."""

    @property
    def name(self) -> str: ...

    def checkpoint_held(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology) -> list[Held]: ...


def _dcp() -> tuple[ModuleType, ModuleType]:
    """torch.distributed.checkpoint and the planners built on it (:mod:`shardwise.checkpoint.pieces`), imported
    when a checkpoint is written or read: they take about 0.5 s to load, which a run that never checkpoints
    does not pay."""
    import torch.distributed.checkpoint as dcp

    from shardwise.checkpoint import pieces

    return dcp, pieces


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Global shape of each tensor of the unsplit model's state dict, once per tensor (meta-device models work).

    A tied weight appears under its first name only; :func:`tied_aliases` lists its other names.
    """
    return {n: list(t.shape) for n, t in named_state(unwrap(model))}


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """State-dict names that are another name of an earlier tensor (tied weights): alias -> saved name."""
    m = unwrap(model)
    first = {id(t): k for k, t in named_state(m)}
    return {k: first[id(v)] for k, v in m.state_dict(keep_vars=True).items() if first[id(v)] != k}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns each time it runs without a process group; one process is a case we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _checksums(path: str, comm: Comm) -> dict[str, str]:
    """SHA-256 of every file of a checkpoint being written, on rank 0 of ``comm`` (an empty dict elsewhere).

    Each rank hashes the files it wrote itself (DCP names them ``__<rank>_<n>.distcp``), at the same time as the
    others, and rank 0 gathers them and hashes the rest (DCP's ``.metadata``): a save no longer waits while one
    rank reads every file of the checkpoint."""
    names = sorted(os.listdir(path))
    mine = {f: _sha256(os.path.join(path, f)) for f in names if f.startswith(f"__{comm.rank}_")}
    if comm.size > 1:
        every = comm.all_gather_object(mine, name="checkpoint.hashes")
        mine = {f: h for part in every for f, h in part.items()}
    if comm.rank != 0:
        return {}
    return {f: mine[f] if f in mine else _sha256(os.path.join(path, f)) for f in names}


def scoped_optimizers(optimizer: torch.optim.Optimizer) -> dict[str, torch.optim.Optimizer]:
    """The optimizers whose states the checkpoint keys of ``optimizer``'s run hold, by the scope of their keys
    (:func:`~shardwise.checkpoint.held.scoped`): the optimizer itself, unscoped, unless it lists its own
    (a DiLoCo replica's inner optimizer and the outer one)."""
    own = getattr(optimizer, "scoped_optimizers", None)
    return own() if own is not None else {"": optimizer}


def materialize(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (so a checkpoint can be loaded into them in place).

    One step with zero gradients through the real torch optimizer (the
    innermost one, for wrappers that keep it as ``.optimizer``), then the
    parameters are put back: only the states' existence matters, their values
    are overwritten by the load. An optimizer that keeps no state on this rank
    says so with ``keeps_state = False`` and is never stepped here (a
    parameter-server worker's, whose ``step()`` pushes gradients to the
    servers: stepping it would send a push nobody waits for).
    """
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer) and getattr(inner, "keeps_state", True):
        inner = inner.optimizer  # type: ignore[attr-defined]
    if not getattr(inner, "keeps_state", True):
        return
    # Frozen parameters never get a gradient, so training gives them no state either.
    params = [p for g in inner.param_groups for p in g["params"] if p.requires_grad]
    if all(len(inner.state.get(p, {})) for p in params):
        return
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    with torch.no_grad():
        for p, _, _ in saved:
            p.grad = torch.zeros_like(p)
        inner.step()
        for p, data, grad in saved:
            p.copy_(data)
            p.grad = grad


def read_manifest(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)  # type: ignore[no-any-return]


def current_manifest(path: str) -> dict[str, Any]:
    """The manifest of a checkpoint in the format this shardwise reads; another format is refused."""
    manifest = read_manifest(path)
    if manifest.get("format") not in READS:
        raise ValueError(f"checkpoint {path} has format {manifest.get('format')}, this shardwise reads formats "
                         f"{' and '.join(map(str, READS))} (every tensor under its global shape); format 1 was written "
                         "by shardwise before layout-free checkpoints and is not converted")
    return manifest


def _state(strat: Checkpointed, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology,
           shapes: dict[str, list[int]], step: int, losses: list[float],
           extra: dict[str, torch.Tensor] | None = None, own: dict[str, torch.Tensor] | None = None
           ) -> dict[str, Any]:
    _, pieces = _dcp()
    held = strat.checkpoint_held(model, optimizer, topo)
    state: dict[str, Any] = dict(pieces.build_state(held, shapes, topo.coord(TP), topo.size(TP)))
    state["trainer.step"] = torch.tensor(step, dtype=torch.int64)
    state["trainer.losses"] = torch.tensor(losses, dtype=torch.float64)
    state["trainer.rng"] = torch.get_rng_state()
    for k, v in (extra or {}).items():
        state[f"trainer.{k}"] = v
    for k, v in (own or {}).items():  # a key of each rank's own: every rank writes its tensors
        state[f"{_own_prefix(topo.rank)}{k}"] = v
    return state


def _own_prefix(rank: int) -> str:
    return f"trainer.rank{rank}."


@dataclass
class Pending:
    """One checkpoint to write: ``state`` (DCP's, views of the live tensors, or their staged copies for a save
    in the background) and every manifest entry but the files' checksums, which exist only once it is written."""

    directory: str
    step: int
    state: dict[str, Any]
    manifest: dict[str, Any]
    keep: int | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"step_{self.step:08d}")


def prepare(directory: str, step: int, losses: list[float], strat: Checkpointed, model: nn.Module,
            optimizer: torch.optim.Optimizer, topo: Topology, shapes: dict[str, list[int]],
            keep: int | None = None, aliases: dict[str, str] | None = None,
            run: dict[str, Any] | None = None, extra: dict[str, torch.Tensor] | None = None,
            callbacks: dict[str, Any] | None = None, loggers: dict[str, Any] | None = None,
            loop: dict[str, Any] | None = None, own: dict[str, torch.Tensor] | None = None) -> Pending:
    """Checkpoint ``step`` (after ``step`` optimizer steps) as :func:`write` takes it; nothing is written yet.
    The arguments are :func:`save`'s."""
    manifest = {"format": FORMAT, "step": step, "param_groups": [json_hyper(g) for g in optimizer.param_groups],
                "callbacks": callbacks or {}, "loggers": loggers or {}, "world_size": topo.world_size,
                "strategy": strat.name,
                "sizes": {d: topo.size(d) for d in MANIFEST_SIZES}, "shapes": shapes,
                "aliases": aliases or {}, "run": run or {}, "loop": loop or {},
                "extra": {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in (extra or {}).items()}}
    return Pending(directory, step, _state(strat, model, optimizer, topo, shapes, step, losses, extra, own),
                   manifest, keep)


def write(pending: Pending, comm: Comm) -> str:
    """Write ``pending`` collectively over ``comm`` (every rank of the run: the world, or a group of its own for
    a save in the background); returns its path.

    Ranks write into ``step_N.tmp``; rank 0 writes the manifest last and renames the directory, so the checkpoint
    appears complete or not at all, then deletes those beyond the newest ``keep``."""
    dcp, pieces = _dcp()
    final = pending.path
    tmp = final + ".tmp"
    if comm.rank == 0:
        os.makedirs(pending.directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier("checkpoint")
    with _quiet_single_process():
        dcp.save(pending.state, checkpoint_id=tmp, planner=pieces.SavePlanner(), process_group=comm.group)
    comm.barrier("checkpoint")
    files = _checksums(tmp, comm)
    if comm.rank == 0:
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({**pending.manifest, "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)  # atomic on POSIX: the checkpoint appears complete or not at all
        if pending.keep is not None:
            for old in checkpoints(pending.directory)[:-pending.keep]:
                shutil.rmtree(old, ignore_errors=True)
    comm.barrier("checkpoint")
    return final


def save(directory: str, step: int, losses: list[float], strat: Checkpointed, model: nn.Module,
         optimizer: torch.optim.Optimizer, topo: Topology, shapes: dict[str, list[int]],
         keep: int | None = None, aliases: dict[str, str] | None = None,
         run: dict[str, Any] | None = None, extra: dict[str, torch.Tensor] | None = None,
         callbacks: dict[str, Any] | None = None, loggers: dict[str, Any] | None = None,
         loop: dict[str, Any] | None = None, own: dict[str, torch.Tensor] | None = None) -> str:
    """Write checkpoint ``step`` (after ``step`` optimizer steps) collectively; returns its path.

    With ``keep``, older checkpoints beyond the newest ``keep`` are deleted once
    the new one is complete. ``extra``: small replicated tensors of run state (the
    fp16 loss scaler), restored by :func:`load` as :attr:`Restored.extra`. ``loop``: a hand-written loop's state
    (JSON, rank 0's), ``own``: this rank's own small tensors; :attr:`Restored.loop` and :attr:`Restored.own`.
    """
    return write(prepare(directory, step, losses, strat, model, optimizer, topo, shapes, keep, aliases, run, extra,
                         callbacks, loggers, loop, own), topo.comm("world"))


def verify(path: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be used (naming the file), or None if it is intact."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"{mpath} is missing or unreadable ({e.__class__.__name__})"
    for name, digest in manifest.get("files", {}).items():
        fp = os.path.join(path, name)
        if not os.path.exists(fp):
            return f"{fp} is missing"
        if _sha256(fp) != digest:
            return f"{fp} is corrupted (checksum mismatch)"
    return None


def checkpoints(directory: str) -> list[str]:
    """Complete checkpoint directories, oldest first (``.tmp`` leftovers of a crash are ignored)."""
    if not os.path.isdir(directory):
        return []
    return [os.path.join(directory, d) for d in sorted(os.listdir(directory)) if _STEP_DIR.match(d)]


def latest_valid(directory: str) -> str | None:
    """The newest intact checkpoint; corrupted newer ones are skipped with a warning naming the file."""
    for path in reversed(checkpoints(directory)):
        problem = verify(path)
        if problem is None:
            return path
        warnings.warn(f"skipping checkpoint {path}: {problem}; falling back to the previous one", stacklevel=2)
    return None


def check_compatible(path: str, shapes: dict[str, list[int]], manifest: dict[str, Any] | None = None) -> None:
    """Reject a checkpoint of a different model, listing mismatched keys and shapes."""
    saved = (manifest or current_manifest(path))["shapes"]
    problems = []
    for k in sorted(set(saved) | set(shapes)):
        if k not in shapes:
            problems.append(f"{k}: in the checkpoint {saved[k]}, not in the model")
        elif k not in saved:
            problems.append(f"{k}: in the model {shapes[k]}, not in the checkpoint")
        elif list(saved[k]) != list(shapes[k]):
            problems.append(f"{k}: checkpoint {saved[k]} vs model {shapes[k]}")
    if problems:
        raise ValueError(f"checkpoint {path} was written for a different model; mismatched keys and shapes:\n  "
                         + "\n  ".join(problems))


def load(path: str, strat: Checkpointed, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology,
         shapes: dict[str, list[int]], run: dict[str, Any] | None = None) -> Restored:
    """Restore model, optimizer, step, loss history and RNG from ``path`` in place (collective).

    The parameter groups' saved hyperparameters come back in :attr:`Restored.groups` (the caller sets them
    once its schedule is rebuilt), but those whose starting value differs in ``run`` (this run's record).
    """
    dcp, pieces = _dcp()
    manifest = current_manifest(path)
    check_compatible(path, shapes, manifest)
    step = int(manifest["step"])
    extra = {k: torch.zeros(shape, dtype=getattr(torch, dt)) for k, (shape, dt) in manifest.get("extra", {}).items()}
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    # A checkpoint written before the optimizer's first step (fp16 skipping overflowed steps)
    # holds no optimizer states: the optimizer must then start without any, as that run did. Each scope's
    # optimizer is judged alone (a DiLoCo run's outer optimizer has none before the first sync).
    scopes = {scope_of(k) for k in stored if unscoped(k).startswith("optim.")}
    for scope, opt in scoped_optimizers(optimizer).items():
        if scope in scopes:
            materialize(model, opt)
    mine = _own_prefix(topo.rank)  # this rank's own tensors, where the saving run had this rank
    own = {k[len(mine):]: torch.empty(md.size, dtype=md.properties.dtype)
           for k, md in stored.items() if k.startswith(mine)}
    state = _state(strat, model, optimizer, topo, shapes, 0, [0.0] * step, extra, own)
    state = {k: v for k, v in state.items() if not unscoped(k).startswith("optim.") or scope_of(k) in scopes}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, planner=pieces.LoadPlanner())
    torch.set_rng_state(state["trainer.rng"])
    return Restored(step=int(state["trainer.step"]), losses=[float(v) for v in state["trainer.losses"]], path=path,
                    extra=extra, groups=resumed_hyper(manifest, run), callbacks=manifest.get("callbacks", {}),
                    loggers=manifest.get("loggers", {}), loop=manifest.get("loop", {}), own=own)


def load_model(path: str, strat: Checkpointed, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology,
               shapes: dict[str, list[int]]) -> None:
    """Restore only the model's tensors from ``path`` in place (collective), each rank reading the pieces it holds
    under this layout, whatever layout wrote them: for evaluation and inference (no optimizer state is read)."""
    dcp, pieces = _dcp()
    check_compatible(path, shapes)
    state = {k: v for k, v in _state(strat, model, optimizer, topo, shapes, 0, []).items() if k.startswith("model.")}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, planner=pieces.LoadPlanner())


def resumed_hyper(manifest: dict[str, Any], run: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The saved groups' hyperparameters a resume restores: each one whose value this run starts with is the one
    the saved run started with (a value changed on purpose stays changed; :func:`check_resume` warns)."""
    saved = manifest.get("param_groups")
    if saved is None:
        return None
    was = [g["hyper"] for g in manifest.get("run", {}).get("optimizer", {}).get("groups", [])]
    now = [g["hyper"] for g in (run or {}).get("optimizer", {}).get("groups", [])]
    if len(was) != len(saved) or len(now) != len(saved):
        return saved  # type: ignore[no-any-return]
    return [{k: v for k, v in g.items() if w.get(k) == n.get(k)} for g, w, n in zip(saved, was, now)]


def resume_point(directory: str, topo: Topology) -> str | None:
    """Rank 0 picks the newest intact checkpoint and every rank follows (so all agree)."""
    choice = latest_valid(directory) if topo.rank == 0 else None
    if topo.world_size > 1 and dist.is_initialized():
        return topo.comm("world").all_gather_object(choice, name="checkpoint.pick")[0]  # type: ignore[no-any-return]
    return choice


def export(path: str, out_file: str | None = None, *, check: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint's model as one plain ``state_dict``, written to ``out_file`` (``torch.save``) when given.

    Every key of the bare model's ``state_dict()`` is there, the other names of
    a tied weight included (as the same tensor), so a strict
    ``load_state_dict`` works. Only the model's tensors are read (not the
    optimizer states), each whole, from whichever pieces the writing layout
    stored. ``check=False`` skips the checksums (for a caller that just ran
    :func:`verify`).
    """
    dcp, _ = _dcp()
    if check:
        problem = verify(path)
        if problem:
            raise ValueError(f"cannot export {path}: {problem}")
    try:
        manifest = current_manifest(path)
    except ValueError as e:
        raise ValueError(f"cannot export {path}: {e}") from None
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = [k for k in manifest["shapes"] if f"model.{k}" not in stored]
    if missing:
        raise ValueError(f"cannot export {path}: the manifest lists tensors the checkpoint does not hold: "
                         + ", ".join(missing))
    sd: dict[str, torch.Tensor] = {}
    for k in manifest["shapes"]:
        md = stored[f"model.{k}"]
        sd[k] = torch.empty(md.size, dtype=md.properties.dtype)
    with _quiet_single_process():
        dcp.load({f"model.{k}": v for k, v in sd.items()}, checkpoint_id=path, no_dist=True)
    for alias, name in manifest.get("aliases", {}).items():
        sd[alias] = sd[name]
    if out_file is not None:
        torch.save(sd, out_file)
    return sd
