"""What ``shardwise checkpoint ls`` and ``shardwise checkpoint export`` do, as functions returning data.

:func:`listing` describes every checkpoint of a directory (the complete ones
and the ``.tmp`` leftovers of a save that did not finish): step, the layout
that wrote it, its size on disk and whether it is intact (the checksums of
:func:`shardwise.checkpoint.verify`). :func:`export` writes a checkpoint's
model in a form that needs no shardwise to load: one plain state dict file,
or, for a Hugging Face model, a directory ``from_pretrained`` loads. The
command line (:mod:`shardwise.cli`) only prints what these return.
"""
from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

from shardwise.checkpoint import pretrained
from shardwise.checkpoint import store as checkpoint
from shardwise.checkpoint.store import MANIFEST, MANIFEST_SIZES
from shardwise.extras import require

_STEP = re.compile(r"^step_(\d{8})(\.tmp)?$")
FORMATS = ("pt", "hf")


class NoCheckpoint(FileNotFoundError):
    """The directory does not exist or holds no checkpoint."""


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory (or the ``.tmp`` leftover of a save that did not finish)."""

    path: str
    step: int
    complete: bool                     # False: ``step_N.tmp``, a save that never reached its rename
    strategy: str | None               # None when no manifest says (a leftover written before its manifest)
    world_size: int | None
    sizes: dict[str, int] | None       # {"dp", "tp", "pp"}
    bytes: int                         # every file of the directory
    problem: str | None                # None when intact; else what is wrong, naming the file

    @property
    def ok(self) -> bool:
        return self.complete and self.problem is None

    @property
    def integrity(self) -> str:
        return "ok" if self.problem is None else self.problem


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (powers of 1024; bytes below 1 KiB as they are)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:  # removed while we looked (a save's cleanup)
                pass
    return total


def _short(problem: str, path: str) -> str:
    """verify's sentence with the file named relative to its checkpoint, kind first.

    '/x/step_4/__0_0.distcp is corrupted (checksum mismatch)' -> 'corrupted: __0_0.distcp checksum mismatch'.
    """
    text = problem.replace(path.rstrip(os.sep) + os.sep, "")
    m = re.fullmatch(r"(.+) is missing or unreadable \((\w+)\)", text)
    if m:
        return f"unreadable: {m[1]} is missing or unreadable ({m[2]})"
    m = re.fullmatch(r"(.+) is corrupted \(checksum mismatch\)", text)
    if m:
        return f"corrupted: {m[1]} checksum mismatch"
    m = re.fullmatch(r"(.+) is missing", text)
    if m:
        return f"missing: {m[1]}"
    return text


def _manifest(path: str) -> dict[str, Any] | None:
    try:
        return checkpoint.read_manifest(path)
    except (OSError, ValueError):
        return None


def describe(path: str) -> Entry:
    """The :class:`Entry` of one checkpoint directory (``step_N`` or ``step_N.tmp``), checksums verified."""
    path = os.path.normpath(path)
    m = _STEP.match(os.path.basename(path))
    manifest = _manifest(path)
    complete = not (m and m[2])
    if m:
        step = int(m[1])
    elif manifest is not None and "step" in manifest:
        step = int(manifest["step"])
    else:
        raise NoCheckpoint(f"{path} is not a checkpoint: its name is not step_NNNNNNNN and it has no {MANIFEST}")
    problem: str | None
    if not complete:
        problem = "incomplete: a save that did not finish (.tmp, never renamed); a resume ignores it"
    else:
        found = checkpoint.verify(path)
        problem = _short(found, path) if found else None
        if problem is None and manifest is not None and manifest.get("format") not in checkpoint.READS:
            problem = (f"format {manifest.get('format')}: written by an older shardwise (every tensor flattened), "
                       f"this one reads formats {', '.join(map(str, checkpoint.READS))}")
    m_ = manifest or {}
    sizes = m_.get("sizes")
    return Entry(path=path, step=step, complete=complete, strategy=m_.get("strategy"),
                 world_size=m_.get("world_size"),
                 sizes={k: int(v) for k, v in sizes.items()} if isinstance(sizes, dict) else None,
                 bytes=_size(path), problem=problem)


def _is_step_dir(path: str) -> bool:
    return bool(_STEP.match(os.path.basename(os.path.normpath(path)))) or os.path.isfile(os.path.join(path, MANIFEST))


def listing(directory: str) -> list[Entry]:
    """Every checkpoint under ``directory``, oldest first (a step directory itself: just that one).

    Raises :class:`NoCheckpoint` for a directory that does not exist or holds
    no checkpoint, complete or not.
    """
    if not os.path.exists(directory):
        raise NoCheckpoint(f"{directory} does not exist")
    if not os.path.isdir(directory):
        raise NoCheckpoint(f"{directory} is not a directory")
    if _is_step_dir(directory):
        return [describe(directory)]
    names = [d for d in os.listdir(directory) if _STEP.match(d) and os.path.isdir(os.path.join(directory, d))]
    if not names:
        raise NoCheckpoint(f"{directory} holds no checkpoint (no step_NNNNNNNN directory)")
    entries = [describe(os.path.join(directory, d)) for d in names]
    return sorted(entries, key=lambda e: (e.step, e.complete))


def newest(entries: list[Entry]) -> Entry | None:
    """The newest complete checkpoint (the one a resume tries first), intact or not."""
    complete = [e for e in entries if e.complete]
    return complete[-1] if complete else None


def newest_intact(entries: list[Entry]) -> Entry | None:
    """The checkpoint a resume would use."""
    good = [e for e in entries if e.ok]
    return good[-1] if good else None


def exit_code(entries: list[Entry]) -> int:
    """0 when the newest complete checkpoint is intact, 1 otherwise (``.tmp`` leftovers do not count)."""
    last = newest(entries)
    return 0 if last is not None and last.ok else 1


HEADER = ("STEP", "STRATEGY", "RANKS", *(d.upper() for d in MANIFEST_SIZES), "BYTES", "SIZE", "INTEGRITY")


def rows(entries: list[Entry]) -> list[tuple[str, ...]]:
    def n(v: Any) -> str:
        return "?" if v is None else str(v)

    out = []
    for e in entries:
        s = e.sizes or {}
        out.append((str(e.step), n(e.strategy), n(e.world_size), *(n(s.get(d)) for d in MANIFEST_SIZES),
                    str(e.bytes), human_bytes(e.bytes), e.integrity))
    return out


def table(entries: list[Entry]) -> list[str]:
    """The lines ``shardwise checkpoint ls`` prints: a header, then one line per checkpoint, oldest first."""
    body = rows(entries)
    widths = [max(len(r[i]) for r in [HEADER, *body]) for i in range(len(HEADER) - 1)]
    right = {0, 2, 3, 4, 5, 6, 7}  # numbers align right

    def line(r: tuple[str, ...]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join([*cells, r[-1]])

    return [line(HEADER), *(line(r) for r in body)]


def summary(entries: list[Entry]) -> str:
    """One sentence: is the newest checkpoint intact, and which one a resume would take."""
    last, good = newest(entries), newest_intact(entries)
    if last is None:
        return "no complete checkpoint: a resume starts from step 0"
    if last.ok:
        return f"newest checkpoint: step {last.step}, intact"
    fallback = (f"a resume falls back to step {good.step}" if good
                else "no intact checkpoint: a resume starts from step 0")
    return f"newest checkpoint step {last.step} is not intact ({last.integrity}); {fallback}"


# --- export ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exported:
    source: str                  # the step directory exported
    step: int
    format: str                  # "pt": one state dict file; "hf": a from_pretrained directory
    out: str
    model_class: str | None      # the class the checkpoint's run trained
    skipped: list[tuple[str, str]] = field(default_factory=list)  # newer checkpoints passed over: (path, problem)


def pick(source: str) -> tuple[str, list[tuple[str, str]]]:
    """The step directory to export: ``source`` itself, or the newest intact checkpoint under it.

    Returns it with the newer checkpoints passed over, each with its problem.
    Raises :class:`NoCheckpoint` when there is nothing to export, ValueError
    when ``source`` is a checkpoint that is not intact or every checkpoint
    under it is damaged.
    """
    entries = listing(source)
    if _is_step_dir(source):
        e = entries[0]
        if not e.ok:
            raise ValueError(f"cannot export {e.path}: {e.integrity}")
        return e.path, []
    skipped = []  # type: ignore[var-annotated]
    for e in reversed([e for e in entries if e.complete]):
        if e.ok:
            return e.path, skipped
        skipped.append((e.path, e.integrity))
    if not skipped:
        raise NoCheckpoint(f"{source} holds no complete checkpoint (only leftovers of saves that did not finish)")
    raise ValueError(f"cannot export from {source}: no checkpoint there is intact ("
                     + "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped) + ")")


def _hf_class(model: dict[str, Any], config: Any) -> Any:
    """The Hugging Face model class of the run: the class it recorded, when transformers defines it, else the
    config's ``architectures``. Only classes of transformers are imported (a manifest names no code to run)."""
    import transformers

    name = str(model.get("class", ""))
    module, _, qual = name.rpartition(".")
    candidates = []
    if module == "transformers" or module.startswith("transformers."):
        try:
            candidates.append(getattr(importlib.import_module(module), qual))
        except (ImportError, AttributeError):
            pass
    candidates += [getattr(transformers, a) for a in (getattr(config, "architectures", None) or [])
                   if hasattr(transformers, a)]
    for cls in candidates:
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    raise ValueError(f"the checkpoint's model class {name or '(not recorded)'} is not a transformers model class "
                     "and its config names no architecture transformers has; export with --format pt and load "
                     "the state dict into your class")


def _save_hf(path: str, model: dict[str, Any], out: str) -> str:
    """A directory ``from_pretrained`` loads: the run's config, and ``model.safetensors`` written one tensor at a
    time straight from the checkpoint's pieces (:func:`shardwise.checkpoint.pretrained.write_safetensors`: no full
    state dict, no model instance), each in the dtype it was trained in (a bf16 run exports bf16)."""
    import transformers

    raw = dict(model["hf_config"])
    model_type = raw.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"the checkpoint's Hugging Face config has model_type={model_type!r}, which this "
                         "transformers does not know; export with --format pt")
    config = transformers.CONFIG_MAPPING[model_type].from_dict(raw)  # type: ignore[index]
    cls = _hf_class(model, config)
    config.architectures = [cls.__name__]
    os.makedirs(out, exist_ok=True)
    config.save_pretrained(out)
    pretrained.write_safetensors(path, os.path.join(out, "model.safetensors"))
    return f"{cls.__module__}.{cls.__qualname__}"


def export(source: str, out: str, format: str | None = None) -> Exported:
    """Export a checkpoint's model (``source``: a checkpoints directory, whose newest intact checkpoint is
    taken, or one step directory).

    ``format`` "pt": ``out`` is one file holding the bare model's plain state
    dict (:func:`shardwise.checkpoint.export`); "hf": ``out`` is a directory
    that ``from_pretrained`` loads (a Hugging Face model only). By default
    "hf" when the run trained a Hugging Face model, else "pt". A damaged
    checkpoint is refused with what :func:`shardwise.checkpoint.verify` found.
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; valid: {', '.join(FORMATS)}")
    path, skipped = pick(source)  # verified: intact
    manifest = checkpoint.read_manifest(path)
    model = (manifest.get("run") or {}).get("model") or {}
    hf = model.get("hf_config") is not None
    fmt = format or ("hf" if hf else "pt")
    if fmt == "hf" and not hf:
        raise ValueError(f"cannot export {path} as a Hugging Face directory: its run trained "
                         f"{model.get('class', 'a model')}, not a Hugging Face model (the manifest records no "
                         "hf_config); use --format pt")
    if fmt == "pt" and os.path.isdir(out):
        raise ValueError(f"{out} is a directory; the pt export writes one file (give a file name)")
    if fmt == "hf" and os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out} is a file; the hf export writes a directory")
    if fmt == "hf":
        require("a Hugging Face export (--format hf)", "hf")
    if fmt == "hf":
        cls = _save_hf(path, model, out)
    else:
        checkpoint.export(path, out, check=False)
        cls = model.get("class")  # type: ignore[assignment]
    return Exported(source=path, step=int(manifest["step"]), format=fmt, out=out, model_class=cls, skipped=skipped)


__all__ = ["Entry", "Exported", "NoCheckpoint", "listing", "describe", "newest", "newest_intact", "exit_code",
           "table", "summary", "human_bytes", "pick", "export"]
