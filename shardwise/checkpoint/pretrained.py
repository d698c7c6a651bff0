"""Pretrained weights read straight into what each rank holds (``init_from=``).

A source is a Hugging Face model directory (``model.safetensors``, or shards
listed by ``model.safetensors.index.json``), one ``.safetensors`` file, or a
shardwise checkpoint (a ``checkpoint_dir``: its newest intact checkpoint, or
one ``step_N`` directory). :func:`open_source` reads only the headers (names,
dtypes, shapes and byte offsets); :func:`match` pairs the source's tensors
with the model's names before any process starts and refuses what does not
fit, naming both sides; :func:`load` copies into each rank's pieces
(:func:`shardwise.checkpoint.pieces.pieces_of`: the same "which rectangle of
which full tensor" that a resume reads), so a rank reads only what it holds.

Safetensors files are read with the ``safetensors`` library: ``safe_open``
for the headers and ``get_slice`` for each rank's rectangle, a bounded run of
rows at a time (:data:`CHUNK_BYTES`), so no more than one chunk is in memory at
once beside the rank's own tensors; each piece is converted to the model's
dtype as it is copied in. Writing (:func:`write_safetensors`) stays ours: the
library's writers take every tensor in memory at once, while ours holds one
(docs/how-to/fine-tune.md, "Reading and writing safetensors").
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors import safe_open

from shardwise.checkpoint import store
from shardwise.checkpoint.held import Held

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CHUNK_BYTES = 4 << 20  # rows read per file read: bounds a rank's read buffer whatever the tensor's size
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}
_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file: the file, its name there, its dtype and shape."""

    file: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """What ``init_from`` names: safetensors ``tensors`` by name, or a shardwise ``checkpoint`` directory (then
    ``shapes`` come from its manifest)."""

    path: str
    shapes: dict[str, list[int]]
    tensors: dict[str, Stored] | None = None
    checkpoint: str | None = None


def header(file: str) -> dict[str, Stored]:
    """The tensors of one safetensors file, from its header (no tensor data is read)."""
    out = {}
    with safe_open(file, framework="pt") as f:
        for name in f.keys():
            part = f.get_slice(name)
            dtype = part.get_dtype()
            if dtype not in _DTYPES:
                raise ValueError(f"{file}: tensor {name} has dtype {dtype}, which shardwise does not read")
            out[name] = Stored(file, name, _DTYPES[dtype], tuple(part.get_shape()))
    return out


def open_source(path: str | os.PathLike[str]) -> Source:
    """The source at ``path`` (headers or manifest only); a path that is none of the kinds is refused."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return _from_files(path, [path])
    if os.path.isfile(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return _from_files(path, [os.path.join(path, x) for x in files])
    if os.path.isfile(os.path.join(path, SINGLE)):
        return _from_files(path, [os.path.join(path, SINGLE)])
    return _from_checkpoint(path)


def _from_files(path: str, files: Sequence[str]) -> Source:
    tensors = {k: v for file in files for k, v in header(file).items()}
    return Source(path, {k: list(v.shape) for k, v in tensors.items()}, tensors=tensors)


def _from_checkpoint(path: str) -> Source:
    chosen = path if os.path.isfile(os.path.join(path, store.MANIFEST)) else store.latest_valid(path)
    if chosen is None:
        raise ValueError(f"init_from={path!r} is not a Hugging Face model directory (no {SINGLE} or {INDEX}), "
                         "a .safetensors file, or a shardwise checkpoint (no manifest.json, and no intact "
                         "step_N checkpoint in it)")
    manifest = store.current_manifest(chosen)
    return Source(path, dict(manifest["shapes"]), checkpoint=chosen)


def match(source: Source, shapes: dict[str, list[int]], aliases: dict[str, str],
          allow_missing: Sequence[str] = ()) -> dict[str, str]:
    """Which source tensor fills each model tensor: ``{model name: source name}``.

    ``shapes``: the model's tensors under their first names (:func:`shardwise.checkpoint.model_shapes`);
    a tied weight may be stored under any of its names (``aliases``: alias -> first name), and is read once.
    ``allow_missing``: fnmatch patterns of model names meant to be new (an adapter, a new head): they keep the
    model's own initialisation. Anything else that does not pair up (a name on one side only, another shape)
    is refused with every such name, both sides shown.
    """
    names = {n: [n] + [a for a, first in aliases.items() if first == n] for n in shapes}
    out: dict[str, str] = {}
    problems: list[str] = []
    for n, shape in shapes.items():
        if any(fnmatch.fnmatchcase(n, p) for p in allow_missing):
            continue
        found = next((a for a in names[n] if a in source.shapes), None)
        if found is None:
            problems.append(f"{n}: in the model {shape}, not in {source.path}")
        elif list(source.shapes[found]) != list(shape):
            problems.append(f"{n}: {source.path} has {source.shapes[found]}, the model {shape}")
        else:
            out[n] = found
    known = {a for n in shapes for a in names[n]}
    extra = [k for k in source.shapes if k not in known and not any(fnmatch.fnmatchcase(k, p) for p in allow_missing)]
    problems += [f"{k}: in {source.path} {source.shapes[k]}, not in the model" for k in extra]
    _refuse_per_expert(source, shapes, extra)
    if problems:
        raise ValueError(f"init_from={source.path}: the weights do not fit the model ({len(problems)} tensors):\n  "
                         + "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
                         + "\nname the modules meant to be new in init_allow_missing=[...] (fnmatch patterns of "
                           "the model's names, which keep the model's own initialisation)")
    return out


def _refuse_per_expert(source: Source, shapes: dict[str, list[int]], extra: list[str]) -> None:
    """A Hugging Face MoE checkpoint stores one tensor per expert; transformers 5 models hold them fused."""
    stored = next((k for k in extra if _PER_EXPERT.search(k)), None)
    fused = next((n for n in shapes if ".experts." in n and not _PER_EXPERT.search(n)), None)
    if stored is not None and fused is not None:
        raise ValueError(f"init_from={source.path} stores the experts one tensor per expert ({stored}), while the "
                         f"model holds them fused in 3-D tensors ({fused}): transformers renames and merges them "
                         "at load (its conversion mapping), which shardwise does not apply; load the model with "
                         "from_pretrained and pass it to fit without init_from")


def load(source: Source, held: Sequence[Held], shapes: dict[str, list[int]], pairs: dict[str, str],
         tp_rank: int = 0, tp_size: int = 1) -> int:
    """Copy the source's tensors into this rank's ``held`` model tensors (in place; optimizer states are not
    read). ``pairs``: :func:`match`'s result (a model tensor it leaves out keeps its value). Returns the bytes
    this rank read from safetensors files (a checkpoint source reads through DCP: 0)."""
    _, pieces = store._dcp()  # the planners, and the pieces of a rank's tensors
    mine = [h for h in held if h.key.startswith("model.") and h.key[len("model."):] in pairs]
    state = pieces.build_state(mine, shapes, tp_rank, tp_size)
    if source.checkpoint is not None:
        _load_checkpoint(source.checkpoint, state, pairs)
        return 0
    assert source.tensors is not None
    read = 0
    with torch.no_grad():
        for key, got in state.items():
            stored = source.tensors[pairs[key[len("model."):]]]
            for offsets, view in got.parts:
                read += read_box(stored, tuple(offsets), view)
    return read


def _load_checkpoint(path: str, state: dict[str, object], pairs: dict[str, str]) -> None:
    dcp, pieces = store._dcp()
    renamed = {f"model.{pairs[k[len('model.'):]]}": v for k, v in state.items()}
    with store._quiet_single_process():
        dcp.load(renamed, checkpoint_id=path, planner=pieces.LoadPlanner())


def read_box(stored: Stored, offsets: tuple[int, ...], out: torch.Tensor) -> int:
    """Copy the rectangle of ``stored`` at ``offsets`` with ``out``'s shape into ``out`` (converting its dtype),
    through ``get_slice``: runs of rows of the rectangle, at most :data:`CHUNK_BYTES` each. Returns the bytes
    read (the rectangle's, in the stored dtype)."""
    with safe_open(stored.file, framework="pt") as f:
        if not stored.shape:
            out.copy_(f.get_tensor(stored.name))
            return out.element_size()
        part = f.get_slice(stored.name)
        row = math.prod(out.shape[1:]) * _itemsize(stored.dtype)
        step = max(1, CHUNK_BYTES // max(1, row))
        inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], out.shape[1:]))
        read = 0
        for r in range(0, out.shape[0], step):
            n = min(step, out.shape[0] - r)
            chunk = _slice(part, (slice(offsets[0] + r, offsets[0] + r + n), *inner))
            read += chunk.numel() * chunk.element_size()
            out.narrow(0, r, n).copy_(chunk)
    return read


def _slice(part: object, box: tuple[slice, ...]) -> torch.Tensor:
    """One rectangle of a ``get_slice`` handle (a function of its own: the tests count the reads)."""
    return part[box]  # type: ignore[index,no-any-return]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write_safetensors(path: str, file: str) -> None:
    """Write the model tensors of the checkpoint at ``path`` into one safetensors ``file``, one tensor at a time:
    the header first (names, dtypes and shapes from DCP's metadata), then each tensor read alone from whatever
    pieces the writing layout stored, so the writer never holds more than one tensor. A tied weight is written
    once, under its first name (as ``save_pretrained`` writes it)."""
    dcp, _ = store._dcp()
    manifest = store.current_manifest(path)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    head: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for k, shape in manifest["shapes"].items():
        dtype = stored[f"model.{k}"].properties.dtype
        n = math.prod(shape) * _itemsize(dtype)
        head[k] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for k, shape in manifest["shapes"].items():
            t = torch.empty(shape, dtype=stored[f"model.{k}"].properties.dtype)
            with store._quiet_single_process():
                dcp.load({f"model.{k}": t}, checkpoint_id=path, no_dist=True)
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]


__all__ = ["CHUNK_BYTES", "Source", "Stored", "header", "load", "match", "open_source", "read_box",
           "write_safetensors"]
